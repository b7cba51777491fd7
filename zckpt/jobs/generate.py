"""Generate MindSpore-format distributed checkpoints without MindSpore.

Tests and benchmarks need sharded checkpoints for layouts, device counts and sizes that
the MindSpore fixtures do not cover (8 -> 3 ranks, multi-axis tensor maps, gigabytes of
weights). This module writes them from first principles:

* every tensor's *global* value is a deterministic function of its name
  (:func:`global_value`), so any shard can be checked against the value it must hold
  without keeping the whole model around;
* each rank receives the box of that value which :func:`zckpt.core.layout.rank_box` assigns to
  it (tensors without a layout are written whole on every rank, as MindSpore does for
  unlisted parameters);
* files are encoded here with :func:`zckpt.formats.ckpt_encoding.value_header`, not with
  :class:`~zckpt.formats.ckpt_writer.CkptWriter`, so reader tests do not only read what zckpt's
  own writer produced; large tensors can be split over several ``Value`` messages either
  by rows (``np.array_split``, MindSpore's ``numpy`` path) or by byte chunks (MindSpore's
  ``Tensor.get_bytes`` path, which may cut a row in two);
* the strategy file is written with zckpt's encoders in MindSpore's protobuf or JSON form.

:func:`random_layout` draws layouts of the kinds MindSpore's parallel compiler produces
(factorised device matrices, left-most replication axes, unsplit dimensions, several axes
on one dimension, optimizer sharding over one or more repeated axes, including an axis
larger than the shard size still needs, ``manual_split`` uneven row splits, a ``field``
value), :func:`with_optimizer_states` adds the optimizer states MindSpore saves with them
(listed, as MindSpore does, without the uneven split of their parameter), JSON strategy files
hold multi-axis maps in MindSpore's expanded form, and :func:`transformer_like` sizes a
Megatron-style model for benchmarks.

Everything is pure apart from :func:`write_model`, which only writes below ``out_dir``.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Literal

import numpy as np

from zckpt.core.dtypes import STRING_TYPE, ms_dtype
from zckpt.core.errors import UsageError
from zckpt.core.layout import Sharding, rank_box, resolve
from zckpt.formats.ckpt_encoding import CRC_MAGIC, MS_SLICE_BYTES, value_header
from zckpt.formats.strategy import ParamLayout, StrategyMap, encode_strategy, encode_strategy_json, make_layout

StrategyFormat = Literal["protobuf", "json"]
SplitMode = Literal["rows", "bytes"]


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


@dataclass(frozen=True)
class GeneratedModel:
    """What :func:`write_model` wrote, with the means to recompute any expected shard."""

    root: Path
    device_num: int
    tensors: tuple[TensorDef, ...]
    strings: Mapping[str, str]
    rank_files: tuple[Path, ...]
    strategy_path: Path | None
    reference_path: Path | None
    strategy: StrategyMap = field(repr=False)

    def tensor(self, name: str) -> TensorDef:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def global_value(self, name: str) -> np.ndarray:
        t = self.tensor(name)
        return global_value(t.name, t.shape, t.ms_type)

    def expected_shard(self, name: str, rank: int) -> np.ndarray:
        """The value rank ``rank`` holds for ``name`` (recomputed, not read back)."""
        return shard_value(self.tensor(name), rank)


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


# --------------------------------------------------------------------------- layouts


def _prime_factors(n: int) -> list[int]:
    out = []
    p = 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


def _random_factorization(rng: np.random.Generator, n: int) -> list[int]:
    """A random ordered factorisation of ``n`` into factors > 1 (empty for 1)."""
    primes = _prime_factors(n)
    rng.shuffle(primes)
    factors: list[int] = []
    for p in primes:
        if factors and rng.random() < 0.4:
            factors[-1] *= p
        else:
            factors.append(p)
    return factors


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_opt_sizes(dev_matrix: Sequence[int], used_dev_indices: set[int]) -> list[int]:
    """Optimizer shard sizes MindSpore can lay out on the repeated axes of a device matrix.

    The shard consumes the repeated axes (not used by the tensor map, size > 1) from the
    innermost outwards, whole axes first, and the last one only in part; so the valid
    sizes are ``(product of the k innermost repeated axes) * d`` with ``d`` dividing the
    next axis. Derived here independently of :mod:`zckpt.core.layout` so that tests of it are
    not circular.
    """
    repeated = [n for i, n in enumerate(dev_matrix) if i not in used_dev_indices and n > 1]
    sizes: set[int] = set()
    whole = 1
    for n in reversed(repeated):
        sizes.update(whole * d for d in _divisors(n) if d > 1)
        whole *= n
    return sorted(sizes)


def random_layout(
    rng: np.random.Generator,
    shape: Sequence[int],
    device_num: int,
    *,
    allow_opt: bool = True,
    allow_multi_axis: bool = True,
    unlisted_prob: float = 0.0,
    uneven_prob: float = 0.0,
    field_prob: float = 0.0,
) -> ParamLayout | None:
    """A random layout of ``shape`` on ``device_num`` devices that fits the shape.

    Draws a device matrix (a random factorisation of ``device_num``, sometimes with a
    left-most axis reserved for replication and sometimes with a size-1 axis), maps device
    axes onto dimensions they divide (possibly several onto one dimension when
    ``allow_multi_axis``; some axes stay unmapped, i.e. replicate), and with
    ``allow_opt`` picks an optimizer shard size: ``0``, ``-1`` (all repeated axes) or any
    valid size, including one that takes only part of an axis. Returns ``None`` (an
    unlisted tensor) with probability ``unlisted_prob``. With probability ``uneven_prob`` a
    dimension 0 split by one axis gets uneven pieces (``param_split_shape`` /
    ``indices_offset``, ``Gather`` ``manual_split``; MindSpore then shards no optimizer state
    of it), with ``field_prob`` a ``field`` value (``MatMul`` ``field_size``). Both draw from
    ``rng`` only when their probability is positive, so older seeds give the same layouts.
    """
    shp = tuple(int(s) for s in shape)
    if device_num < 1:
        raise UsageError(f"device_num must be positive, got {device_num}")
    if unlisted_prob > 0 and rng.random() < unlisted_prob:
        return None
    factors = _random_factorization(rng, device_num)
    if rng.random() < 0.15:
        factors.insert(int(rng.integers(0, len(factors) + 1)), 1)
    dev = tuple(factors) if factors else (1,)
    reserve_left = len(dev) >= 2 and rng.random() < 0.3
    ndim_dev = len(dev)
    axes = [a for a in range(ndim_dev) if not (reserve_left and a == ndim_dev - 1)]
    rng.shuffle(axes)
    tmap: list[list[int]] = [[] for _ in shp]
    remaining = list(shp)
    for a in axes:
        size = dev[ndim_dev - 1 - a]
        if not shp or rng.random() < 0.25:
            continue
        cands = [i for i in range(len(shp)) if remaining[i] % size == 0 and (allow_multi_axis or not tmap[i])]
        if not cands:
            continue
        i = cands[int(rng.integers(0, len(cands)))]
        tmap[i].append(a)
        remaining[i] //= size
    opt_size = 0
    opt_step = 0
    if allow_opt and shp and rng.random() < 0.6:
        used = {ndim_dev - 1 - a for axes_ in tmap for a in axes_}
        split0 = math.prod(dev[ndim_dev - 1 - a] for a in tmap[0])
        rows = shp[0] // split0
        sizes = [s for s in valid_opt_sizes(dev, used) if rows % s == 0]
        repeated_total = math.prod(n for i, n in enumerate(dev) if i not in used)
        choices: list[int] = list(sizes)
        if repeated_total > 1 and rows % repeated_total == 0:
            choices.append(-1)
        if choices:
            opt_size = choices[int(rng.integers(0, len(choices)))]
            inner = max(i for i, n in enumerate(dev) if i not in used and n > 1)
            opt_step = math.prod(dev[inner + 1 :])
    split: list[int] = []
    offsets: list[int] = []
    if uneven_prob > 0 and rng.random() < uneven_prob and shp and len(tmap[0]) == 1:
        pieces = dev[ndim_dev - 1 - tmap[0][0]]
        if shp[0] >= pieces > 1:
            # one count and offset per row piece, as MindSpore's compiler writes manual_split
            split = _uneven_parts(rng, shp[0], pieces)
            offsets = [sum(split[:k]) for k in range(pieces)]
            opt_size = opt_step = 0
    field_size = int(rng.choice([2, 6, 39])) if field_prob > 0 and rng.random() < field_prob else 0
    return make_layout(dev, [list(t) for t in tmap], opt_shard_step=opt_step, opt_shard_size=opt_size,
                       field_size=field_size, param_split_shape=split, indices_offset=offsets)


def _uneven_parts(rng: np.random.Generator, total: int, count: int) -> list[int]:
    """``count`` positive row counts adding up to ``total``, not all equal when that is possible."""
    for _ in range(8):
        cuts = sorted(int(c) for c in rng.choice(np.arange(1, total), size=count - 1, replace=False))
        parts = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
        if len(set(parts)) > 1:
            return parts
    return parts


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


# --------------------------------------------------------------------------- model shapes


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


# --------------------------------------------------------------------------- writing


class _RawCkptFile:
    """Minimal ``.ckpt`` writer over :func:`value_header`: temp name, optional CRC, rename.

    Kept separate from :class:`~zckpt.formats.ckpt_writer.CkptWriter` on purpose (see module doc)
    and because it must be able to emit several ``Value``s with one tag.
    """

    def __init__(self, path: Path, *, crc: bool) -> None:
        self.path = path
        self.tmp_path = path.with_name(path.name + ".tmp-gen")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f: BinaryIO | None = open(self.tmp_path, "wb")  # noqa: SIM115
        self._crc = 0 if crc else None

    def __enter__(self) -> _RawCkptFile:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is None:
            self.commit()
        else:
            self.abort()

    def write(self, data: bytes | memoryview) -> None:
        assert self._f is not None
        self._f.write(data)
        if self._crc is not None:
            self._crc = zlib.crc32(data, self._crc)

    def commit(self) -> None:
        if self._f is None:
            return
        if self._crc is not None:
            self._f.write(CRC_MAGIC + self._crc.to_bytes(10, "big"))
        self._f.close()
        self._f = None
        os.replace(self.tmp_path, self.path)

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self.tmp_path.unlink(missing_ok=True)


def _raw_bytes(array: np.ndarray) -> memoryview:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def encode_tensor(
    name: str,
    ms_type: str,
    array: np.ndarray,
    *,
    slice_bytes: int = MS_SLICE_BYTES,
    split: SplitMode = "rows",
) -> Iterator[bytes | memoryview]:
    """The bytes of one tensor entry, as one or several ``Value`` messages.

    Above ``slice_bytes`` MindSpore splits a tensor: its numpy path uses
    ``np.array_split(array, ceil(nbytes / slice_bytes))`` along axis 0 (pieces may be
    empty when there are fewer rows than pieces), its ``Tensor.get_bytes`` path cuts the
    raw bytes every ``slice_bytes`` (``split="bytes"``, which can cut rows). Every piece
    carries the full dims.
    """
    dims = array.shape
    if array.nbytes > slice_bytes and array.ndim > 0:
        if split == "rows":
            count = math.ceil(array.nbytes / slice_bytes)
            for piece in np.array_split(array, count, axis=0):
                yield value_header(name, ms_type, dims, piece.nbytes)
                yield _raw_bytes(piece)
            return
        raw = _raw_bytes(array)
        step = slice_bytes - slice_bytes % array.itemsize or array.itemsize
        for start in range(0, len(raw), step):
            chunk = raw[start : start + step]
            yield value_header(name, ms_type, dims, len(chunk))
            yield chunk
        return
    yield value_header(name, ms_type, dims, array.nbytes)
    yield _raw_bytes(array)


def encode_string(name: str, value: str) -> bytes:
    """A MindSpore ``append_dict`` string entry: dims ``[0]``, type ``str``, UTF-32-LE text."""
    payload = np.array(value).tobytes()
    return value_header(name, STRING_TYPE, [0], len(payload)) + payload


def default_scalars() -> list[TensorDef]:
    """The non-parameter entries MindSpore optimizers save (never in the strategy file)."""
    return [TensorDef("learning_rate", (), "Float32"), TensorDef("global_step", (1,), "Int32")]


def write_model(
    out_dir: str | os.PathLike[str],
    tensors: Sequence[TensorDef],
    *,
    device_num: int,
    strategy_format: StrategyFormat | None = "protobuf",
    scalars: bool = True,
    strings: Mapping[str, str] | None = None,
    crc: bool = False,
    prefix: str = "checkpoint_",
    reference: bool = False,
    slice_bytes: int = MS_SLICE_BYTES,
    split: SplitMode = "rows",
) -> GeneratedModel:
    """Write a sharded MindSpore checkpoint of ``tensors`` on ``device_num`` ranks.

    Layout of ``out_dir`` (the same as a MindSpore job and the fixtures)::

        rank_<r>/<prefix><r>.ckpt    one shard per rank
        strategy.ckpt | strategy.json  layouts of the tensors that have one
        reference/global.ckpt        the unsharded values (``reference=True``)

    ``scalars`` appends :func:`default_scalars`; ``strings`` adds ``append_dict`` string
    entries. ``slice_bytes``/``split`` control multi-``Value`` tensors (see
    :func:`encode_tensor`); the default is MindSpore's 512 MiB. Every global value is
    computed once and sliced for all ranks, so memory stays at one tensor.
    """
    root = Path(out_dir)
    defs = list(tensors) + (default_scalars() if scalars else [])
    strs = dict(strings or {})
    names = [t.name for t in defs] + list(strs)
    if len(set(names)) != len(names):
        raise UsageError("entry names must be unique", path=root)
    if device_num < 1:
        raise UsageError(f"device_num must be positive, got {device_num}", path=root)
    if strategy_format not in ("protobuf", "json", None):
        raise UsageError(f"strategy_format must be 'protobuf', 'json' or None, not {strategy_format!r}")
    shardings: dict[str, Sharding] = {}
    for t in defs:
        if t.layout is None:
            continue
        if t.layout.device_num != device_num:
            raise UsageError(f"layout is for {t.layout.device_num} devices, the model has {device_num}", param=t.name)
        shardings[t.name] = resolve(t.layout, t.shape, param=t.name)
    rank_files = tuple(root / f"rank_{r}" / f"{prefix}{r}.ckpt" for r in range(device_num))
    ref_path = root / "reference" / "global.ckpt" if reference else None
    with ExitStack() as stack:
        files = [stack.enter_context(_RawCkptFile(p, crc=crc)) for p in rank_files]
        ref = stack.enter_context(_RawCkptFile(ref_path, crc=crc)) if ref_path is not None else None
        for t in defs:
            value = global_value(t.name, t.shape, t.ms_type)
            sh = shardings.get(t.name)
            for r, f in enumerate(files):
                part = value if sh is None else value[rank_box(sh, r).slices()]
                for chunk in encode_tensor(t.name, t.ms_type, part, slice_bytes=slice_bytes, split=split):
                    f.write(chunk)
            if ref is not None:
                for chunk in encode_tensor(t.name, t.ms_type, value, slice_bytes=slice_bytes, split=split):
                    ref.write(chunk)
        for name, text in strs.items():
            for f in files if ref is None else [*files, ref]:
                f.write(encode_string(name, text))
    smap = strategy_of(defs)
    strategy_path: Path | None = None
    if strategy_format == "protobuf":
        strategy_path = root / "strategy.ckpt"
        strategy_path.write_bytes(encode_strategy(smap))
    elif strategy_format == "json":
        strategy_path = root / "strategy.json"
        strategy_path.write_text(encode_strategy_json(smap), encoding="utf-8")
    return GeneratedModel(
        root=root,
        device_num=device_num,
        tensors=tuple(defs),
        strings=strs,
        rank_files=rank_files,
        strategy_path=strategy_path,
        reference_path=ref_path,
        strategy=smap,
    )


# --------------------------------------------------------------------------- pipeline jobs


@dataclass(frozen=True)
class PipelineModel:
    """What :func:`write_pipeline_model` wrote: a pipeline job's shards and strategy files."""

    root: Path
    stage_device_num: int
    stages: tuple[tuple[TensorDef, ...], ...]
    rank_files: tuple[Path, ...]
    strategy_dir: Path
    merged_strategy: Path

    @property
    def device_num(self) -> int:
        return self.stage_device_num * len(self.stages)

    def stage_strategy(self, stage: int) -> StrategyMap:
        return _stage_map(self.stages[stage], stage)


