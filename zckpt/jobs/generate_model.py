"""The models zckpt's generator writes: tensors, their deterministic values and the strategy they make.

Tests and benchmarks need sharded checkpoints that the MindSpore fixtures do not cover;
this module says what such a model holds, without writing anything:

* a :class:`TensorDef` per tensor (global shape, MindSpore type, layout);
* every tensor's *global* value is a deterministic function of its name
  (:func:`global_value`), so any shard can be checked against the value it must hold
  (:func:`shard_value`, the box :func:`zckpt.core.layout.rank_box` assigns to a rank)
  without keeping the whole model around;
* :func:`with_optimizer_states` adds the optimizer states MindSpore saves with the
  parameters (listed, as MindSpore does, without the uneven split of their parameter),
  :func:`default_scalars` the entries optimizers save outside the strategy, and
  :func:`strategy_of` is the strategy file's content;
* :func:`transformer_like` sizes a Megatron-style model for benchmarks.

Random layouts are :mod:`zckpt.jobs.generate_layouts`; the files (shards and strategy
files) are written by :mod:`zckpt.jobs.generate`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import UsageError
from zckpt.core.layout import rank_box, resolve
from zckpt.formats.strategy import ParamLayout, StrategyMap, make_layout


@dataclass(frozen=True)
class TensorDef:
    """One checkpoint tensor: global shape, MindSpore type and layout.

    ``layout`` ``None`` means the parameter is not listed in the strategy file and every
    rank holds the whole tensor (scalars such as ``learning_rate``).
    """

    name: str
    shape: tuple[int, ...]
    ms_type: str
    layout: ParamLayout | None = None
    listed_layout: ParamLayout | None = None
    """The layout the strategy file lists when it differs from how the shards are cut
    (MindSpore lists a ``manual_split`` table's optimizer states without the split)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the global tensor."""
        return math.prod(self.shape) * ms_dtype(self.ms_type).storage.itemsize


def _seed(name: str) -> int:
    """Stable across processes and Python versions (unlike ``hash``)."""
    return zlib.crc32(name.encode("utf-8"))


def global_value(name: str, shape: Sequence[int], ms_type: str) -> np.ndarray:
    """The deterministic global value of tensor ``name`` in MindSpore storage form.

    Floats are standard normal (so every element differs and a misplaced block shows);
    ``BFloat16`` is returned as ``uint16`` bit patterns of finite bfloat16 numbers (float32
    values rounded to nearest even), exactly what MindSpore stores; integers cover the
    whole range of their type and ``Bool`` is a fair coin.
    """
    shp = tuple(int(s) for s in shape)
    storage = ms_dtype(ms_type).storage
    rng = np.random.default_rng(_seed(name))
    size = math.prod(shp)
    if ms_type == "BFloat16":
        bits = rng.standard_normal(size, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
        flat = rounded.astype(np.uint16)
    elif ms_type == "Bool":
        flat = rng.integers(0, 2, size, dtype=np.uint8).astype(np.bool_)
    elif storage.kind == "f":
        flat = rng.standard_normal(size, dtype=np.float64 if storage.itemsize == 8 else np.float32).astype(storage)
    else:
        info = np.iinfo(storage)
        flat = rng.integers(info.min, info.max, size, dtype=storage, endpoint=True)
    return np.asarray(flat, dtype=storage).reshape(shp)


def shard_value(tensor: TensorDef, rank: int) -> np.ndarray:
    """The part of ``tensor``'s global value that stage-local ``rank`` holds."""
    value = global_value(tensor.name, tensor.shape, tensor.ms_type)
    if tensor.layout is None:
        return value
    sh = resolve(tensor.layout, tensor.shape, param=tensor.name)
    return value[rank_box(sh, rank % tensor.layout.device_num).slices()]


def default_scalars() -> list[TensorDef]:
    """The non-parameter entries MindSpore optimizers save (never in the strategy file)."""
    return [TensorDef("learning_rate", (), "Float32"), TensorDef("global_step", (1,), "Int32")]


def with_optimizer_states(tensors: Sequence[TensorDef], prefixes: Sequence[str] = ("moment1.", "moment2.")
                          ) -> list[TensorDef]:
    """``tensors`` followed by an optimizer state per prefix for every tensor with a layout.

    A state holds its parameter's shards. MindSpore lists it with the parameter's layout but,
    for a ``manual_split`` table, without ``param_split_shape`` / ``indices_offset`` (fixtures
    s18, s19): ``listed_layout`` says so, and the strategy file is written that way.
    """
    out = list(tensors)
    for prefix in prefixes:
        for t in tensors:
            if t.layout is None:
                continue
            listed = replace(t.layout, param_split_shape=(), indices_offset=()) if t.layout.param_split_shape else None
            out.append(TensorDef(prefix + t.name, t.shape, "Float32", t.layout, listed))
    return out


def strategy_of(tensors: Sequence[TensorDef], stage: int = 0) -> StrategyMap:
    """The strategy file's content for ``tensors``: each listed layout with its real shape
    (which lets the JSON form write multi-axis maps expanded, as MindSpore does)."""
    return StrategyMap(layouts={
        t.name: {stage: replace(t.listed_layout or t.layout, tensor_shape=t.shape)}
        for t in tensors if t.layout is not None
    })


def transformer_like(
    total_bytes: int,
    *,
    device_num: int,
    model_parallel: int | None = None,
    opt_parallel: bool = False,
    num_layers: int = 48,
    weight_type: str = "BFloat16",
    norm_type: str = "Float32",
) -> list[TensorDef]:
    """TensorDefs of a Megatron-style transformer of roughly ``total_bytes``, for benchmarks.

    Per layer: q/k/v/o projections ``(h, h)``, MLP ``(4h, h)`` and ``(h, 4h)`` in
    ``weight_type`` with their biases and two layer norms in ``norm_type``; plus an
    embedding ``(4h, h)`` and a final norm. ``num_layers=48`` gives ~770 entries, about 290
    of them 2-D. Layouts use ``dev_matrix (dp, mp)`` (``mp`` defaults to
    ``gcd(device_num, 4)`` so that larger jobs also have data parallelism for the
    optimizer to shard over): column-parallel weights split
    dimension 0 over ``mp``, row-parallel ones dimension 1, norms are replicated; with
    ``opt_parallel`` every tensor whose dimension 0 allows it is optimizer-sharded over
    ``dp`` (size ``-1``). ``h`` is a multiple of ``lcm(device_num, 8)`` so all splits are even.
    """
    mp = model_parallel if model_parallel is not None else math.gcd(device_num, 4)
    if mp < 1 or device_num % mp:
        raise UsageError(f"model_parallel {mp} must divide device_num {device_num}")
    dp = device_num // mp
    witem = ms_dtype(weight_type).storage.itemsize
    unit = math.lcm(device_num, 8)
    raw_h = math.sqrt(max(total_bytes, 1) / ((12 * num_layers + 4) * witem))
    h = max(unit, int(raw_h // unit) * unit)
    dev = (dp, mp)

    def lay(tmap: list[list[int]], rows_after_split: int) -> ParamLayout:
        opt = -1 if opt_parallel and dp > 1 and rows_after_split % dp == 0 else 0
        return make_layout(dev, tmap, opt_shard_step=mp if opt else 0, opt_shard_size=opt)

    col = lay([[0], []], 4 * h // mp)
    col_h = lay([[0], []], h // mp)
    row = lay([[], [0]], h)
    row_4h = lay([[], [0]], 4 * h)
    bias_h = lay([[0]], h // mp)
    bias_4h = lay([[0]], 4 * h // mp)
    norm = lay([[]], h)
    out: list[TensorDef] = [TensorDef("embedding.weight", (4 * h, h), weight_type, col_h)]
    for i in range(num_layers):
        p = f"layers.{i}."
        out += [
            TensorDef(p + "ln1.gamma", (h,), norm_type, norm),
            TensorDef(p + "ln1.beta", (h,), norm_type, norm),
        ]
        for proj in ("q", "k", "v"):
            out += [
                TensorDef(p + f"attn.{proj}.weight", (h, h), weight_type, col_h),
                TensorDef(p + f"attn.{proj}.bias", (h,), norm_type, bias_h),
            ]
        out += [
            TensorDef(p + "attn.o.weight", (h, h), weight_type, row),
            TensorDef(p + "attn.o.bias", (h,), norm_type, norm),
            TensorDef(p + "ln2.gamma", (h,), norm_type, norm),
            TensorDef(p + "ln2.beta", (h,), norm_type, norm),
            TensorDef(p + "mlp.in.weight", (4 * h, h), weight_type, col),
            TensorDef(p + "mlp.in.bias", (4 * h,), norm_type, bias_4h),
            TensorDef(p + "mlp.out.weight", (h, 4 * h), weight_type, row_4h),
            TensorDef(p + "mlp.out.bias", (h,), norm_type, norm),
        ]
    out += [TensorDef("final_norm.gamma", (h,), norm_type, norm), TensorDef("final_norm.beta", (h,), norm_type, norm)]
    return out
