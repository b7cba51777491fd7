"""The plan: which box of which source goes where, as plain frozen values.

Ingest, export, ``zckpt plan`` and ``rank_list_for_transform`` all consume these values,
so the decision of what to read is made once, by pure layout maths, and can be printed,
tested and shipped to Dask workers as data.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import LayoutError, SourceError
from zckpt.core.layout import Box, Sharding, global_shape, rank_box, resolve
from zckpt.formats.ckpt import EntryInfo
from zckpt.formats.strategy import ParamLayout, StrategyMap, fold_layout


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint entry in global terms.

    ``layouts`` maps a source pipeline stage to the layout the source strategy gives the
    entry there (empty: not listed, every holder has the whole value).
    """

    name: str
    kind: str
    ms_type: str
    shape: tuple[int, ...]
    layouts: Mapping[int, ParamLayout] = field(default_factory=dict)
    stages: tuple[int, ...] = (0,)
    """Source pipeline stages whose ranks hold this entry."""
    note: str | None = None
    """How the layout was decided when the strategy alone did not say (inferred, corrected)."""

    @property
    def nbytes(self) -> int:
        if self.kind != "tensor":
            return 0
        return math.prod(self.shape) * ms_dtype(self.ms_type).storage.itemsize


@dataclass(frozen=True)
class Write:
    """Source ``rank`` writes its shard of ``name`` into the store at ``box``."""

    name: str
    rank: int
    box: Box


@dataclass(frozen=True)
class ReplicaCheck:
    """``rank``'s shard of ``name`` must equal the store's region ``box``, written by ``same_as``.

    ``required`` checks run always: an unlisted tensor proves it is replicated this way, and
    a parameter shared by several pipeline stages (a tied embedding) must agree across
    them. The others (replicas inside one stage) run with ``--verify-replicas``.
    """

    name: str
    rank: int
    box: Box
    same_as: tuple[int, ...]
    reason: Literal["unlisted", "replica", "shared"]

    @property
    def required(self) -> bool:
        return self.reason != "replica"


@dataclass(frozen=True)
class IngestPlan:
    """Everything ingest will do, per tensor and per source rank."""

    tensors: tuple[TensorSpec, ...]
    writes: tuple[Write, ...]
    checks: tuple[ReplicaCheck, ...]
    rank_files: Mapping[int, str]
    stage_device_num: int
    uncovered: Mapping[str, tuple[tuple[Box, tuple[int, ...]], ...]] = field(default_factory=dict)
    """Per tensor: regions no present shard holds, with the source ranks that would hold them."""
    kinds: Mapping[str, str] = field(default_factory=dict)
    ignored_ranks: tuple[int, ...] = ()
    """Source rank files present but outside the strategy's pipeline stages."""
    left_behind: Mapping[str, object] = field(default_factory=dict)
    """What those rank files hold and the plan does not take (stages, ranks, params; see
    :mod:`zckpt.sources.partial_inputs`)."""
    left_out: tuple[str, ...] = ()
    """Entries the sources hold that ``choice_func`` left out."""

    def kind_of(self, name: str) -> str:
        return self.kinds[name]

    def writes_of(self, rank: int) -> tuple[Write, ...]:
        return self._by_rank[0].get(rank, ())

    def checks_of(self, rank: int, *, verify_replicas: bool) -> tuple[ReplicaCheck, ...]:
        return tuple(c for c in self._by_rank[1].get(rank, ()) if c.required or verify_replicas)

    @cached_property
    def _by_rank(self) -> tuple[dict[int, tuple[Write, ...]], dict[int, tuple[ReplicaCheck, ...]]]:
        """Writes and checks grouped by rank once: scanning them all for every rank is
        quadratic (512 ranks x 10 000 writes took 0.5 s, 4 096 ranks would take minutes)."""
        writes: dict[int, list[Write]] = {}
        checks: dict[int, list[ReplicaCheck]] = {}
        for w in self.writes:
            writes.setdefault(w.rank, []).append(w)
        for c in self.checks:
            checks.setdefault(c.rank, []).append(c)
        return ({r: tuple(v) for r, v in writes.items()}, {r: tuple(v) for r, v in checks.items()})

    def ranks_to_read(self, *, verify_replicas: bool) -> tuple[int, ...]:
        used = {w.rank for w in self.writes}
        used |= {c.rank for c in self.checks if c.required or verify_replicas}
        return tuple(sorted(used))