def _stage_map(tensors: Sequence[TensorDef], stage: int) -> StrategyMap:
    """A per-rank strategy file's content: the stage's layouts, and an operator strategy that
    carries the stage number (that is how MindSpore's files say which stage they describe)."""
    return StrategyMap(
        layouts={t.name: {stage: t.listed_layout or t.layout} for t in tensors if t.layout is not None},
        operator_strategies={f"MatMul-stage{stage}": (stage, ((1, 1), (1, 1)))},
    )


def write_pipeline_strategies(
    root: Path, stages: Sequence[Sequence[TensorDef]], *, stage_device_num: int
) -> tuple[Path, Path]:
    """A pipeline job's strategy files, as MindSpore leaves them: ``root/strategy/strategy_<r>.ckpt``
    (each rank's own file: its stage's layouts, no name prefix) and ``root/strategy_merged.ckpt``
    (what ``merge_pipeline_strategys`` makes of them). Returns both paths; shards are written
    apart (by :func:`write_pipeline_model`, or by a benchmark's streaming generator)."""
    n = stage_device_num
    strategy_dir = root / "strategy"
    strategy_dir.mkdir(parents=True, exist_ok=True)
    for s, tensors in enumerate(stages):
        data = encode_strategy(_stage_map(tensors, s), merged=False, current_stage=s)
        for local in range(n):
            (strategy_dir / f"strategy_{s * n + local}.ckpt").write_bytes(data)
    merged: dict[str, dict[int, ParamLayout]] = {}
    ops: dict[str, tuple[int, tuple[tuple[int, ...], ...]]] = {}
    for s, tensors in enumerate(stages):
        one = _stage_map(tensors, s)
        ops.update(one.operator_strategies)
        for name, per in one.layouts.items():
            merged.setdefault(name, {}).update(per)
    merged_path = root / "strategy_merged.ckpt"
    merged_path.write_bytes(encode_strategy(StrategyMap(merged, operator_strategies=ops), merged=True, current_stage=1))
    return strategy_dir, merged_path


