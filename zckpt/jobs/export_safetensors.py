"""Export to safetensors: each destination rank as ``rank_<r>/<prefix><r>.safetensors``.

MindSpore's own safetensors jobs (``save_checkpoint(format="safetensors")``,
``transform_checkpoints(..., output_format="safetensors")``) use this layout, so the files
load with ``mindspore.load_checkpoint(f, format="safetensors")`` and with any safetensors
reader. The export plan gives every tensor's name, type and shape before a byte is read,
so each file's header is written first and the tensors' bytes are then streamed from the
store band by band (at most ``block_bytes`` in memory), under a temporary name renamed
when complete.

* dtypes map one to one (``BFloat16`` -> ``BF16`` with the exact bits the store keeps);
* metadata is MindSpore's ``{"format": "ms"}`` (plus ``crc_num`` with ``crc``, computed
  as MindSpore does); string entries go to ``__metadata__`` under ``"zckpt.str:" + name``;
* MapParameter entries have no safetensors form (MindSpore cannot save them either): refused;
* with ``max_file_bytes`` a rank larger than that is split HF-style into
  ``<prefix><r>-00001-of-0000K.safetensors`` parts (tensors whole, in plan order) plus
  ``<prefix><r>.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``);
  string entries go to the first part. ``zckpt ingest`` reads such a rank back through
  its index.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import OutputError
from zckpt.core.layout import Box
from zckpt.formats.safetensors import MS_METADATA, STRING_PREFIX, SafetensorsWriter, TensorHeader
from zckpt.formats.shard_reader import INDEX_SUFFIX
from zckpt.io import fileio, remote
from zckpt.jobs.export_job import (
    ExportOptions,
    ExportReport,
    PlannedStore,
    export_fingerprint,
    export_session,
    output_jobs,
    target_name,
    task_name,
)
from zckpt.plan.plans import ExportPlan, RankExport
from zckpt.run.choose import placement
from zckpt.run.progress import Report, Ticker
from zckpt.sources.strategies import StrategyArg
from zckpt.store.reader import StoreReader
from zckpt.store.store import Store
from zckpt.write import out_records
from zckpt.write.out_dirs import output_folders
from zckpt.write.rank_writer import BoxReader, RankResult

SUFFIX = ".safetensors"


def part_name(stem: str, index: int, count: int) -> str:
    """HF's shard file name: ``<stem>-00001-of-00003.safetensors``."""
    return f"{stem}-{index + 1:05d}-of-{count:05d}{SUFFIX}"


def split_parts(tensors: Sequence[TensorHeader], max_bytes: int) -> list[list[TensorHeader]]:
    """Tensors grouped in order into parts of at most ``max_bytes`` of data (a larger tensor
    gets a part of its own); one part when ``max_bytes`` is 0."""
    if max_bytes <= 0 or not tensors:
        return [list(tensors)]
    parts: list[list[TensorHeader]] = [[]]
    size = 0
    for t in tensors:
        if parts[-1] and size + t.nbytes > max_bytes:
            parts.append([])
            size = 0
        parts[-1].append(t)
        size += t.nbytes
    return parts


def _stem(target: Path) -> str:
    return target.name[: -len(SUFFIX)] if target.name.endswith(SUFFIX) else target.stem


def existing_outputs(target: Path) -> list[Path]:
    """Every file an export of ``target`` may leave: the single file, the index, parts."""
    stem = _stem(target)
    found = [target, target.with_name(stem + INDEX_SUFFIX)]
    if target.parent.is_dir():
        found += sorted(target.parent.glob(f"{stem}-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]{SUFFIX}"))
    return [p for p in found if p.exists()]


def output_names(target_name: str, names: Iterable[str]) -> list[str]:
    """Which of ``names`` (files beside ``target``) an export of ``target`` may leave: the
    single file, its index, its parts (what :func:`existing_outputs` finds on a local disk)."""
    stem = target_name[: -len(SUFFIX)] if target_name.endswith(SUFFIX) else Path(target_name).stem
    part = re.compile(re.escape(stem) + r"-[0-9]{5}-of-[0-9]{5}" + re.escape(SUFFIX) + "$")
    return sorted(n for n in names if n in (target_name, stem + INDEX_SUFFIX) or part.match(n))


def _remote_outputs(out: remote.Location, target: str) -> list[str]:
    """Filesystem paths of what an export of ``target`` (a path below ``out``) left there."""
    folder, name = target.rsplit("/", 1)
    beside = [n for n, d in remote.listdir(remote.Location(out.url_of(folder), out.fs, folder), OutputError) if not d]
    return [f"{folder}/{n}" for n in output_names(name, beside)]