@dataclass(frozen=True)
class Slice:
    """Destination entry ``name``: the global ``box`` of it that the rank holds."""

    name: str
    box: Box


@dataclass(frozen=True)
class RankExport:
    rank: int
    slices: tuple[Slice, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slices)


@dataclass(frozen=True)
class ExportPlan:
    ranks: tuple[RankExport, ...]
    device_num: int


def _stage_of(rank: int, stage_device_num: int) -> int:
    return rank // stage_device_num if stage_device_num > 0 else 0


def _layout_for(strategy: StrategyMap | None, name: str, stage: int) -> ParamLayout | None:
    if strategy is None:
        return None
    per = strategy.layouts.get(name)
    if not per:
        return None
    if stage in per:
        return per[stage]
    return None


def build_ingest_plan(
    indexes: Mapping[int, Mapping[str, EntryInfo]],
    rank_files: Mapping[int, str],
    strategy: StrategyMap | None,
    *,
    require_complete: bool = True,
) -> IngestPlan:
    """Decide, from the source strategy and the shard headers, which rank writes which box.

    Each distinct box is written once, by its lowest present rank; other holders become
    replica checks. Unlisted tensors held by several ranks must be byte-identical (checked
    during ingest): if they are not, the tensor is sharded with a layout the strategy does
    not tell, and zckpt refuses rather than guess.
    """
    if strategy is None:
        if 0 not in indexes:
            raise SourceError("without a source strategy the full model must be in rank_0, which is missing")
        indexes = {0: indexes[0]}
        stage_dev = 1
    else:
        stage_dev = strategy.stage_device_num()
    holders: dict[str, list[int]] = {}
    sequences: dict[tuple[str, ...], None] = {}
    for rank in sorted(indexes):
        sequences.setdefault(tuple(indexes[rank]), None)
        for name in indexes[rank]:
            holders.setdefault(name, []).append(rank)
    order: list[str] = []
    for seq in sequences:
        order = merge_orders(order, seq)
    tensors: list[TensorSpec] = []
    writes: list[Write] = []
    checks: list[ReplicaCheck] = []
    uncovered: dict[str, tuple[tuple[Box, tuple[int, ...]], ...]] = {}
    cuts = _Cuts()
    layouts, notes = source_layouts(order, holders, indexes, strategy, stage_dev, rank_files, cuts)
    for name in order:
        ranks = holders[name]
        first = indexes[ranks[0]][name]
        stages = tuple(sorted({_stage_of(r, stage_dev) for r in ranks}))
        per_stage = layouts.get(name, {})
        listed = {r: per_stage.get(_stage_of(r, stage_dev)) for r in ranks}
        if first.kind != "tensor" or not any(listed.values()):
            spec, w, c = _plan_whole(name, first, ranks, indexes, rank_files, stages)
            tensors.append(spec)
            writes.append(w)
            checks.extend(c)
            continue
        spec, w2, c2, holes = _plan_sharded(name, first, ranks, listed, per_stage, indexes, rank_files, stage_dev,
                                            cuts)
        spec = replace(spec, stages=stages, note=notes.get(name))
        tensors.append(spec)
        writes.extend(w2)
        checks.extend(c2)
        if holes:
            if require_complete:
                raise SourceError(
                    f"no source file covers region(s) {[h.to_json() for h, _ in holes]} of shape {list(spec.shape)}; "
                    f"they are held by missing source rank(s) {sorted({r for _, rs in holes for r in rs})}",
                    path=", ".join(strategy.sources) if strategy is not None and strategy.sources else None,
                    param=name,
                )
            uncovered[name] = holes
    return IngestPlan(
        tensors=tuple(tensors),
        writes=tuple(writes),
        checks=tuple(checks),
        rank_files=dict(rank_files),
        stage_device_num=stage_dev,
        uncovered=uncovered,
        kinds={t.name: t.kind for t in tensors},
    )


