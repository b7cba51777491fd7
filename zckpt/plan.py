"""The plan: which box of which source goes where, as plain frozen values.

Ingest, export, ``zckpt plan`` and ``rank_list_for_transform`` all consume these values,
so the decision of what to read is made once, by pure layout maths, and can be printed,
tested and shipped to Dask workers as data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from zckpt.dtypes import ms_dtype
from zckpt.errors import LayoutError, SourceError
from zckpt.formats.ckpt import EntryInfo
from zckpt.formats.strategy import ParamLayout, StrategyMap
from zckpt.layout import Box, Sharding, global_shape, rank_box, resolve


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
    """``rank``'s copy of ``name`` must equal the copy ``same_as`` writes.

    ``required`` checks run always (an unlisted tensor proves it is replicated this way);
    the others only with ``--verify-replicas``.
    """

    name: str
    rank: int
    same_as: int
    required: bool


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

    def kind_of(self, name: str) -> str:
        return self.kinds[name]

    def writes_of(self, rank: int) -> tuple[Write, ...]:
        return tuple(w for w in self.writes if w.rank == rank)

    def checks_of(self, rank: int, *, verify_replicas: bool) -> tuple[ReplicaCheck, ...]:
        return tuple(c for c in self.checks if c.rank == rank and (c.required or verify_replicas))

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
    order: list[str] = []
    holders: dict[str, list[int]] = {}
    for rank in sorted(indexes):
        for name in indexes[rank]:
            if name not in holders:
                order.append(name)
                holders[name] = []
            holders[name].append(rank)
    tensors: list[TensorSpec] = []
    writes: list[Write] = []
    checks: list[ReplicaCheck] = []
    uncovered: dict[str, tuple[tuple[Box, tuple[int, ...]], ...]] = {}
    for name in order:
        ranks = holders[name]
        first = indexes[ranks[0]][name]
        per_stage = {} if strategy is None else dict(strategy.layouts.get(name, {}))
        listed = {r: _layout_for(strategy, name, _stage_of(r, stage_dev)) for r in ranks}
        if first.kind != "tensor" or not any(listed.values()):
            spec, w, c = _plan_whole(name, first, ranks, indexes, rank_files)
            tensors.append(spec)
            writes.append(w)
            checks.extend(c)
            continue
        spec, w2, c2, holes = _plan_sharded(name, first, ranks, listed, per_stage, indexes, rank_files, stage_dev)
        tensors.append(spec)
        writes.extend(w2)
        checks.extend(c2)
        if holes:
            if require_complete:
                raise SourceError(
                    f"no source file covers region(s) {[h.to_json() for h, _ in holes]} of shape {list(spec.shape)}; "
                    f"they are held by missing source rank(s) {sorted({r for _, rs in holes for r in rs})}",
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


def _plan_whole(
    name: str,
    first: EntryInfo,
    ranks: Sequence[int],
    indexes: Mapping[int, Mapping[str, EntryInfo]],
    rank_files: Mapping[int, str],
) -> tuple[TensorSpec, Write, list[ReplicaCheck]]:
    spec = TensorSpec(name, first.kind, first.ms_type, first.shape)
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
            checks.append(ReplicaCheck(name, r, ranks[0], required=True))
    return spec, Write(name, ranks[0], Box.full(first.shape)), checks


def _plan_sharded(
    name: str,
    first: EntryInfo,
    ranks: Sequence[int],
    listed: Mapping[int, ParamLayout | None],
    per_stage: Mapping[int, ParamLayout],
    indexes: Mapping[int, Mapping[str, EntryInfo]],
    rank_files: Mapping[int, str],
    stage_dev: int,
) -> tuple[TensorSpec, list[Write], list[ReplicaCheck], tuple[tuple[Box, tuple[int, ...]], ...]]:
    shape: tuple[int, ...] | None = None
    shardings: dict[int, Sharding] = {}
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
            g = global_shape(lay, e.shape, param=name)
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
        if lay not in [s.layout for s in shardings.values()]:
            try:
                sh = resolve(lay, g, param=name)
            except LayoutError as err:
                raise LayoutError(err.message, path=rank_files.get(r), param=name) from None
        else:
            sh = next(s for s in shardings.values() if s.layout == lay)
        shardings[r] = sh
    assert shape is not None
    by_box: dict[Box, list[int]] = {}
    for r in ranks:
        box = rank_box(shardings[r], r % stage_dev)
        by_box.setdefault(box, []).append(r)
    writes = [Write(name, rs[0], box) for box, rs in by_box.items()]
    checks = [ReplicaCheck(name, r, rs[0], required=False) for rs in by_box.values() for r in rs[1:]]
    holes = _holes(shape, list(by_box), per_stage, stage_dev)
    spec = TensorSpec(name, "tensor", first.ms_type, shape, dict(per_stage))
    return spec, sorted(writes, key=lambda w: w.rank), checks, holes


def _holes(
    shape: tuple[int, ...], have: Sequence[Box], per_stage: Mapping[int, ParamLayout], stage_dev: int
) -> tuple[tuple[Box, tuple[int, ...]], ...]:
    """Boxes of the layout's partition that no present shard covers, with the global ranks holding them."""
    got = set(have)
    missing: dict[Box, set[int]] = {}
    for stage, lay in sorted(per_stage.items()):
        sh = resolve(lay, shape)
        for r in range(sh.device_num):
            b = rank_box(sh, r)
            if b not in got:
                missing.setdefault(b, set()).add(stage * stage_dev + r)
    return tuple((b, tuple(sorted(rs))) for b, rs in sorted(missing.items()))


def build_export_plan(
    tensors: Sequence[TensorSpec],
    strategy: StrategyMap | None,
    *,
    ranks: Iterable[int] | None = None,
) -> ExportPlan:
    """For every destination rank, the box of every entry it holds.

    Entries the destination strategy does not list are written whole, as MindSpore does for
    ``learning_rate`` and the like.
    """
    if strategy is None:
        device_num, stage_dev = 1, 1
    else:
        stage_dev = strategy.stage_device_num()
        device_num = strategy.device_num()
    wanted = list(range(device_num)) if ranks is None else sorted(set(ranks))
    for r in wanted:
        if not 0 <= r < device_num:
            raise LayoutError(f"destination rank {r} is outside the destination's {device_num} ranks")
    shardings: dict[tuple[str, int], Sharding] = {}
    out: list[RankExport] = []
    for r in wanted:
        stage = _stage_of(r, stage_dev)
        slices: list[Slice] = []
        for t in tensors:
            per = {} if strategy is None else strategy.layouts.get(t.name, {})
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
