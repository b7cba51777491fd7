"""What a strategy file says, as values: each parameter's layout (:class:`ParamLayout`), a
file's (or a merged set's) layouts per stage (:class:`StrategyMap`), and the folding of
MindSpore's expanded multi-axis maps back to one entry per tensor dimension.

Pure values and functions: the sharding maths (:mod:`zckpt.core.layout`) builds on them without
depending on how strategy files are read or written (:mod:`zckpt.formats.strategy`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from zckpt.core.errors import LayoutError, StrategyError

MAX_DEVICES = 2**20
"""Largest device matrix accepted (product of its sizes). Far above any real cluster, and
small enough that every per-rank loop of a plan (``range(device_num)``) stays enumerable:
a corrupt ``dev_matrix`` of ``[2**32 - 1] * 4`` would otherwise make export loop forever."""
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's layout as the strategy file states it.

    ``tensor_map`` holds, per tensor dimension, the device axes that split it, outermost
    first, in MindSpore's numbering (axis ``k`` is ``dev_matrix[len(dev_matrix) - 1 - k]``);
    an empty tuple means the dimension is not split.
    """

    dev_matrix: tuple[int, ...]
    tensor_map: tuple[tuple[int, ...], ...]
    opt_shard_step: int = 0
    opt_shard_size: int = 0
    field_size: int = 0
    param_split_shape: tuple[int, ...] = ()
    indices_offset: tuple[int, ...] = ()
    tensor_shape: tuple[int, ...] | None = None

    @property
    def device_num(self) -> int:
        return math.prod(self.dev_matrix)

    def is_expanded(self, ndim: int) -> bool:
        """Whether this is a JSON layout in MindSpore's expanded form for a tensor of ``ndim`` dimensions."""
        return self.tensor_shape is not None and len(self.tensor_map) > ndim

    def flat_tensor_map(self) -> tuple[int, ...] | None:
        """The single-axis tensor map MindSpore writes when no dimension has several axes."""
        if any(len(axes) > 1 for axes in self.tensor_map):
            return None
        return tuple(axes[0] if axes else -1 for axes in self.tensor_map)


@dataclass(frozen=True)
class StrategyMap:
    """The layouts of one strategy file (or of a merged/combined set of files).

    ``layouts[name][stage]`` is the layout of ``name`` in pipeline ``stage``; a
    non-pipeline job has only stage 0.
    """

    layouts: Mapping[str, Mapping[int, ParamLayout]]
    sources: tuple[str, ...] = ()
    operator_strategies: Mapping[str, tuple[int, tuple[tuple[int, ...], ...]]] = field(
        default_factory=dict
    )

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted({s for per in self.layouts.values() for s in per}))

    @property
    def stage_num(self) -> int:
        return len(self.stages)

    def stage_device_num(self) -> int:
        """Devices per pipeline stage: every layout's dev_matrix product must agree."""
        nums = {lay.device_num for per in self.layouts.values() for lay in per.values()}
        if not nums:
            raise StrategyError("strategy holds no parameter layout", path=self._where())
        if len(nums) > 1:
            raise StrategyError(
                f"layouts disagree on the device count per stage: {sorted(nums)}", path=self._where()
            )
        return nums.pop()

    def device_num(self) -> int:
        return self.stage_device_num() * max(1, self.stage_num)

    def layout(self, name: str, stage: int = 0) -> ParamLayout | None:
        per = self.layouts.get(name)
        if per is None:
            return None
        return per.get(stage)

    def _where(self) -> str | None:
        return ", ".join(self.sources) if self.sources else None


MAX_FOLD_GROUPINGS = 4096
"""Groupings of expanded dimensions tried when only a shard shape is known; a real layout
has a handful of dimensions, a hostile file could make the search exponential."""


def _axis_size(lay: ParamLayout, axes: Sequence[int]) -> int:
    return math.prod(lay.dev_matrix[len(lay.dev_matrix) - 1 - a] for a in axes)