def merge_orders(first: Sequence[str], second: Sequence[str]) -> list[str]:
    """Merge two entry orders, keeping each one's relative order and aligning their common entries.

    Pipeline stages hold different parameters but share the optimizer scalars; putting one
    stage's entries before the other's between shared anchors rebuilds the network's order
    (parameters, then scalars, then optimizer states), which is the order MindSpore's
    compiled destination files have.
    """
    if not first:
        return list(second)  # what the merge below gives (one source order: nothing to align)
    pos = {x: i for i, x in enumerate(first)}
    out: list[str] = []
    taken = 0
    pending: list[str] = []
    for x in second:
        i = pos.get(x)
        if i is None:
            pending.append(x)
        elif i >= taken:
            out.extend(_merge_segment(first[taken:i], pending))
            out.append(x)
            pending = []
            taken = i + 1
    out.extend(_merge_segment(first[taken:], pending))
    return out


def _state_prefix(name: str) -> str:
    return next((p for p in STATE_PREFIXES if name.startswith(p)), "")


def _merge_segment(first: Sequence[str], second: Sequence[str]) -> list[str]:
    """Two stages' entries between the same anchors, grouped by kind when both are.

    An optimizer lists all ``moment1.*`` before all ``moment2.*`` (fixture s21), so when
    each stage's run is grouped by state prefix the groups are merged (each stage's order
    kept inside a group); otherwise the first stage's entries come first.
    """
    groups: list[str] = []
    for x in (*first, *second):
        if _state_prefix(x) not in groups:
            groups.append(_state_prefix(x))

    def grouped(seq: Sequence[str]) -> bool:
        keys = [groups.index(_state_prefix(x)) for x in seq]
        return keys == sorted(keys)

    if not (grouped(first) and grouped(second)):
        return [*first, *second]
    return [x for g in groups for seq in (first, second) for x in seq if _state_prefix(x) == g]


STATE_PREFIXES = ("accu_grads.", "moments.", "moment1.", "moment2.", "adam_m.", "adam_v.", "exp_avg.", "exp_avg_sq.")
"""Prefixes MindSpore optimizers and gradient accumulation give the states of a parameter."""


def state_owner(name: str, known: Iterable[str]) -> str | None:
    """The parameter an optimizer/accumulator state belongs to (``moments.w`` -> ``w``)."""
    names = set(known)
    for prefix in STATE_PREFIXES:
        if name.startswith(prefix) and name[len(prefix) :] in names:
            return name[len(prefix) :]
    return None


def without_opt_shard(lay: ParamLayout) -> ParamLayout:
    return replace(lay, opt_shard_size=0, opt_shard_step=0)


def with_owner_split(
    name: str, per: Mapping[int, ParamLayout], layouts: Mapping[str, Mapping[int, ParamLayout]]
) -> dict[int, ParamLayout]:
    """An optimizer state's layouts with its parameter's uneven split where MindSpore omits it.

    MindSpore lists the states of a ``manual_split`` ``Gather`` table (``moment1.table``...)
    with the table's device matrix and tensor map but without ``param_split_shape`` /
    ``indices_offset``, while their shards hold the table's uneven rows (fixtures s18, s19).
    A state whose layout equals its parameter's apart from those two fields takes them.
    """
    owner = state_owner(name, layouts)
    if owner is None:
        return dict(per)
    out = dict(per)
    for stage, lay in per.items():
        own = layouts[owner].get(stage)
        if (own is not None and own.param_split_shape and not lay.param_split_shape
                and (own.dev_matrix, own.tensor_map) == (lay.dev_matrix, lay.tensor_map)):
            out[stage] = replace(lay, param_split_shape=own.param_split_shape, indices_offset=own.indices_offset)
    return out