def export_safetensors(
    store_or_path: Store | str | Path,
    out_dir: str | Path,
    strategy: StrategyArg = None,
    *,
    ranks: Iterable[int] | None = None,
    options: ExportOptions | None = None,
) -> ExportReport:
    """Write ``out_dir/rank_<r>/<prefix><r>.safetensors`` for every (or each requested) rank."""
    options = options if options is not None else ExportOptions(format="safetensors")
    if options.format != "safetensors":
        raise OutputError(f"unknown output format {options.format!r} (ckpt or safetensors)")
    t0 = time.perf_counter()
    with export_session(store_or_path, out_dir, strategy, ranks, options) as (store, plan, out_loc, out):
        return _export_safetensors(store, plan, out_loc, out, options, t0)


def _export_safetensors(store: Store, plan: ExportPlan, out_loc: remote.Location | None, out: Path,
                        options: ExportOptions, t0: float) -> ExportReport:
    kinds = {e.name: e.kind for e in store.entries()}
    for r in plan.ranks:
        for s in r.slices:
            if kinds[s.name] == "map":
                raise OutputError("MapParameter entries have no safetensors form (MindSpore cannot save them as "
                                  "safetensors either); export this store as .ckpt", param=s.name)
    if out_loc is None and out.exists() and not out.is_dir():
        raise OutputError("output path exists and is not a directory", path=out)
    jobs = [(r, p.with_suffix(SUFFIX)) for r, p in output_jobs(store, plan, out, options)]
    fingerprint = safetensors_fingerprint(export_fingerprint(store, jobs, options), options)
    if not options.overwrite:
        if out_loc is None:
            clash = [str(p) for _, target in jobs for p in existing_outputs(target)]
        else:
            clash = [out_loc.url_of(p) for _, target in jobs for p in _remote_outputs(out_loc, target.as_posix())]
        if clash and out_loc is None and out_records.finished_as_recorded(out, fingerprint):
            return ExportReport(str(out), (), time.perf_counter() - t0, kept=len(jobs))  # complete: left as it is
        if clash:
            raise OutputError(f"{len(clash)} output file(s) already exist (--overwrite replaces them)", path=clash[0])
    if out_loc is None:
        output_folders(out, [p for _, p in jobs])
    sizes = {e.name: ms_dtype(e.ms_type).storage.itemsize for e in store.entries() if e.kind == "tensor"}
    units = [(r, target_name(out_loc, p)) for r, p in jobs]
    with placement(options) as place, place.running():
        options = replace(options, block_bytes=place.share(options.block_bytes))
        results = place.run(write_safetensors_file, units, PlannedStore.of(store), options, label="export",
                            progress=options.progress, name=task_name,
                            size=lambda u: sum(s.box.size * sizes.get(s.name, 0) for s in u[0].slices))
    if out_loc is None:
        out_records.remember_all(out, fingerprint)
    return ExportReport(out_loc.url if out_loc is not None else str(out), tuple(results), time.perf_counter() - t0)


def safetensors_fingerprint(base: str, options: ExportOptions) -> str:
    """Identity of a safetensors export or transform: the ``.ckpt`` one's ``base`` (which
    holds the ``.safetensors`` file names), with how ranks are split into parts."""
    doc = {"base": base, "format": "safetensors", "max_file_bytes": options.max_file_bytes}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def write_safetensors_file(
    unit: tuple[RankExport, str], store: PlannedStore, options: ExportOptions, report: Report | None = None
) -> RankResult:
    """Write one destination rank (a Dask task: it opens the store itself)."""
    rank, target = unit
    reader = StoreReader(store.open(options.storage_options), options)
    reader.store.prefetch(s.name for s in rank.slices)
    ticker = Ticker(report)
    if not remote.is_remote(target):
        with fileio.disk_full_named(target):
            return write_rank(reader, rank, Path(target), options, ticker)
    return _write_remote_rank(reader, rank, target, options, ticker)


def _write_remote_rank(
    reader: StoreReader, rank: RankExport, target: str, options: ExportOptions, ticker: Ticker | None = None
) -> RankResult:
    """Write the rank's files in a local temporary directory, upload each when complete (the
    parts before the index that names them), then remove what an earlier export of this
    rank left that this one did not write (e.g. parts of another split)."""
    loc = remote.locate(target, options.storage_options, OutputError)
    folder = loc.sibling("")
    stale = set(_remote_outputs(loc, loc.path))
    with tempfile.TemporaryDirectory(prefix="zckpt-out-") as tmp:
        name = target.rstrip("/").rsplit("/", 1)[-1]
        result = write_rank(reader, rank, Path(tmp) / name, options, ticker)
        made = sorted(p.name for p in Path(tmp).iterdir())
        index = Path(result.path).name if Path(result.path).name.endswith(INDEX_SUFFIX) else None
        for n in [m for m in made if m != index] + ([index] if index else []):
            remote.upload(Path(tmp) / n, folder.child(n), OutputError)
    written = {folder.child(n).path for n in made}
    for p in sorted(stale - written):
        remote.remove(remote.Location(loc.url_of(p), loc.fs, p), OutputError)
    return replace(result, path=folder.child(Path(result.path).name).url)