def _fold_groups(lay: ParamLayout, groups: Sequence[Sequence[int]], param: str | None) -> ParamLayout:
    """Merge expanded dimensions ``groups`` (consecutive index runs) into one dimension each.

    The expanded tensor is the real one reshaped, so slicing it equals slicing the real
    dimension into prod(sizes) pieces numbered mixed-radix, first dimension most
    significant, as long as every expanded dimension before a split one is exactly one
    piece per device of its axis; otherwise a rank's rows would not be one contiguous run
    and no box describes them, which is refused.
    """
    assert lay.tensor_shape is not None
    shape = lay.tensor_shape
    real: list[int] = []
    tmap: list[tuple[int, ...]] = []
    for g in groups:
        sizes = [_axis_size(lay, lay.tensor_map[j]) for j in g]
        for j, n in zip(g, sizes, strict=True):
            if shape[j] % n:
                raise LayoutError(
                    f"expanded tensor_shape {list(shape)}: dimension {j} of size {shape[j]} cannot be split "
                    f"into {n} equal parts", param=param)
        for k, j in enumerate(g[:-1]):
            if shape[j] != sizes[k] and any(n > 1 for n in sizes[k + 1:]):
                raise LayoutError(
                    f"expanded tensor_shape {list(shape)} / tensor_map {[a[0] if a else -1 for a in lay.tensor_map]}: "
                    f"dimension {j} is not one piece per device of its axis, so a rank's rows are not contiguous",
                    param=param)
        real.append(math.prod(shape[j] for j in g))
        tmap.append(tuple(a for j in g for a in lay.tensor_map[j]))
    return replace(lay, tensor_map=tuple(tmap), tensor_shape=tuple(real))


def fold_layout(lay: ParamLayout, shape: Sequence[int], *, param: str | None = None) -> ParamLayout:
    """The layout for a tensor of global ``shape``: a JSON expanded layout folded back to one
    map entry per real dimension (several axes on a dimension, first listed most significant).

    Layouts that are not expanded come back unchanged. Expanded dimensions of size 1 may be
    grouped either way without changing any box (their axis has size 1), so the first
    grouping whose products give ``shape`` is taken.
    """
    real = tuple(int(s) for s in shape)
    if not lay.is_expanded(len(real)):
        return lay
    assert lay.tensor_shape is not None
    exp = lay.tensor_shape
    if len(exp) != len(lay.tensor_map):
        raise LayoutError(
            f"tensor_shape {list(exp)} and tensor_map have different lengths ({len(exp)}, {len(lay.tensor_map)})",
            param=param)
    groups: list[list[int]] = []
    j = 0
    for size in real:
        if j >= len(exp):
            break
        g = [j]
        prod = exp[j]
        j += 1
        while prod < size and j < len(exp):
            g.append(j)
            prod *= exp[j]
            j += 1
        groups.append(g)
    while j < len(exp) and exp[j] == 1 and groups:
        groups[-1].append(j)
        j += 1
    if j != len(exp) or len(groups) != len(real) or any(
        math.prod(exp[i] for i in g) != n for g, n in zip(groups, real, strict=True)
    ):
        raise LayoutError(
            f"the strategy's expanded tensor_shape {list(exp)} does not fold onto the tensor's shape {list(real)}",
            param=param)
    return _fold_groups(lay, groups, param)


def fold_candidates(lay: ParamLayout, ndim: int, *, param: str | None = None) -> list[ParamLayout]:
    """Every folding of an expanded layout into ``ndim`` dimensions that MindSpore could have
    written, distinct by real shape (for ingest, which knows only the shard shapes)."""
    assert lay.tensor_shape is not None
    exp = lay.tensor_shape
    n = len(exp)
    if len(lay.tensor_map) != n:
        raise LayoutError(
            f"tensor_shape {list(exp)} and tensor_map have different lengths ({n}, {len(lay.tensor_map)})",
            param=param)
    if ndim < 1 or ndim > n:
        return []
    out: dict[tuple[int, ...], ParamLayout] = {}
    for tried, cuts in enumerate(itertools.combinations(range(1, n), ndim - 1)):
        if tried >= MAX_FOLD_GROUPINGS:
            raise LayoutError(
                f"expanded tensor_shape {list(exp)} has too many ways to fold onto {ndim} dimensions", param=param)
        bounds = (0, *cuts, n)
        groups = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
        try:
            folded = _fold_groups(lay, groups, param)
        except LayoutError:
            continue
        assert folded.tensor_shape is not None
        out.setdefault(folded.tensor_shape, folded)
    return list(out.values())