def _folded(per: Mapping[int, ParamLayout], shape: tuple[int, ...], name: str) -> dict[int, ParamLayout]:
    """Every stage's layout for the real ``shape`` (JSON expanded layouts folded)."""
    return {s: fold_layout(lay, shape, param=name) for s, lay in per.items()}


def _fits(
    per_stage: Mapping[int, ParamLayout],
    shape: tuple[int, ...],
    ranks: Sequence[int],
    shards: Mapping[int, tuple[int, ...]],
    stage_dev: int,
    cuts: _Cuts,
) -> bool:
    """Do these layouts, applied to ``shape``, give every holder exactly the shard it has?"""
    try:
        for r in ranks:
            lay = per_stage.get(_stage_of(r, stage_dev))
            if lay is None:
                return False
            if cuts.box(cuts.sharding(lay, shape, None), r % stage_dev).shape != shards[r]:
                return False
    except LayoutError:
        return False
    return True


def source_layouts(
    order: Sequence[str],
    holders: Mapping[str, Sequence[int]],
    indexes: Mapping[int, Mapping[str, EntryInfo]],
    strategy: StrategyMap | None,
    stage_dev: int,
    rank_files: Mapping[int, str],
    cuts: _Cuts | None = None,
) -> tuple[dict[str, dict[int, ParamLayout]], dict[str, str]]:
    """The layout of every source entry per stage, where the shapes on disk prove it.

    MindSpore habits that need care: optimizer states may be missing from the strategy
    (``only_trainable_params=True`` in older versions): such a state takes its parameter's
    layout when every holder's shard has exactly the shape that layout gives. And
    ``accu_grads.*`` are listed with their parameter's optimizer-shard fields although the
    saved tensors are not optimizer-sharded (fixture s07): a listed state whose shards do not
    fit its parameter's global shape is re-read without the optimizer split if that fits.
    The states of a ``manual_split`` table are listed without its uneven split and take it
    (:func:`with_owner_split`). JSON expanded layouts are folded onto the global shape the
    shards imply. Anything else that does not fit is left to the checks that refuse it by name.
    """
    layouts: dict[str, dict[int, ParamLayout]] = {}
    notes: dict[str, str] = {}
    if strategy is None:
        return layouts, notes
    cuts = cuts if cuts is not None else _Cuts()
    listed = {name: with_owner_split(name, strategy.layouts[name], strategy.layouts)
              for name in order if strategy.layouts.get(name)}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, per in listed.items():
        r = holders[name][0]
        lay = per.get(_stage_of(r, stage_dev))
        if lay is not None and indexes[r][name].kind == "tensor":
            with contextlib.suppress(LayoutError):  # a misfit is reported later, by name
                shapes[name] = global_shape(lay, indexes[r][name].shape, param=name)
                listed[name] = _folded(per, shapes[name], name)
    layouts.update(listed)
    for name in order:
        ranks = holders[name]
        if indexes[ranks[0]][name].kind != "tensor":
            continue
        owner = state_owner(name, listed)
        if owner is None or owner not in shapes:
            continue
        shards = {r: indexes[r][name].shape for r in ranks}
        target = shapes[owner]
        if name in listed:
            if _fits(listed[name], target, ranks, shards, stage_dev, cuts):
                continue
            fixed = {s: without_opt_shard(lay) for s, lay in listed[name].items()}
            if _fits(fixed, target, ranks, shards, stage_dev, cuts):
                layouts[name] = fixed
                notes[name] = (f"saved without the optimizer split its strategy entry states; read as {owner}'s "
                               "tensor-parallel slices")
            continue
        for cand, how in ((listed[owner], ""), ({s: without_opt_shard(x) for s, x in listed[owner].items()},
                                                " without its optimizer split")):
            if _fits(cand, target, ranks, shards, stage_dev, cuts):
                layouts[name] = dict(cand)
                notes[name] = f"not in the strategy; layout of {owner}{how}, proven by every holder's shard shape"
                break
    return layouts, notes