def write_rank(
    reader: BoxReader, rank: RankExport, target: Path, options: ExportOptions, ticker: Ticker | None = None
) -> RankResult:
    """One rank's file, or its parts and index when it exceeds ``max_file_bytes``, from any
    place where boxes live (the store, the source shards)."""
    for s in rank.slices:
        if reader.kind(s.name) == "map":
            raise OutputError("MapParameter entries have no safetensors form (MindSpore cannot save them as "
                              "safetensors either); write this rank as .ckpt", param=s.name)
    tensors = [TensorHeader(s.name, reader.ms_type(s.name), s.box.shape) for s in rank.slices
               if reader.kind(s.name) == "tensor"]
    boxes = {s.name: s.box for s in rank.slices}
    meta = dict(MS_METADATA)
    for s in rank.slices:
        if reader.kind(s.name) == "str":
            meta[STRING_PREFIX + s.name] = reader.string(s.name)
    parts = split_parts(tensors, options.max_file_bytes)
    stem = _stem(target)
    stale = set(existing_outputs(target))
    if len(parts) == 1:
        paths = [target]
    else:
        paths = [target.with_name(part_name(stem, i, len(parts))) for i in range(len(parts))]
    index_path = target.with_name(stem + INDEX_SUFFIX)
    if len(parts) > 1:
        _retract(index_path, fsync=options.fsync)
    total = 0
    published: list[Path] = []
    try:
        for i, (path, part) in enumerate(zip(paths, parts, strict=True)):
            part_meta = meta if i == 0 else dict(MS_METADATA)
            with SafetensorsWriter(path, part, part_meta, crc=options.crc, fsync=options.fsync) as w:
                bands = _BandStream(reader, [(t.name, b) for t in w.order
                                             for b in reader.bands(t.name, boxes[t.name])], options.block_bytes)
                for t in w.order:
                    w.write_tensor(t.name, bands.take(t.name))
                    if ticker is not None:
                        ticker.add(t.name, t.nbytes)
            published.append(path)
            total += path.stat().st_size
    except BaseException:
        if len(parts) > 1:  # no index names them any more: parts of this write or of an older one
            for p in sorted({*published, *stale} - {target, index_path}):
                _retract(p, fsync=False)
        raise
    result_path = paths[0]
    if len(parts) > 1:
        result_path = index_path
        doc = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
               "weight_map": {t.name: p.name for p, part in zip(paths, parts, strict=True) for t in part}}
        _write_json(result_path, doc, fsync=options.fsync)
        total += result_path.stat().st_size
    for p in stale - {*paths, result_path}:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    if ticker is not None:
        ticker.close()
    return RankResult(rank.rank, str(result_path), len(tensors), total, reader.read_bytes, reader.checked_bytes)


def _retract(path: Path, *, fsync: bool) -> None:
    """Remove an output that must not outlive a failed split write: an old index would name
    a mix of new and old parts, new parts without their index would look like a short model."""
    try:
        path.unlink()
    except FileNotFoundError:
        return
    if fsync:
        fileio.fsync_dir(path.parent)


def _write_json(path: Path, doc: object, *, fsync: bool) -> None:
    text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    fileio.write_atomic(path, text.encode("utf-8"), fsync=fsync)


class _BandStream:
    """Band arrays in file order, read from the store batch by batch (at most ``limit``
    bytes materialised at a time, or one band when a band alone is larger)."""

    def __init__(self, reader: BoxReader, bands: list[tuple[str, Box]], limit: int) -> None:
        self.reader = reader
        self.todo = deque(bands)
        self.ready: deque[tuple[str, np.ndarray]] = deque()
        self.limit = max(1, limit)
        self.itemsize = {name: ms_dtype(reader.ms_type(name)).storage.itemsize for name, _ in bands}

    def take(self, name: str) -> Iterator[np.ndarray]:
        """The bands of ``name`` (the next tensor in order)."""
        while True:
            if not self.ready:
                if not self.todo or self.todo[0][0] != name:
                    return
                self._fill()
            if self.ready[0][0] != name:
                return
            yield self.ready.popleft()[1]

    def _fill(self) -> None:
        batch: list[tuple[str, Box]] = []
        size = 0
        while self.todo:
            name, box = self.todo[0]
            nbytes = box.size * self.itemsize[name]
            if batch and size + nbytes > self.limit:
                break
            batch.append(self.todo.popleft())
            size += nbytes
        for (name, _), arr in zip(batch, self.reader.materialise(batch), strict=True):
            self.ready.append((name, arr))
