"""MindSpore's view of a layout, for the rank list: steps 1 and 2 of :mod:`zckpt.plan.ranklist`.

``rank_list_for_transform`` does not slice real tensors: it builds MindSpore's own tensor
layouts (a fake tensor, optimizer sharding turned into an extra split of dimension 0, one
axis per dimension, a repeat axis in front of the layout with fewer devices) and
redistributes those. This module rebuilds exactly those layouts, quirks included (the
device-matrix renumbering of ``_construct_tensor_layout_for_opt_shard``), and nothing else:
where data really lies is :mod:`zckpt.core.layout`, and what the redistribution gathers is
:mod:`zckpt.plan.ms_redistribution`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from zckpt.core.errors import LayoutError
from zckpt.formats.strategy import ParamLayout

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
class MsLayout:
    """A layout after MindSpore's optimizer-shard expansion: one axis (or none) per dimension."""

    dev: tuple[int, ...]
    tmap: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def device_num(self) -> int:
        return math.prod(self.dev)


def _expand_nested(dev: Sequence[int], tmap: Sequence[MsDim], shape: Sequence[int]) -> MsLayout:
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
    return MsLayout(tuple(dev), tuple(new_map), tuple(new_shape))


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
) -> MsLayout:
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
    return MsLayout(tuple(new_dev), tuple(new_map), tuple(shape))


def ms_pair(
    src: ParamLayout, dst: ParamLayout | None, ndim: int, param: str | None
) -> tuple[MsLayout, MsLayout, int]:
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


def normalized(a: MsLayout, b: MsLayout) -> tuple[MsLayout, MsLayout]:
    """Prepend a repeat axis to the layout with fewer devices (counts must divide)."""
    na, nb = a.device_num, b.device_num
    if na > nb:
        return a, MsLayout((na // nb, *b.dev), b.tmap, b.shape)
    if nb > na:
        return MsLayout((nb // na, *a.dev), a.tmap, a.shape), b
    return a, b
