"""What MindSpore's redistribution gathers, for the rank list: steps 3 and 4 of :mod:`zckpt.plan.ranklist`.

Given both layouts as MindSpore builds them (:mod:`zckpt.plan.ms_layout`), the common
refinement of their device matrices and tensor shapes tells which source device axes the
redistribution must gather (an ``AllGather``, possibly inside an all-to-all); every other axis
keeps the destination rank's coordinate. The answer for one layout pair depends on no rank
(:class:`Gather`) and is computed once; :func:`gather_array` turns it into one rank's list.
Device counts MindSpore refuses are answered by :mod:`zckpt.plan.ranklist` itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zckpt.core.errors import LayoutError, StrategyError
from zckpt.formats.strategy import ParamLayout
from zckpt.plan.ms_layout import NONE, MsLayout, ms_pair, normalized


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


def _splits(lay: MsLayout, param: str | None) -> tuple[_Split, ...]:
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


def _common_digits(layouts: Sequence[tuple[MsLayout, tuple[_Split, ...]]]) -> list[tuple[int, int]] | None:
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
class Gather:
    """The rank-independent part of MindSpore's answer for one layout pair: the gathered
    device digits ``(weight, size)`` of the normalized device matrix, whether the destination
    slices anything the source does not, and the device counts."""

    gathered: tuple[tuple[int, int], ...]
    sliced: bool
    device_num: int
    src_devices: int


def ms_gather(src: ParamLayout, dst: ParamLayout | None, ndim: int, param: str | None, *,
              strict: bool) -> Gather | None:
    """:class:`Gather` of a layout pair, or ``None`` when MindSpore refuses the device counts
    and zckpt answers with its own overlap instead (:mod:`zckpt.plan.ranklist`)."""
    a, b, src_devices = ms_pair(src, dst, ndim, param)
    big, small = max(a.device_num, b.device_num), min(a.device_num, b.device_num)
    if big % small:
        if strict or dst is None:
            raise StrategyError(f"Cannot transform device_num from {a.device_num} to {b.device_num}", param=param)
        return None
    a, b = normalized(a, b)
    sa, sb = _splits(a, param), _splits(b, param)
    digits = _common_digits([(a, sa), (b, sb)])
    if digits is None:
        digits = [(math.prod(a.dev[i + 1:]), n) for i, n in enumerate(a.dev) if n > 1]
        gathered = [(w, n) for w, n in digits if _piece(sa, w) is not None]
        sliced = bool(sb)
    else:
        gathered = [(w, n) for w, n in digits if _piece(sa, w) not in (None, _piece(sb, w))]
        sliced = any(_piece(sb, w) not in (None, _piece(sa, w)) for w, _ in digits)
    return Gather(tuple(gathered), sliced, a.device_num, src_devices)


def gather_array(g: Gather, rank: int, param: str | None) -> np.ndarray:
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
