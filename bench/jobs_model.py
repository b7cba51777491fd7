"""A LLaMA-like training job's checkpoint, written as MindSpore writes it, at any size and rank count.

Real jobs are pipeline x tensor x data parallel, with the optimizer sharded over the data
parallel group: every parameter is saved in many small pieces. This module builds such a
job's parameter list (MindFormers' mcore names: vocab-parallel embedding, fused qkv and output
projections, fused gate/up and down MLP, RMSNorm weights, final norm, lm_head; bf16 (or fp32) weights
and fp32 RMSNorm weights, the fp32 Adam moments beside every one of them, the optimizer's scalars)
and writes it one rank at a time, each rank's shard computed on its own, so that generating
16 GiB on 512 ranks needs neither the model in memory nor a global value per rank.

Values: element ``i`` (row-major global index) of a tensor is a hash of ``(name, i)`` turned
into a finite float, so any box of any tensor can be computed alone (:func:`box_value`) and
replicas agree. Strategy files come from :mod:`zckpt.jobs.generate`'s encoders.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zckpt.core.layout import Box, all_boxes, rank_box, resolve
from zckpt.formats.ckpt_encoding import MS_SLICE_BYTES, value_header
from zckpt.formats.strategy import ParamLayout, StrategyMap, encode_strategy, make_layout
from zckpt.jobs.generate import write_pipeline_strategies
from zckpt.jobs.generate_model import TensorDef

BYTES_PER_STEP = 32 * 1024 * 1024
"""Rows of a shard are computed and written this many bytes at a time."""


@dataclass(frozen=True)
class Parallel:
    """A job's parallel shape: ``pp`` stages of ``tp * dp`` devices (dev_matrix ``(dp, tp)``),
    the optimizer sharding every parameter over the axes that do not split it (MindSpore's
    ``optimizer_weight_shard_size`` -1) when ``opt``. ``Parallel(1, 1, 1)`` is one unsharded rank."""

    pp: int = 1
    tp: int = 1
    dp: int = 1
    opt: bool = True

    @property
    def ranks(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def stage_devices(self) -> int:
        return self.tp * self.dp

    @property
    def unsharded(self) -> bool:
        return self.ranks == 1

    @staticmethod
    def parse(text: str) -> Parallel:
        """``pp4xtp8xdp16`` (any order, missing factors are 1; ``:noopt`` turns the optimizer
        split off) or ``1`` (one unsharded rank)."""
        spec, _, flag = text.partition(":")
        sizes = {"pp": 1, "tp": 1, "dp": 1}
        if spec.strip() != "1":
            for part in spec.lower().split("x"):
                key, num = part[:2], part[2:]
                if key not in sizes or not num.isdigit() or int(num) < 1:
                    raise SystemExit(f"cannot read parallel shape {text!r} (example: pp4xtp8xdp16, tp8xdp2, 1)")
                sizes[key] = int(num)
        return Parallel(sizes["pp"], sizes["tp"], sizes["dp"], opt=flag != "noopt")

    @property
    def spec(self) -> str:
        """The text :meth:`parse` reads back, factors of 1 left out: ``pp4xtp8xdp16``, ``tp8``,
        ``tp8xdp2:noopt``, ``1``."""
        if self.unsharded:
            return "1"
        base = "x".join(f"{k}{n}" for k, n in (("pp", self.pp), ("tp", self.tp), ("dp", self.dp)) if n > 1)
        return base if self.opt else base + ":noopt"

    def __str__(self) -> str:
        if self.unsharded:
            return "1 rank (unsharded)"
        parts = [f"pp {self.pp}"] if self.pp > 1 else []
        parts += [f"tp {self.tp}", f"dp {self.dp}"]
        opt = ", optimizer parallel over dp" if self.opt and self.dp > 1 else ""
        return f"{self.ranks} ranks ({' x '.join(parts)}{opt})"


@dataclass(frozen=True)
class ModelDims:
    """A LLaMA-like decoder: ``layers`` blocks of width ``hidden``, MLP width ``ffn``, ``vocab`` tokens;
    the matrices in ``weight_type`` (``BFloat16`` as in mixed-precision training, or ``Float32``)."""

    hidden: int
    layers: int
    ffn: int
    vocab: int
    weight_type: str = "BFloat16"

    def params(self) -> list[tuple[str, tuple[int, ...], str, str]]:
        """``(name, shape, ms_type, kind)`` of every parameter, kind ``col`` (dim 0 split over tp),
        ``row`` (dim 1) or ``norm`` (replicated); embedding first, lm_head last."""
        h, f, w = self.hidden, self.ffn, self.weight_type
        out: list[tuple[str, tuple[int, ...], str, str]] = [
            ("embedding.word_embeddings.weight", (self.vocab, h), w, "col")]
        for i in range(self.layers):
            p = f"decoder.layers.{i}."
            out += [
                (p + "input_layernorm.weight", (h,), "Float32", "norm"),
                (p + "self_attention.linear_qkv.weight", (3 * h, h), w, "col"),
                (p + "self_attention.linear_proj.weight", (h, h), w, "row"),
                (p + "pre_mlp_layernorm.weight", (h,), "Float32", "norm"),
                (p + "mlp.linear_fc1.weight", (2 * f, h), w, "col"),
                (p + "mlp.linear_fc2.weight", (h, f), w, "row"),
            ]
        out += [("decoder.final_layernorm.weight", (h,), "Float32", "norm"),
                ("output_layer.weight", (self.vocab, h), w, "col")]
        return out

    def stage_of(self, name: str, pp: int) -> int:
        """The pipeline stage holding ``name``: blocks in equal runs, embedding on the first, head on the last."""
        if name.startswith("decoder.layers."):
            return int(name.split(".")[2]) * pp // self.layers
        return 0 if name.startswith("embedding.") else pp - 1


MOMENT_NAMES = {"adam": ("moment1.", "moment2."), "adamw": ("adam_m.", "adam_v.")}
"""Optimizer state prefixes: MindSpore's ``nn.Adam`` and MindFormers' AdamW."""


def size_model(total_bytes: int, unit: int, pp: int, weight_type: str = "BFloat16") -> ModelDims:
    """Dims whose checkpoint (weights + two fp32 moments: 10 bytes a parameter with bf16 weights,
    12 with fp32) is about ``total_bytes``: LLaMA's proportions (``layers ~ hidden / 128``,
    ``vocab = 8 hidden``, ``ffn ~ 8/3 hidden``), every width a multiple of ``unit`` and the layers of ``pp``."""
    params = max(total_bytes, 1) / (8 + _itemsize(weight_type))
    guess = max(1, round((params * 128 / 12) ** (1 / 3) / unit))
    best: tuple[float, ModelDims] | None = None
    for k in range(max(1, guess // 2), 2 * guess + 2):
        hidden = k * unit
        ffn = max(unit, math.ceil(8 * hidden / 3 / unit) * unit)
        per_layer = 4 * hidden * hidden + 3 * ffn * hidden
        layers = max(pp, round((params - 16 * hidden * hidden) / per_layer / pp) * pp)
        size = 16 * hidden * hidden + layers * per_layer
        score = abs(math.log(size / params)) + 0.05 * abs(math.log(layers * 128 / hidden))
        if best is None or score < best[0]:
            best = (score, ModelDims(hidden=hidden, layers=layers, ffn=ffn, vocab=8 * hidden, weight_type=weight_type))
    assert best is not None
    return best[1]


def width_unit(shapes: Sequence[Parallel]) -> int:
    """The multiple every width must be for all of ``shapes`` to split it evenly (tensor and
    optimizer parallel), at least 64."""
    return math.lcm(64, *(s.stage_devices for s in shapes))


def layout_of(kind: str, par: Parallel) -> ParamLayout:
    """The layout MindSpore gives a weight of ``kind`` (and its moments) on grid ``par``."""
    maps: dict[str, list[list[int]]] = {"col": [[0], []], "row": [[], [0]], "norm": [[]]}
    tmap = maps[kind]
    opt = par.opt and par.dp > 1
    return make_layout((par.dp, par.tp), tmap, opt_shard_step=par.tp if opt else 0, opt_shard_size=-1 if opt else 0)


def tensors(dims: ModelDims, par: Parallel, optimizer: str = "adamw") -> list[list[TensorDef]]:
    """Per pipeline stage, its parameters then their optimizer moments (same layouts, fp32)."""
    m1, m2 = MOMENT_NAMES[optimizer]
    stages: list[list[TensorDef]] = [[] for _ in range(par.pp)]
    moments: list[list[TensorDef]] = [[] for _ in range(par.pp)]
    for name, shape, ms_type, kind in dims.params():
        lay = None if par.unsharded else layout_of(kind, par)
        s = dims.stage_of(name, par.pp)
        stages[s].append(TensorDef(name, shape, ms_type, lay))
        moments[s] += [TensorDef(m1 + name, shape, "Float32", lay), TensorDef(m2 + name, shape, "Float32", lay)]
    return [a + b for a, b in zip(stages, moments, strict=True)]


def scalars(optimizer: str = "adamw") -> list[TensorDef]:
    """Entries every rank saves whole and no strategy lists."""
    extra = ["beta1_power", "beta2_power"] if optimizer == "adam" else ["scale_sense"]
    return [TensorDef("global_step", (1,), "Int32"), TensorDef("learning_rate", (1,), "Float32"),
            *(TensorDef(n, (1,), "Float32") for n in extra)]


def box_value(name: str, shape: Sequence[int], ms_type: str, box: Box) -> np.ndarray:
    """The values of ``box`` of tensor ``name``: a hash of the global element index, as a
    finite float (bf16 as its uint16 bits), int32 for ``Int32``."""
    seed = np.uint32(zlib.crc32(name.encode("utf-8")))
    if not shape:
        lin = np.zeros((), dtype=np.uint32)
    else:
        lin = np.zeros(box.shape, dtype=np.uint32)
        stride = 1
        for d in range(len(shape) - 1, -1, -1):
            idx = np.arange(box.start[d], box.stop[d], dtype=np.uint64) * np.uint64(stride)
            lin += (idx & np.uint64(0xFFFFFFFF)).astype(np.uint32).reshape((-1,) + (1,) * (len(shape) - 1 - d))
            stride *= int(shape[d])
    h = (lin ^ seed) * np.uint32(0x9E3779B1)
    h ^= h >> np.uint32(15)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    if ms_type == "BFloat16":
        return (((h >> np.uint32(16)) & np.uint32(0x8FFF)) | np.uint32(0x3000)).astype(np.uint16)
    if ms_type == "Float32":
        return ((h & np.uint32(0x8FFFFFFF)) | np.uint32(0x30000000)).view(np.float32)
    if ms_type == "Int32":
        return h.view(np.int32)
    raise ValueError(f"no generator for {ms_type}")


def _itemsize(ms_type: str) -> int:
    return 2 if ms_type == "BFloat16" else 4


def _pieces(box: Box, itemsize: int) -> Iterator[tuple[Box, list[Box]]]:
    """The ``Value`` messages of a shard (MindSpore splits one above 512 MiB by rows, as
    ``np.array_split``), each as its box and the row bands it is computed in."""
    if not box.shape:
        yield box, [box]
        return
    rows = box.shape[0]
    row_bytes = math.prod(box.shape[1:]) * itemsize
    count = max(1, math.ceil(rows * row_bytes / MS_SLICE_BYTES))
    step = max(1, BYTES_PER_STEP // max(row_bytes, 1))
    base, extra = divmod(rows, count)
    r0 = box.start[0]
    for i in range(count):
        n = base + (1 if i < extra else 0)
        piece = Box((r0, *box.start[1:]), (r0 + n, *box.stop[1:]))
        bands = [Box((a, *box.start[1:]), (min(a + step, r0 + n), *box.stop[1:])) for a in range(r0, r0 + n, step)]
        yield piece, bands or [piece]
        r0 += n


def write_rank(path: Path, defs: Sequence[TensorDef], local_rank: int) -> int:
    """Write one rank's ``.ckpt`` (temp name, then rename); returns its size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp-gen")
    with open(tmp, "wb") as f:
        for t in defs:
            box = Box.full(t.shape) if t.layout is None else rank_box(resolve(t.layout, t.shape), local_rank)
            for piece, bands in _pieces(box, _itemsize(t.ms_type)):
                f.write(value_header(t.name, t.ms_type, box.shape, piece.size * _itemsize(t.ms_type)))
                for band in bands:
                    f.write(box_value(t.name, t.shape, t.ms_type, band).tobytes())
    tmp.replace(path)
    return path.stat().st_size


