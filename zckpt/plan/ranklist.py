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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from zckpt.core.errors import LayoutError, StrategyError
from zckpt.core.layout import Box, Sharding, coordinate, dev_index, normalized_shape, rank_box, resolve
from zckpt.formats.strategy import ParamLayout, StrategyMap, fold_candidates

MsDim = int | list[int]
"""One tensor-map entry as MindSpore's Python sees it: an axis (``-1`` = none) or a list of axes."""

NONE = -1


# --------------------------------------------------------------------------- MindSpore's view


def _ms_tensor_map(lay: ParamLayout) -> list[MsDim]:
    """The tensor map MindSpore reads back from the file zckpt writes for ``lay``.

    zckpt writes a nested map only when some dimension has several axes, and MindSpore then
    sees every entry as a list (``[-1]`` for an unsplit dimension); that choice selects
    MindSpore's "layout" code path, so it must be reproduced.
    """
    if any(len(axes) > 1 for axes in lay.tensor_map):
        return [list(axes) if axes else [NONE] for axes in lay.tensor_map]
    return [axes[0] if axes else NONE for axes in lay.tensor_map]


def _split_counts(dev: Sequence[int], tmap: Sequence[MsDim]) -> list[int]:
    """``_get_tensor_strategy``: how many pieces each tensor dimension is cut into."""
    out = []
    for d in tmap:
        axes = d if isinstance(d, list) else [d]
        out.append(math.prod(dev[len(dev) - 1 - a] for a in axes if a != NONE))
    return out


@dataclass(frozen=True)
class _MsLayout:
    """A layout after MindSpore's optimizer-shard expansion: one axis (or none) per dimension."""

    dev: tuple[int, ...]
    tmap: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def device_num(self) -> int:
        return math.prod(self.dev)


