"""Write MindSpore-format distributed checkpoints without MindSpore.

Tests, benchmarks and the docs need sharded checkpoints for layouts, device counts and
sizes that the MindSpore fixtures do not cover (8 -> 3 ranks, multi-axis tensor maps,
gigabytes of weights). This module writes the files of a model described by
:mod:`zckpt.jobs.generate_model` (with layouts, e.g., from
:mod:`zckpt.jobs.generate_layouts`):

* each rank receives the box of each global value which :func:`zckpt.core.layout.rank_box`
  assigns to it (tensors without a layout are written whole on every rank, as MindSpore
  does for unlisted parameters);
* files are encoded here with :func:`zckpt.formats.ckpt_encoding.value_header`, not with
  :class:`~zckpt.formats.ckpt_writer.CkptWriter`, so reader tests do not only read what zckpt's
  own writer produced; large tensors can be split over several ``Value`` messages either
  by rows (``np.array_split``, MindSpore's ``numpy`` path) or by byte chunks (MindSpore's
  ``Tensor.get_bytes`` path, which may cut a row in two);
* the strategy file is written with zckpt's encoders in MindSpore's protobuf or JSON form
  (JSON files hold multi-axis maps in MindSpore's expanded form); a pipeline job gets each
  rank's own strategy file and the merged one.

:func:`write_model` and :func:`write_pipeline_model` write only below their ``out_dir``.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Literal

import numpy as np

from zckpt.core.dtypes import STRING_TYPE
from zckpt.core.errors import UsageError
from zckpt.core.layout import Sharding, rank_box, resolve
from zckpt.formats.ckpt_encoding import CRC_MAGIC, MS_SLICE_BYTES, value_header
from zckpt.formats.strategy import ParamLayout, StrategyMap, encode_strategy, encode_strategy_json
from zckpt.jobs.generate_model import TensorDef, default_scalars, global_value, shard_value, strategy_of

StrategyFormat = Literal["protobuf", "json"]


SplitMode = Literal["rows", "bytes"]


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