def expand_layout(lay: ParamLayout) -> tuple[list[int], list[int]] | None:
    """``(tensor_shape, tensor_map)`` in MindSpore's JSON expanded form, or ``None`` when the
    layout has a dimension over several axes but no real shape to expand it with."""
    multi = any(len(a) > 1 for a in lay.tensor_map)
    if lay.tensor_shape is None or len(lay.tensor_shape) != len(lay.tensor_map):
        return None if multi else ([] if lay.tensor_shape is None else list(lay.tensor_shape),
                                   [a[0] if a else -1 for a in lay.tensor_map])
    shape: list[int] = []
    tmap: list[int] = []
    for axes, size in zip(lay.tensor_map, lay.tensor_shape, strict=True):
        if len(axes) <= 1:
            shape.append(size)
            tmap.append(axes[0] if axes else -1)
            continue
        rest = size
        for a in axes[:-1]:
            n = _axis_size(lay, (a,))
            shape.append(n)
            tmap.append(a)
            rest //= n
        shape.append(rest)
        tmap.append(axes[-1])
    return shape, tmap


def make_layout(
    dev_matrix: Iterable[int],
    tensor_map: Iterable[object],
    *,
    opt_shard_step: int = 0,
    opt_shard_size: int = 0,
    field_size: int = 0,
    param_split_shape: Iterable[int] = (),
    indices_offset: Iterable[int] = (),
    tensor_shape: Iterable[int] | None = None,
    path: str | Path | None = None,
    param: str | None = None,
) -> ParamLayout:
    """Build and check a :class:`ParamLayout` from raw file values.

    ``tensor_map`` entries are ints (``-1`` = not split) or lists of ints (several axes).
    Every number must fit the width MindSpore's protobuf gives it, so anything read here
    can be written back (``encode_strategy``) and the device count stays enumerable.
    """
    dev = tuple(int(d) for d in dev_matrix)
    if not dev or any(not 1 <= d < 2**32 for d in dev):
        raise StrategyError(f"dev_matrix {list(dev)} must hold positive sizes", path=path, param=param)
    if math.prod(dev) > MAX_DEVICES:
        raise StrategyError(
            f"dev_matrix {list(dev)} describes {math.prod(dev)} devices, more than zckpt's limit of {MAX_DEVICES}",
            path=path,
            param=param,
        )
    tmap: list[tuple[int, ...]] = []
    used: set[int] = set()
    for entry in tensor_map:
        axes_raw = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        try:
            ints = [int(a) for a in axes_raw]  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            raise StrategyError(
                f"tensor_map entry {entry!r} is not an int or a list of ints", path=path, param=param
            ) from None
        axes = tuple(a for a in ints if a != -1)
        for a in axes:
            if not 0 <= a < len(dev):
                raise StrategyError(
                    f"tensor_map names device axis {a} but dev_matrix {list(dev)} has {len(dev)} axes",
                    path=path,
                    param=param,
                )
            if a in used:
                raise StrategyError(
                    f"tensor_map uses device axis {a} twice", path=path, param=param
                )
            used.add(a)
        tmap.append(axes)
    if opt_shard_size < -1:
        raise StrategyError(
            f"opt_weight_shard_size {opt_shard_size} is negative", path=path, param=param
        )
    for what, value in (("opt_weight_shard_step", opt_shard_step), ("opt_weight_shard_size", opt_shard_size),
                        ("field", field_size)):
        check_range(what, [int(value)], INT32, path, param)
    split = check_range("param_split_shape", [int(x) for x in param_split_shape], INT64, path, param)
    offsets = check_range("indices_offset", [int(x) for x in indices_offset], INT64, path, param)
    shape = None if tensor_shape is None else check_range(
        "tensor_shape", [int(x) for x in tensor_shape], INT64, path, param
    )
    return ParamLayout(
        dev_matrix=dev,
        tensor_map=tuple(tmap),
        opt_shard_step=int(opt_shard_step),
        opt_shard_size=int(opt_shard_size),
        field_size=int(field_size),
        param_split_shape=split,
        indices_offset=offsets,
        tensor_shape=shape,
    )


def check_range(
    what: str, values: list[int], bounds: tuple[int, int], path: str | Path | None, param: str | None
) -> tuple[int, ...]:
    lo, hi = bounds
    for v in values:
        if not lo <= v <= hi:
            raise StrategyError(f"{what} value {v} does not fit its field ({lo}..{hi})", path=path, param=param)
    return tuple(values)