def _write_ranks(root: str, ranks: list[int], stages: list[list[TensorDef]], par: Parallel,
                 extra: list[TensorDef]) -> int:
    n = par.stage_devices
    return sum(write_rank(Path(root) / f"rank_{r}" / f"checkpoint_{r}.ckpt", stages[r // n] + extra, r % n)
               for r in ranks)


def strategy_map(stages: Sequence[Sequence[TensorDef]]) -> StrategyMap:
    """A one-stage job's strategy (every listed tensor at stage 0)."""
    return StrategyMap(layouts={t.name: {0: t.layout} for s in stages for t in s if t.layout is not None})


def write_job(root: Path, dims: ModelDims, par: Parallel, *, optimizer: str = "adamw", workers: int = 1) -> Path | None:
    """Write the job below ``root`` (``rank_<r>/checkpoint_<r>.ckpt``) and its strategy files:
    ``strategy.ckpt`` without pipeline; with pipeline every rank's own ``strategy/strategy_<r>.ckpt``
    and the merged ``strategy_merged.ckpt``, as MindSpore and ``merge_pipeline_strategys`` leave
    them. Returns the strategy file to give a tool (``None``: one unsharded rank). Ranks are
    written by ``workers`` processes."""
    stages = tensors(dims, par, optimizer)
    extra = scalars(optimizer)
    root.mkdir(parents=True, exist_ok=True)
    deal = [list(range(i, par.ranks, workers)) for i in range(workers)]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(_write_ranks, [str(root)] * workers, deal, [stages] * workers, [par] * workers,
                          [extra] * workers))
    else:
        _write_ranks(str(root), deal[0], stages, par, extra)
    if par.unsharded:
        return None
    if par.pp > 1:
        return write_pipeline_strategies(root, stages, stage_device_num=par.stage_devices)[1]
    path = root / "strategy.ckpt"
    path.write_bytes(encode_strategy(strategy_map(stages)))
    return path


def write_strategy(path: Path, dims: ModelDims, par: Parallel, *, optimizer: str = "adamw") -> Path | None:
    """A destination strategy file for ``par`` (no pipeline); ``None`` for one unsharded rank."""
    if par.unsharded:
        return None
    if par.pp != 1:
        raise SystemExit("destinations with pipeline stages are not generated; give tp x dp")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_strategy(strategy_map(tensors(dims, par, optimizer))))
    return path