def write_pipeline_model(
    out_dir: str | os.PathLike[str],
    stages: Sequence[Sequence[TensorDef]],
    *,
    stage_device_num: int,
    scalars: bool = True,
    prefix: str = "checkpoint_",
) -> PipelineModel:
    """Write a pipeline-parallel job: stage ``s`` runs on ranks ``s*n .. s*n+n-1``.

    Each rank holds its stage's tensors (a tensor listed in several stages, such as a tied
    embedding, is held by all of them) plus the optimizer scalars; ``strategy/strategy_<r>.ckpt``
    is each rank's own strategy file (stage parameters only, no name prefix) and
    ``strategy_merged.ckpt`` is what ``merge_pipeline_strategys`` makes of them.
    """
    root = Path(out_dir)
    n = stage_device_num
    for s, tensors in enumerate(stages):
        for t in tensors:
            if t.layout is not None and t.layout.device_num != n:
                raise UsageError(f"stage {s} layout is for {t.layout.device_num} devices, not {n}", param=t.name)
    extra = default_scalars() if scalars else []
    rank_files = []
    for s, tensors in enumerate(stages):
        defs = [*tensors, *extra]
        for local in range(n):
            rank = s * n + local
            path = root / f"rank_{rank}" / f"{prefix}{rank}.ckpt"
            with _RawCkptFile(path, crc=False) as f:
                for t in defs:
                    value = global_value(t.name, t.shape, t.ms_type)
                    part = value if t.layout is None else value[rank_box(resolve(t.layout, t.shape), local).slices()]
                    for chunk in encode_tensor(t.name, t.ms_type, part):
                        f.write(chunk)
            rank_files.append(path)
    strategy_dir, merged_path = write_pipeline_strategies(root, stages, stage_device_num=n)
    return PipelineModel(
        root=root,
        stage_device_num=n,
        stages=tuple(tuple(s) for s in stages),
        rank_files=tuple(rank_files),
        strategy_dir=strategy_dir,
        merged_strategy=merged_path,
    )