def _plan_whole(
    name: str,
    first: EntryInfo,
    ranks: Sequence[int],
    indexes: Mapping[int, Mapping[str, EntryInfo]],
    rank_files: Mapping[int, str],
    stages: tuple[int, ...] = (0,),
) -> tuple[TensorSpec, Write, list[ReplicaCheck]]:
    spec = TensorSpec(name, first.kind, first.ms_type, first.shape, stages=stages)
    checks: list[ReplicaCheck] = []
    for r in ranks[1:]:
        e = indexes[r][name]
        if (e.kind, e.ms_type, e.shape) != (first.kind, first.ms_type, first.shape):
            raise SourceError(
                f"not listed in the source strategy, yet rank {ranks[0]} holds {first.ms_type}{list(first.shape)} "
                f"and rank {r} holds {e.ms_type}{list(e.shape)}: it is sharded with a layout the strategy does not "
                "give (save the strategy with only_trainable_params=False)",
                path=rank_files.get(r),
                param=name,
            )
        if first.kind == "tensor":
            checks.append(ReplicaCheck(name, r, Box.full(first.shape), (ranks[0],), "unlisted"))
    return spec, Write(name, ranks[0], Box.full(first.shape)), checks


class _Cuts:
    """The shardings and rank boxes of one plan, each computed once per (layout, shape): the
    layers of a model repeat a few layouts, and hundreds of ranks share each (at 512 ranks,
    76 800 boxes were cut from 40 distinct layouts and shapes)."""

    def __init__(self) -> None:
        self.globals: dict[tuple[ParamLayout, tuple[int, ...]], tuple[int, ...]] = {}
        self.shardings: dict[tuple[ParamLayout, tuple[int, ...]], tuple[Sharding, dict[int, Box]]] = {}

    def global_shape(self, lay: ParamLayout, shard: tuple[int, ...], name: str) -> tuple[int, ...]:
        g = self.globals.get((lay, shard))
        if g is None:
            g = self.globals[(lay, shard)] = global_shape(lay, shard, param=name)
        return g

    def sharding(self, lay: ParamLayout, shape: tuple[int, ...], name: str | None) -> tuple[Sharding, dict[int, Box]]:
        """The resolved layout and its boxes cut so far (stage-local rank -> box): fill with :meth:`box`."""
        got = self.shardings.get((lay, shape))
        if got is None:
            got = self.shardings[(lay, shape)] = (resolve(lay, shape, param=name), {})
        return got

    @staticmethod
    def box(got: tuple[Sharding, dict[int, Box]], local_rank: int) -> Box:
        b = got[1].get(local_rank)
        if b is None:
            b = got[1][local_rank] = rank_box(got[0], local_rank)
        return b


