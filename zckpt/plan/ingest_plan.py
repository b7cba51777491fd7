"""The ingest plan: which source rank writes which box of each tensor into the store, and
which shards are checked against it as replicas.

Built from the source strategy and the shard headers alone (no payload is read), by pure
layout maths; ingest, transform and ``--dry-run`` act on the :class:`~zckpt.plan.values.IngestPlan`
it returns. The layouts a source entry really has (states missing from the strategy, states
saved without their optimizer split) are decided here from the shapes on disk
(:func:`source_layouts`); the destination side is :mod:`zckpt.plan.export_plan`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Literal

from zckpt.core.errors import LayoutError, SourceError
from zckpt.core.layout import Box, Sharding, global_shape, rank_box, resolve
from zckpt.formats.entries import EntryInfo
from zckpt.formats.strategy import ParamLayout, StrategyMap
from zckpt.plan.entry_layouts import folded, stage_of, state_owner, with_owner_split, without_opt_shard
from zckpt.plan.entry_order import merge_orders
from zckpt.plan.values import IngestPlan, ReplicaCheck, TensorSpec, Write


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
        stages = tuple(sorted({stage_of(r, stage_dev) for r in ranks}))
        per_stage = layouts.get(name, {})
        listed = {r: per_stage.get(stage_of(r, stage_dev)) for r in ranks}
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
            lay = per_stage.get(stage_of(r, stage_dev))
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
    (:func:`~zckpt.plan.entry_layouts.with_owner_split`). JSON expanded layouts are folded onto the global shape the
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
        lay = per.get(stage_of(r, stage_dev))
        if lay is not None and indexes[r][name].kind == "tensor":
            with contextlib.suppress(LayoutError):  # a misfit is reported later, by name
                shapes[name] = global_shape(lay, indexes[r][name].shape, param=name)
                listed[name] = folded(per, shapes[name], name)
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
                f"{stage_of(r, stage_dev)}",
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
    primary = min(stage_of(r, stage_dev) for r in ranks)
    by_box: dict[Box, list[int]] = {}
    for r in ranks:
        if stage_of(r, stage_dev) == primary:
            by_box.setdefault(boxes[r], []).append(r)
    writes = [Write(name, rs[0], box) for box, rs in by_box.items()]
    writers = {w.rank for w in writes}
    checks = []
    for r in ranks:
        if r in writers:
            continue
        box = boxes[r]
        same_as = tuple(w.rank for w in writes if w.box.intersect(box) is not None)
        reason: Literal["shared", "replica"] = "shared" if stage_of(r, stage_dev) != primary else "replica"
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
