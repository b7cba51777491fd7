"""Which source ranks a destination rank reads: MindSpore's ``rank_list_for_transform``, re-derived.

MindSpore does not intersect boxes to answer this question. It *simulates the redistribution*
that would turn the source layout into the destination layout (the C++
``TensorTransform::TransformOperators``, reached through ``_get_needed_rank_list_by_layouts``)
and lists every rank that takes part in an ``AllGather`` the destination rank depends on,
plus the destination rank itself. zckpt reproduces that answer with its own layout maths, in
four steps, each mirroring a step of MindSpore and each checked against MindSpore itself
(``tests/test_ranklist.py``):

1. **MindSpore's view of a layout.** Only layouts matter: MindSpore uses a fake tensor whose
   every piece has ``max(src devices, dst devices)`` elements per dimension. Optimizer
   sharding is turned into an extra split of dimension 0 exactly as
   ``_construct_tensor_layout_for_opt_shard`` does: ``opt_weight_shard_size == -1`` means
   "devices / model-parallel size", nothing happens when ``opt_weight_shard_step`` or the
   size is 0, and when the replicated axes of a flat tensor map are just the first device
   axis (or every axis) MindSpore rebuilds the device matrix from the split counts in tensor
   dimension order (``[repeat, opt, split of dim 0, ...]``, ``repeat = devices // (step *
   size)``). For a tensor map whose axes are not in dimension order this renumbers the
   ranks; MindSpore's list follows that renumbering, so zckpt does too (it is not where the
   compiler puts the data; zckpt's own transforms use :mod:`zckpt.core.layout`).
2. **One device count.** The layout with fewer devices gets a repeat axis in front
   (``_construct_from_to_tensor_layout``); "Cannot transform device_num" when neither count
   divides the other.
3. **Gathered axes.** Both layouts are refined onto one device matrix and one tensor shape
   (MindSpore's ``RedistributionLayoutTransfer``): every boundary of either layout (device
   axes, tensor dimensions, the block edges of split dimensions) must nest in the other's.
   A refined source device (sub-)axis that splits the tensor is *kept* when the destination
   splits the very same tensor piece with it, and *gathered* otherwise (the redistribution
   needs an ``AllGather``, possibly inside an all-to-all, over that axis). When no common
   refinement exists, MindSpore first gathers the source to a replicated tensor, so every
   source axis that splits the tensor is gathered.
4. **The replicas.** A rank joins the list when it agrees with the destination rank on every
   axis that is not gathered: the redistribution never moves data along replicated or kept
   axes, so among replicas MindSpore reads the one whose coordinates on the replicated axes
   equal the destination rank's coordinates (in the normalized device matrix: rank ``r`` of
   a smaller source is ``r % src_devices``). The destination rank's own number is therefore
   always in the list, even when its source shard contributes nothing.

Pipeline stages are handled as ``rank_list_for_transform`` does: one set of stage-local ranks
for the destination stage, offset into every source stage that holds a listed parameter.

**Beyond MindSpore.** MindSpore refuses device counts where neither divides the other
(``16 -> 24``). zckpt transforms those, so by default it returns the smallest correct set
instead: for each distinct source piece overlapping the destination rank's piece, one source
rank, preferring (as MindSpore does among replicas) the replica whose coordinates on the
replicated axes equal those of ``rank % src_devices``. ``strict=True`` raises MindSpore's
error instead. MindSpore also cannot parse parameter names containing ``-`` (other than its
``"<stage>-"`` prefix); zckpt answers for them unless ``strict=True``.

Steps 1 and 2 are :mod:`zckpt.plan.ms_layout`, steps 3 and 4
:mod:`zckpt.plan.ms_redistribution`; this module answers the queries (one parameter, one
destination rank, many at once) and goes beyond MindSpore where MindSpore refuses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from zckpt.core.errors import LayoutError, StrategyError
from zckpt.core.layout import Box, Sharding, coordinate, dev_index, normalized_shape, rank_box, resolve
from zckpt.formats.strategy import ParamLayout, StrategyMap, fold_candidates
from zckpt.plan.ms_redistribution import Gather, gather_array, ms_gather


def _gather_ranks(g: Gather, rank: int, param: str | None) -> frozenset[int]:
    return frozenset(gather_array(g, rank, param).tolist())


def _ms_local_ranks(
    src: ParamLayout, dst: ParamLayout | None, rank: int, ndim: int, param: str | None, *, strict: bool
) -> frozenset[int]:
    g = ms_gather(src, dst, ndim, param, strict=strict)
    if g is None:
        assert dst is not None
        return _minimal_overlap(src, dst, rank, ndim, param)
    return _gather_ranks(g, rank, param)


# --------------------------------------------------------------------------- beyond MindSpore


def _minimal_overlap(src: ParamLayout, dst: ParamLayout, rank: int, ndim: int, param: str | None) -> frozenset[int]:
    """One source rank per distinct source piece overlapping destination ``rank``'s piece.

    Used where MindSpore refuses (device counts that do not divide each other). Computed with
    zckpt's own layout maths (:mod:`zckpt.core.layout`: the rule the compiler really slices by).
    """
    shape = normalized_shape(src, dst, ndim=ndim)
    s_sh = resolve(src, shape, param=param)
    d_sh = resolve(dst, shape, param=param)
    if not 0 <= rank < d_sh.device_num:
        raise LayoutError(f"rank {rank} is outside a stage of {d_sh.device_num} destination devices", param=param)
    target = rank_box(d_sh, rank)
    groups: dict[Box, list[int]] = {}
    for r in range(s_sh.device_num):
        box = rank_box(s_sh, r)
        if box.intersect(target) is not None:
            groups.setdefault(box, []).append(r)
    prefer = coordinate(src.dev_matrix, rank % s_sh.device_num)
    return frozenset(_replica(s_sh, members, prefer) for members in groups.values())


def _replica(sh: Sharding, members: Sequence[int], prefer: Sequence[int]) -> int:
    """The member whose coordinates on the replicated (sub-)axes are ``prefer``'s."""
    lay = sh.layout
    split_axes = {dev_index(lay, a) for axes in lay.tensor_map for a in axes}
    opt = dict(sh.opt_axes)
    have = coordinate(lay.dev_matrix, members[0])
    coord = []
    for i in range(len(lay.dev_matrix)):
        if i in split_axes:
            coord.append(have[i])
        elif i in opt:
            coord.append(prefer[i] // opt[i] * opt[i] + have[i] % opt[i])
        else:
            coord.append(prefer[i])
    r = 0
    for c, n in zip(coord, lay.dev_matrix, strict=True):
        r = r * n + c
    return r if r in members else min(members)


# --------------------------------------------------------------------------- public API


def needed_source_ranks(
    src: ParamLayout | None, dst: ParamLayout | None, dst_local_rank: int, ndim: int, *, strict: bool = False
) -> frozenset[int]:
    """Stage-local source ranks MindSpore reads for one parameter held by ``dst_local_rank``.

    ``src=None`` is an unsharded source (one file holds everything: ``{0}``, MindSpore's
    answer for ``src_strategy_file=None``); ``dst=None`` an unsharded destination (MindSpore
    then uses the rank number as given). ``ndim`` is the tensor's rank; both layouts must
    have that many tensor-map entries. Raises :class:`~zckpt.core.errors.LayoutError` /
    :class:`~zckpt.core.errors.StrategyError` (both ``ValueError``) where MindSpore fails; see the
    module docstring for the rule and for what ``strict`` changes.
    """
    if src is None:
        if dst is not None and len(dst.tensor_map) != ndim:
            raise LayoutError(f"the destination tensor_map has {len(dst.tensor_map)} entries but the tensor has "
                              f"{ndim} dimensions")
        return frozenset({0})
    return _ms_local_ranks(src, dst, dst_local_rank, ndim, None, strict=strict)


def _ms_layout_list(smap: StrategyMap, rank_id: int | None) -> dict[str, tuple[ParamLayout, list[int]]]:
    """``_convert_to_list``: one layout per parameter plus every stage that lists it.

    A parameter listed by several stages keeps, for the source (``rank_id=None``), the layout
    of its lowest stage; for the destination, the first stage-0 layout when ``rank_id`` is in
    stage 0 and the last later-stage layout otherwise (MindSpore's shared-parameter rule).
    """
    out: dict[str, tuple[ParamLayout, list[int]]] = {}
    for name, per in smap.layouts.items():
        for stage, lay in per.items():
            if name not in out:
                out[name] = (lay, [stage])
                continue
            old, stages = out[name]
            stages = [*stages, stage]
            if rank_id is None:
                take = all(stage <= s for s in stages)
            else:
                in_first = rank_id // lay.device_num == 0
                take = (in_first and stage == 0) or (not in_first and stage > 0)
            out[name] = (lay if take else old, stages)
    return out


def _foldings(lay: ParamLayout, param: str) -> dict[tuple[int, ...] | None, ParamLayout]:
    """The layout for every real shape a JSON (expanded) layout may describe; ``None``: any shape."""
    if lay.tensor_shape is None or len(lay.tensor_shape) != len(lay.tensor_map):
        return {None: lay}
    out: dict[tuple[int, ...] | None, ParamLayout] = {lay.tensor_shape: lay}
    for k in range(1, len(lay.tensor_map)):
        for cand in fold_candidates(lay, k, param=param):
            out.setdefault(cand.tensor_shape, cand)
    return out


def fold_pairs(
    src: ParamLayout, dst: ParamLayout | None, param: str
) -> list[tuple[ParamLayout, ParamLayout | None]]:
    """Both layouts of one parameter on the same real dimensions, for every shape they may describe.

    JSON files write multi-axis maps expanded (see :mod:`zckpt.formats.strategy`) and the rank
    list has no tensor shape to fold them with. The real shape is one both sides fold onto;
    MindSpore expands only dimensions split over several axes, so it is among the candidates
    with the most dimensions. When several remain, the files cannot tell which: the caller
    takes the union of their rank lists, which is enough for any of them.
    """
    if dst is None:  # an unsharded destination reads every piece, however the dimensions are grouped
        return [(src, None)]
    a = _foldings(src, param)
    b = _foldings(dst, param)
    if None in a and None in b:
        return [(src, dst)]
    if None in a or None in b:
        plain, known = (src, b) if None in a else (dst, a)
        common = {k for k in known if k is not None and len(k) == len(plain.tensor_map)}
    else:
        common = {k for k in a if k is not None and k in b}
    if not common:
        raise LayoutError("the source and destination layouts describe no common tensor shape", param=param)
    ndim = max(len(k) for k in common)
    return [(a.get(k, src), b.get(k, dst)) for k in sorted(common) if len(k) == ndim]


def _first_device_num(layouts: Mapping[str, tuple[ParamLayout, list[int]]]) -> int:
    return next(iter(layouts.values()))[0].device_num


@dataclass(frozen=True)
class _StagePairs:
    """What a destination rank's list depends on besides its stage-local number: the distinct
    (source, destination) layout pairs of the parameters both sides list for its stage (with
    the first parameter's name, for errors), the source stages to offset into, device counts."""

    pairs: tuple[tuple[ParamLayout, ParamLayout | None, str], ...]
    stages: tuple[int, ...]
    src_devices: int
    dst_devices: int


def _stage_pairs(rank_id: int, src: StrategyMap, dst: StrategyMap | None, *, strict: bool) -> _StagePairs:
    if strict:
        for smap in (src, dst):
            bad = [n for n in (smap.layouts if smap is not None else ()) if "-" in n]
            if bad:
                raise StrategyError(f"MindSpore cannot parse parameter names containing '-': {bad[:3]}")
    src_list = _ms_layout_list(src, None)
    dst_list = None if dst is None else _ms_layout_list(dst, rank_id)
    if dst_list is not None:
        if not dst_list:
            raise StrategyError("the destination strategy holds no parameter layout")
        stage = rank_id // _first_device_num(dst_list)
        for name in [n for n, (_, stages) in dst_list.items() if stage not in stages]:
            del dst_list[name]
            src_list.pop(name, None)
        if not dst_list:
            raise StrategyError(f"rank {rank_id} is in no pipeline stage of the destination strategy")
    if not src_list:
        raise StrategyError("the source strategy holds no parameter layout (for this destination stage)")
    pairs: dict[tuple[ParamLayout, ParamLayout | None], str] = {}
    stages: list[int] = []
    for name, (lay, src_stages) in src_list.items():
        stages.extend(s for s in src_stages if s not in stages)
        if dst_list is not None and name not in dst_list:
            continue
        pairs.setdefault((lay, None if dst_list is None else dst_list[name][0]), name)
    return _StagePairs(tuple((a, b, n) for (a, b), n in pairs.items()), tuple(stages), _first_device_num(src_list),
                       _first_device_num(dst_list) if dst_list is not None else 1)


def _stage_key(rank_id: int, dst: StrategyMap | None, device_nums: Sequence[int]) -> tuple[int, ...]:
    """Everything :func:`_stage_pairs` reads of ``rank_id``: its quotient by every destination
    stage device count (which stage it is in, whether it is in the first)."""
    return tuple(rank_id // d for d in device_nums) if dst is not None else ()


def rank_list_for_transform_maps(
    rank_id: int, src: StrategyMap | None, dst: StrategyMap | None, *, strict: bool = False
) -> list[int]:
    """MindSpore's ``rank_list_for_transform`` on strategies already read: global source ranks, descending.

    Mirrors MindSpore step by step: ``[0]`` for an unsharded source; destination parameters
    not in ``rank_id``'s pipeline stage are dropped from both sides; source parameters the
    destination does not list are ignored; the stage-local rank is ``rank_id`` modulo the
    destination's devices per stage; the union of the per-parameter answers is offset into
    every source stage that lists a remaining parameter. Stage device counts are those of the
    first listed parameter, as in MindSpore.
    """
    return rank_lists_for_transform_maps([rank_id], src, dst, strict=strict)[rank_id]


def rank_lists_for_transform_maps(
    ranks: Iterable[int], src: StrategyMap | None, dst: StrategyMap | None, *, strict: bool = False
) -> dict[int, list[int]]:
    """:func:`rank_list_for_transform_maps` of many destination ranks at once."""
    return {r: a.tolist() for r, a in rank_arrays_for_transform_maps(ranks, src, dst, strict=strict).items()}


def rank_arrays_for_transform_maps(
    ranks: Iterable[int], src: StrategyMap | None, dst: StrategyMap | None, *, strict: bool = False
) -> dict[int, np.ndarray]:
    """The source ranks of many destination ranks at once, as int64 arrays in MindSpore's
    descending order (``zckpt plan``: 4 096 lists of 4 096 ranks stay arrays until printed).

    Thousands of parameters share a handful of layout pairs, and everything but the last step
    depends on a rank's stage only: so the pairs are found once per stage and each pair's
    gathered axes once, then each rank costs a few set products instead of a pass over every
    parameter (4 096 ranks x 2 000 parameters: from about 20 minutes to seconds).
    """
    out: dict[int, np.ndarray] = {}
    if src is None:
        return {r: np.zeros(1, dtype=np.int64) for r in ranks}
    device_nums = sorted({lay.device_num for per in dst.layouts.values() for lay in per.values()}) if dst else []
    per_stage: dict[tuple[int, ...], _StagePairs] = {}
    gathers: dict[tuple[ParamLayout, ParamLayout | None], Gather | None] = {}
    for rank_id in ranks:
        key = _stage_key(rank_id, dst, device_nums)
        sp = per_stage.get(key)
        if sp is None:
            sp = per_stage[key] = _stage_pairs(rank_id, src, dst, strict=strict)
        local = rank_id % sp.dst_devices if sp.dst_devices > 1 else rank_id
        needed = np.zeros(sp.src_devices, dtype=bool)
        for listed, listed_to, name in sp.pairs:
            for lay, to in fold_pairs(listed, listed_to, name):
                ndim = len(lay.tensor_map)
                if (lay, to) not in gathers:
                    gathers[(lay, to)] = ms_gather(lay, to, ndim, name, strict=strict)
                g = gathers[(lay, to)]
                if g is None:
                    assert to is not None
                    needed[sorted(_minimal_overlap(lay, to, local, ndim, name))] = True
                else:
                    needed[gather_array(g, local, name)] = True
        local_desc = np.flatnonzero(needed)[::-1]  # stage-local ranks < src_devices: no two stages collide
        offsets = np.array(sorted(sp.stages, reverse=True), dtype=np.int64) * sp.src_devices
        out[rank_id] = (offsets[:, None] + local_desc[None, :]).reshape(-1)
    return out