def model_bytes(dims: ModelDims, optimizer: str = "adamw") -> int:
    """Bytes of the global model (parameters and moments, not scalars)."""
    return sum(t.nbytes for s in tensors(dims, Parallel(), optimizer) for t in s)


@functools.cache
def _layout_boxes(layout: ParamLayout, shape: tuple[int, ...]) -> tuple[Box, ...]:
    return all_boxes(resolve(layout, shape))


def rank_boxes(t: TensorDef, par: Parallel) -> tuple[Box, ...]:
    """The box of ``t`` each rank of its pipeline stage holds, by stage-local rank."""
    if t.layout is None:
        return (Box.full(t.shape),) * par.stage_devices
    return _layout_boxes(t.layout, t.shape)


def data_bytes(dims: ModelDims, par: Parallel, optimizer: str = "adamw", *, distinct: bool = False) -> int:
    """Bytes of tensor data in the files of a job of shape ``par`` (headers aside), scalars included;
    with ``distinct``, each element once however many ranks hold it: what a reshard to ``par`` must
    read at least, whatever the source. Counted from the layouts, box by box (a layout's boxes
    are equal or disjoint, so replicas are the equal ones)."""
    total = 0
    for stage in tensors(dims, par, optimizer):
        for t in stage:
            boxes = rank_boxes(t, par)
            total += sum(b.size for b in (set(boxes) if distinct else boxes)) * _itemsize(t.ms_type)
    return total + sum(t.nbytes for t in scalars(optimizer)) * (1 if distinct else par.ranks)