def _plan_sharded(
    name: str,
    first: EntryInfo,
    ranks: Sequence[int],
    listed: Mapping[int, ParamLayout | None],
    per_stage: Mapping[int, ParamLayout],
    indexes: Mapping[int, Mapping[str, EntryInfo]],
    rank_files: Mapping[int, str],
    stage_dev: int,
    cuts: _Cuts | None = None,
) -> tuple[TensorSpec, list[Write], list[ReplicaCheck], tuple[tuple[Box, tuple[int, ...]], ...]]:
    shape: tuple[int, ...] | None = None
    boxes: dict[int, Box] = {}
    cuts = cuts if cuts is not None else _Cuts()
    for r in ranks:
        lay = listed[r]
        e = indexes[r][name]
        if lay is None:
            raise SourceError(
                f"rank {r} holds it but the source strategy gives no layout for its pipeline stage "
                f"{_stage_of(r, stage_dev)}",
                path=rank_files.get(r),
                param=name,
            )
        if e.ms_type != first.ms_type:
            raise SourceError(
                f"dtype {e.ms_type} differs from rank {ranks[0]}'s {first.ms_type}", path=rank_files.get(r), param=name
            )
        try:
            g = cuts.global_shape(lay, e.shape, name)
        except LayoutError as err:
            raise LayoutError(err.message, path=rank_files.get(r), param=name) from None
        if shape is None:
            shape = g
        elif g != shape:
            raise SourceError(
                f"shard shape {list(e.shape)} implies global shape {list(g)}, "
                f"but rank {ranks[0]} implies {list(shape)}",
                path=rank_files.get(r),
                param=name,
            )
        try:
            sh = cuts.sharding(lay, g, name)
        except LayoutError as err:
            raise LayoutError(err.message, path=rank_files.get(r), param=name) from None
        boxes[r] = cuts.box(sh, r % stage_dev)
        want = boxes[r].shape
        if want != e.shape:
            raise SourceError(
                f"holds shape {list(e.shape)} but its strategy layout gives rank {r} the shape {list(want)} "
                f"of global shape {list(g)}",
                path=rank_files.get(r),
                param=name,
            )
    assert shape is not None
    primary = min(_stage_of(r, stage_dev) for r in ranks)
    by_box: dict[Box, list[int]] = {}
    for r in ranks:
        if _stage_of(r, stage_dev) == primary:
            by_box.setdefault(boxes[r], []).append(r)
    writes = [Write(name, rs[0], box) for box, rs in by_box.items()]
    writers = {w.rank for w in writes}
    checks = []
    for r in ranks:
        if r in writers:
            continue
        box = boxes[r]
        same_as = tuple(w.rank for w in writes if w.box.intersect(box) is not None)
        reason: Literal["shared", "replica"] = "shared" if _stage_of(r, stage_dev) != primary else "replica"
        checks.append(ReplicaCheck(name, r, box, same_as, reason))
    holes = _holes(shape, list(by_box), {primary: per_stage[primary]} if primary in per_stage else {}, stage_dev,
                   cuts)
    spec = TensorSpec(name, "tensor", first.ms_type, shape, dict(per_stage))
    return spec, sorted(writes, key=lambda w: w.rank), checks, holes


def _holes(
    shape: tuple[int, ...], have: Sequence[Box], per_stage: Mapping[int, ParamLayout], stage_dev: int,
    cuts: _Cuts | None = None,
) -> tuple[tuple[Box, tuple[int, ...]], ...]:
    """Boxes of the layout's partition that no present shard covers, with the global ranks holding them."""
    got = set(have)
    missing: dict[Box, set[int]] = {}
    cuts = cuts if cuts is not None else _Cuts()
    for stage, lay in sorted(per_stage.items()):
        sh = cuts.sharding(lay, shape, None)
        for r in range(sh[0].device_num):
            b = cuts.box(sh, r)
            if b not in got:
                missing.setdefault(b, set()).add(stage * stage_dev + r)
    return tuple((b, tuple(sorted(rs))) for b, rs in sorted(missing.items()))


def dropped_entries(tensors: Sequence[TensorSpec], strategy: StrategyMap | None) -> frozenset[str]:
    """Entries a destination does not hold: gradient-accumulation buffers (``accu_grads.*``)
    exist only in pipeline training, so a destination whose strategy lists none gets none
    (MindSpore's transform copies them anyway; its compiled destination jobs do not hold them)."""
    if strategy is None or any(n.startswith("accu_grads.") for n in strategy.layouts):
        return frozenset()
    return frozenset(t.name for t in tensors if t.name.startswith("accu_grads."))