def _expand_nested(dev: Sequence[int], tmap: Sequence[MsDim], shape: Sequence[int]) -> _MsLayout:
    """``_expand_layout``: a dimension split by axes ``[a, b]`` becomes two dimensions."""
    new_map: list[int] = []
    new_shape: list[int] = []
    for size, d in zip(shape, tmap, strict=True):
        if isinstance(d, list):
            acc = 1
            for a in d[:-1]:
                n = dev[len(dev) - 1 - a]
                new_map.append(a)
                new_shape.append(n)
                acc *= n
            new_map.append(d[-1])
            new_shape.append(size // acc)
        else:
            new_map.append(d)
            new_shape.append(size)
    return _MsLayout(tuple(dev), tuple(new_map), tuple(new_shape))


def _opt_repeated(dev: Sequence[int], flat_axes: Iterable[int]) -> list[int]:
    """Device-matrix indices of size > 1 that split no tensor dimension (outer first)."""
    sharded = {len(dev) - 1 - a for a in flat_axes if a != NONE}
    return [i for i, n in enumerate(dev) if i not in sharded and n > 1]


def _opt_helper(
    dev: Sequence[int], tmap: Sequence[MsDim], size: int, shape: Sequence[int], counts: Sequence[int],
    repeated: Sequence[int], param: str | None,
) -> tuple[list[int], list[MsDim], list[int]]:
    """``_construct_tensor_layout_helper``: split dimension 0 over repeated axes, innermost first."""
    new_dev = list(dev)
    renumber = list(range(len(dev)))
    opt_dims: list[int] = []
    remaining = size
    for i in reversed(repeated):
        take = dev[i]
        if remaining // take == 0:
            if take % remaining:
                raise LayoutError(
                    f"dev_matrix value {dev[i]} at dim {len(dev) - i - 1} cannot be divided by needed opt "
                    f"sharding size {remaining}", param=param)
            take = remaining
            new_dev[i] = dev[i] // take
            new_dev.insert(i + 1, take)
            for k in range(len(dev) - i - 1, len(dev)):
                renumber[k] += 1
        if remaining % take:
            raise LayoutError(
                f"remained opt_shard_size {remaining} cannot be divided by current sharding size {take}", param=param)
        remaining //= take
        opt_dims.insert(0, i)
        if remaining == 1:
            break
    new_map = list(tmap)
    if len(new_dev) != len(dev):
        opt_dims = [i + 1 for i in opt_dims]
        for k, d in enumerate(new_map):
            if isinstance(d, list):
                new_map[k] = [renumber[a] if a >= 0 else a for a in d]
            elif d >= 0:
                new_map[k] = renumber[d]
    new_shape = list(shape)
    new_shape[0] = counts[0]
    first = shape[0] // counts[0]
    acc = 1
    for k in range(len(opt_dims) - 1):
        n = new_dev[opt_dims[k]]
        new_shape.insert(k + 1, n)
        acc *= n
    new_shape.insert(len(opt_dims), first // acc)
    for k, i in enumerate(opt_dims):
        new_map.insert(k + 1, len(new_dev) - i - 1)
    return new_dev, new_map, new_shape


def _ms_layout(
    dev: Sequence[int], tmap: Sequence[MsDim], step: int, size: int, origin: Sequence[int], param: str | None
) -> _MsLayout:
    """``_construct_tensor_layout_for_opt_shard`` (both its flat and its nested-map branch)."""
    nested = any(isinstance(d, list) for d in tmap)
    if step == 0 or size == 0:
        return _expand_nested(dev, tmap, origin)
    if not origin:
        raise LayoutError("optimizer sharding of a 0-d tensor", param=param)
    counts = _split_counts(dev, tmap)
    if nested:
        flat = _expand_nested(dev, tmap, origin).tmap
        repeated = _opt_repeated(dev, flat)
        if not repeated:
            raise LayoutError(f"the device_matrix {list(dev)} and tensor_map {list(tmap)} cannot sharding opt_shard",
                              param=param)
        return _expand_nested(*_opt_helper(dev, tmap, size, origin, counts, repeated, param))
    axes = [d for d in tmap if isinstance(d, int)]
    repeated = _opt_repeated(dev, axes)
    if not repeated:
        raise LayoutError(f"the device_matrix {list(dev)} and tensor_map {list(tmap)} cannot sharding opt_shard",
                          param=param)
    if len(repeated) == 1 and math.prod(dev[repeated[0] + 1:]) != step:
        raise LayoutError(
            f"the optimizer sharding step {step} is not equal to the model parallel sharding size "
            f"{math.prod(dev[repeated[0] + 1:])}", param=param)
    if 1 < len(repeated) < len(dev) or repeated[0] > 0:
        return _expand_nested(*_opt_helper(dev, tmap, size, origin, counts, repeated, param))
    # Only axis 0 is replicated (or every axis is): MindSpore rebuilds the device matrix from
    # the split counts in tensor-dimension order, then puts the optimizer axis and what is
    # left of the repetition in front.
    new_dev = [*counts]
    new_map = [NONE if n == 1 else len(counts) - 1 - k for k, n in enumerate(counts)]
    new_map.insert(1, len(counts))
    new_dev.insert(0, size)
    repeat = math.prod(dev) // (step * size)
    if repeat > 1:
        new_dev.insert(0, repeat)
    shape = [counts[0], origin[0] // counts[0], *origin[1:]]
    return _MsLayout(tuple(new_dev), tuple(new_map), tuple(shape))


def _ms_pair(
    src: ParamLayout, dst: ParamLayout | None, ndim: int, param: str | None
) -> tuple[_MsLayout, _MsLayout, int]:
    """Both layouts as MindSpore builds them, before normalization, and the source device count."""
    for name, lay in (("source", src), ("destination", dst)):
        if lay is not None and len(lay.tensor_map) != ndim:
            raise LayoutError(
                f"the {name} tensor_map has {len(lay.tensor_map)} entries but the tensor has {ndim} dimensions",
                param=param)
    f_map = _ms_tensor_map(src)
    f_size = src.opt_shard_size
    if f_size == -1:
        f_size = src.device_num // math.prod(_split_counts(src.dev_matrix, f_map))
    if dst is None:
        t_dev: tuple[int, ...] = (1,)
        t_map: list[MsDim] = [NONE] * ndim
        t_step = t_size = 0
    else:
        t_dev, t_map, t_step, t_size = dst.dev_matrix, _ms_tensor_map(dst), dst.opt_shard_step, dst.opt_shard_size
        if t_size == -1:
            t_size = dst.device_num // math.prod(_split_counts(t_dev, t_map))
    fake = max(src.device_num, math.prod(t_dev))
    counts = _split_counts(src.dev_matrix, f_map)
    origin = [fake * n * (f_size if k == 0 and f_size > 0 else 1) for k, n in enumerate(counts)]
    a = _ms_layout(src.dev_matrix, f_map, src.opt_shard_step, f_size, origin, param)
    b = _ms_layout(t_dev, t_map, t_step, t_size, origin, param)
    return a, b, src.device_num


def _normalized(a: _MsLayout, b: _MsLayout) -> tuple[_MsLayout, _MsLayout]:
    """Prepend a repeat axis to the layout with fewer devices (counts must divide)."""
    na, nb = a.device_num, b.device_num
    if na > nb:
        return a, _MsLayout((na // nb, *b.dev), b.tmap, b.shape)
    if nb > na:
        return _MsLayout((nb // na, *a.dev), a.tmap, a.shape), b
    return a, b


# --------------------------------------------------------------------------- refinement


@dataclass(frozen=True)
class _Split:
    """A device axis splitting one tensor dimension, in flat (row-major) coordinates.

    Device digits ``[weight, weight * size)`` of the rank number pick the block: element
    strides ``[block, top)`` of the flattened tensor, where ``top`` ends the dimension and
    ``stride`` is the dimension's own element stride.
    """

    weight: int
    size: int
    block: int
    stride: int
    top: int


def _splits(lay: _MsLayout, param: str | None) -> tuple[_Split, ...]:
    out = []
    for j, a in enumerate(lay.tmap):
        if lay.shape[j] <= 0:
            raise LayoutError(f"MindSpore's expanded shape {list(lay.shape)} has an empty dimension", param=param)
        if a == NONE:
            continue
        i = len(lay.dev) - 1 - a
        n = lay.dev[i]
        if lay.shape[j] % n:
            raise LayoutError(
                f"dimension {j} of MindSpore's expanded shape {list(lay.shape)} cannot be split into {n} parts "
                "(MindSpore fails to infer the redistribution)", param=param)
        if n == 1:
            continue
        stride = math.prod(lay.shape[j + 1:])
        top = stride * lay.shape[j]
        out.append(_Split(math.prod(lay.dev[i + 1:]), n, top // n, stride, top))
    return tuple(out)


def _suffix_products(xs: Sequence[int]) -> set[int]:
    out = {1}
    p = 1
    for x in reversed(xs):
        p *= x
        out.add(p)
    return out


def _nested(values: set[int]) -> bool:
    s = sorted(values)
    return all(b % a == 0 for a, b in zip(s, s[1:], strict=False))


def _common_digits(layouts: Sequence[tuple[_MsLayout, tuple[_Split, ...]]]) -> list[tuple[int, int]] | None:
    """Common refinement of device matrices and tensor shapes, as ``(weight, size)`` device digits.

    Boundaries (digit weights of the rank number, element strides of the flattened tensor)
    of both layouts are collected; a split axis carries a device boundary inside it to the
    tensor side (the block is cut in the same proportion) and a tensor boundary inside its
    block index back to the device side. ``None`` when the boundaries do not nest: MindSpore
    then finds no common layout and gathers the whole source (its "unexpandable" path).
    """
    dev_b: set[int] = set()
    ten_b: set[int] = set()
    for lay, _ in layouts:
        dev_b |= _suffix_products(lay.dev)
        ten_b |= _suffix_products(lay.shape)
    while True:
        if not (_nested(dev_b) and _nested(ten_b)):
            return None
        before = (len(dev_b), len(ten_b))
        for _, splits in layouts:
            for s in splits:
                for x in list(dev_b):
                    if s.weight < x < s.weight * s.size:
                        if x % s.weight:
                            return None
                        ten_b.add(s.block * (x // s.weight))
                for y in list(ten_b):
                    if s.block < y < s.top:
                        if y % s.block:
                            return None
                        dev_b.add(s.weight * (y // s.block))
                    elif s.stride < y < s.block and s.block % y:
                        return None
        if (len(dev_b), len(ten_b)) == before:
            b = sorted(dev_b)
            return [(lo, hi // lo) for lo, hi in zip(b, b[1:], strict=False)]


def _piece(splits: Sequence[_Split], weight: int) -> int | None:
    """The tensor stride a device digit selects in a layout, or ``None`` when it splits nothing."""
    for s in splits:
        if s.weight <= weight < s.weight * s.size:
            return s.block * (weight // s.weight)
    return None


@dataclass(frozen=True)
class _Gather:
    """The rank-independent part of MindSpore's answer for one layout pair: the gathered
    device digits ``(weight, size)`` of the normalized device matrix, whether the destination
    slices anything the source does not, and the device counts."""

    gathered: tuple[tuple[int, int], ...]
    sliced: bool
    device_num: int
    src_devices: int


def _ms_gather(src: ParamLayout, dst: ParamLayout | None, ndim: int, param: str | None, *,
               strict: bool) -> _Gather | None:
    """:class:`_Gather` of a layout pair, or ``None`` when MindSpore refuses the device counts
    and zckpt answers with :func:`_minimal_overlap` instead."""
    a, b, src_devices = _ms_pair(src, dst, ndim, param)
    big, small = max(a.device_num, b.device_num), min(a.device_num, b.device_num)
    if big % small:
        if strict or dst is None:
            raise StrategyError(f"Cannot transform device_num from {a.device_num} to {b.device_num}", param=param)
        return None
    a, b = _normalized(a, b)
    sa, sb = _splits(a, param), _splits(b, param)
    digits = _common_digits([(a, sa), (b, sb)])
    if digits is None:
        digits = [(math.prod(a.dev[i + 1:]), n) for i, n in enumerate(a.dev) if n > 1]
        gathered = [(w, n) for w, n in digits if _piece(sa, w) is not None]
        sliced = bool(sb)
    else:
        gathered = [(w, n) for w, n in digits if _piece(sa, w) not in (None, _piece(sb, w))]
        sliced = any(_piece(sb, w) not in (None, _piece(sa, w)) for w, _ in digits)
    return _Gather(tuple(gathered), sliced, a.device_num, src_devices)


def _gather_array(g: _Gather, rank: int, param: str | None) -> np.ndarray:
    """The stage-local source ranks of ``rank`` for a pair whose gather is ``g`` (sorted, unique):
    the rank with every gathered digit replaced by each of its values."""
    if not 0 <= rank < g.device_num:
        # Only reachable with an opt_weight_shard_step that shrinks MindSpore's device matrix
        # (or an unsharded destination asked for a rank beyond the source): MindSpore then
        # answers only when nothing has to move and fails in its communication setup otherwise.
        if g.gathered or g.sliced:
            raise LayoutError(
                f"rank {rank} is outside the {g.device_num} devices MindSpore derives from these layouts "
                f"(MindSpore fails: 'Rank {rank} is not in the current stage')", param=param)
        return np.array([rank % g.src_devices], dtype=np.int64)
    ranks = np.array([rank - sum(((rank // w) % n) * w for w, n in g.gathered)], dtype=np.int64)
    for w, n in g.gathered:
        ranks = (ranks[:, None] + np.arange(n, dtype=np.int64) * w).reshape(-1)
    mask = np.zeros(g.src_devices, dtype=bool)
    mask[ranks % g.src_devices] = True
    return np.flatnonzero(mask)


def _gather_ranks(g: _Gather, rank: int, param: str | None) -> frozenset[int]:
    return frozenset(_gather_array(g, rank, param).tolist())


def _ms_local_ranks(
    src: ParamLayout, dst: ParamLayout | None, rank: int, ndim: int, param: str | None, *, strict: bool
) -> frozenset[int]:
    g = _ms_gather(src, dst, ndim, param, strict=strict)
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
    gathers: dict[tuple[ParamLayout, ParamLayout | None], _Gather | None] = {}
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
                    gathers[(lay, to)] = _ms_gather(lay, to, ndim, name, strict=strict)
                g = gathers[(lay, to)]
                if g is None:
                    assert to is not None
                    needed[sorted(_minimal_overlap(lay, to, local, ndim, name))] = True
                else:
                    needed[_gather_array(g, local, name)] = True
        local_desc = np.flatnonzero(needed)[::-1]  # stage-local ranks < src_devices: no two stages collide
        offsets = np.array(sorted(sp.stages, reverse=True), dtype=np.int64) * sp.src_devices
        out[rank_id] = (offsets[:, None] + local_desc[None, :]).reshape(-1)
    return out