def destination_layouts(
    tensors: Sequence[TensorSpec], strategy: StrategyMap | None
) -> dict[str, dict[int, ParamLayout]]:
    """The destination layout of every entry, per destination stage.

    An optimizer state the destination strategy does not list takes its parameter's layout
    when both have the same global shape (older MindSpore saved strategies without them); a
    listed state of a ``manual_split`` table takes the table's uneven split
    (:func:`with_owner_split`, fixture s19); ``accu_grads.*`` are laid out without the
    optimizer split their strategy entries state, because MindSpore does not
    optimizer-shard them (fixture s07); JSON expanded layouts are folded onto the shape.
    """
    if strategy is None:
        return {}
    shapes = {t.name: t.shape for t in tensors}
    out: dict[str, dict[int, ParamLayout]] = {}
    for t in tensors:
        per = dict(strategy.layouts.get(t.name, {}))
        if not per and t.kind == "tensor":
            owner = state_owner(t.name, strategy.layouts)
            if owner is not None and shapes.get(owner) == t.shape:
                per = dict(strategy.layouts[owner])
        elif per and shapes.get(state_owner(t.name, strategy.layouts) or "") == t.shape:
            per = with_owner_split(t.name, per, strategy.layouts)
        if t.name.startswith("accu_grads."):
            per = {s: without_opt_shard(lay) for s, lay in per.items()}
        if per:
            out[t.name] = _folded(per, t.shape, t.name) if t.kind == "tensor" else per
    return out


def _refuse_unlisted_stages(strategy: StrategyMap, ranks: Sequence[int], stage_dev: int) -> None:
    """A destination rank whose pipeline stage the strategy does not list would get no
    listed parameter, only unlisted ones written whole (a file of another stage's tensors):
    the strategy is one stage's file of a pipeline job, or lacks stages."""
    listed = set(strategy.stages)
    for r in ranks:
        if _stage_of(r, stage_dev) not in listed:
            raise LayoutError(
                f"destination rank {r} is in pipeline stage {_stage_of(r, stage_dev)}, which the destination "
                f"strategy does not list (it lists stage(s) {sorted(listed)} only): give the merged strategy of "
                "every stage (merge-strategies) or the directory of every rank's strategy file",
                path=", ".join(strategy.sources) or None)


def build_export_plan(
    tensors: Sequence[TensorSpec],
    strategy: StrategyMap | None,
    *,
    ranks: Iterable[int] | None = None,
) -> ExportPlan:
    """For every destination rank, the box of every entry it holds.

    Entries the destination strategy does not list are written whole, as MindSpore does for
    ``learning_rate`` and the like; a pipeline destination rank holds only its stage's
    parameters. Three MindSpore habits are handled (see :func:`destination_layouts`).
    """
    if strategy is None:
        device_num, stage_dev = 1, 1
    else:
        stage_dev = strategy.stage_device_num()
        device_num = strategy.device_num()
    dst_layouts = destination_layouts(tensors, strategy)
    dropped = dropped_entries(tensors, strategy)
    wanted = list(range(device_num)) if ranks is None else sorted(set(ranks))
    for r in wanted:
        if not 0 <= r < device_num:
            raise LayoutError(f"destination rank {r} is outside the destination's {device_num} ranks")
    if strategy is not None:
        _refuse_unlisted_stages(strategy, wanted, stage_dev)
    shardings: dict[tuple[str, int], Sharding] = {}
    out: list[RankExport] = []
    for r in wanted:
        stage = _stage_of(r, stage_dev)
        slices: list[Slice] = []
        for t in tensors:
            if t.name in dropped:
                continue
            per = dst_layouts.get(t.name, {})
            if per and stage not in per:
                continue
            lay = per.get(stage) if per else None
            if lay is None or t.kind != "tensor":
                slices.append(Slice(t.name, Box.full(t.shape)))
                continue
            key = (t.name, stage)
            if key not in shardings:
                shardings[key] = resolve(lay, t.shape, param=t.name)
            slices.append(Slice(t.name, rank_box(shardings[key], r % stage_dev)))
        out.append(RankExport(r, tuple(slices)))
    return ExportPlan(tuple(out), device_num)
