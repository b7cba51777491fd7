"""Export: materialise each destination rank's slices from the store into ``.ckpt`` files.

Each destination rank is one Dask task (ranks run in parallel with ``workers``). Inside a
rank, slices are cut into bands of at most ``block_bytes`` and materialised batch by batch,
then streamed into the rank's file, which is written under a temporary name and renamed
only when complete. Two readers materialise a batch: ``"zarr"`` (default) issues the whole
batch as concurrent Zarr reads in one event-loop round trip; ``"dask"`` builds each slice as
a lazy ``dask.array`` view of the Zarr array and computes the batch with Dask. Both give the
same bytes; the Zarr reader avoids Dask's per-chunk task overhead (about 4x faster on
models with hundreds of small tensors, see bench/RESULTS.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

import numpy as np

from zckpt import locks, out_dirs, remote, safe_paths
from zckpt.checksums import BlockCheck, ChunkSums, Mismatch, ReadAt, Sink, SpanCheck, SpanChecks
from zckpt.collect import fewer_collections
from zckpt.dtypes import ms_dtype
from zckpt.errors import OutputError, StoreError, UsageError
from zckpt.fileio import Publisher, disk_full_named
from zckpt.formats.ckpt import FileRange
from zckpt.formats.strategy import StrategyMap
from zckpt.helper import hand_over, helper_for, overlap_beside
from zckpt.layout import Box, c_order_pieces, tiles
from zckpt.out_dirs import finish_output, output_dir, resume_or_refuse, resume_or_refuse_remote
from zckpt.partial_inputs import needed_params, refuse_unsupplied
from zckpt.plan import ExportPlan, RankExport, build_export_plan
from zckpt.progress import Report, Ticker
from zckpt.rank_writer import RankResult, batch_bytes, write_ckpt_rank
from zckpt.runner import Engine, dask_client, run_all, wants_overlap
from zckpt.strategies import StrategyArg, load_strategy

if TYPE_CHECKING:  # imported where used: the direct path shares this module's options and never needs Zarr
    from zckpt.store import Checked, Store

MiB = 1024 * 1024


@dataclass(frozen=True)
class ExportOptions:
    prefix: str = "checkpoint_"
    block_bytes: int = 64 * MiB
    overwrite: bool = False
    crc: bool = False
    dask_scheduler: str = "threads"
    """Dask scheduler computing lazy views inside one task (reader "dask")."""
    fsync: bool = True
    reader: str = "zarr"
    verify_checksums: bool = True
    """Check the recorded CRC-32C of every chunk block a slice uses, on the bytes read for it
    (once per block and task)."""
    workers: int = 1
    processes: bool = False
    """Local workers (``workers`` > 1) as processes instead of threads of this process."""
    helper: bool | None = None
    """``.ckpt`` files from a local store into a local directory: write part of the files in a
    second process (:mod:`zckpt.helper`) while this one writes the others. ``None`` (auto):
    from :data:`zckpt.helper.HELPER_BYTES` on, with a core to spare and no Dask cluster."""
    overlap: bool | None = None
    """Each task reads and checks on a second thread while it writes: the next band of
    slices is read ahead (each band then at most half of ``block_bytes``). ``None`` (auto):
    only when every host runs fewer tasks at once than it has cores
    (:func:`zckpt.runner.overlap_for`)."""
    scheduler: str | None = None
    progress: bool | str = False
    """Progress on stderr: ``"bars"`` (or ``True``), ``"json"`` (one JSON object per line),
    ``"off"`` (or ``False``); per task (rank) and parameter, wherever the tasks run."""
    per_stage: bool = False
    """Write one ``<prefix><r>_part<s>.ckpt`` per source pipeline stage ``s`` (MindSpore's per-stage
    conversion): the parts of a rank together hold what the single file would."""
    # --- safetensors output (zckpt.export_safetensors) ---
    format: str = "ckpt"
    """``"ckpt"`` or ``"safetensors"`` (``rank_<r>/<prefix><r>.safetensors``, MindSpore's layout)."""
    max_file_bytes: int = 0
    """safetensors only: split a rank above this size into HF-style parts + index (0: never)."""
    storage_options: Mapping[str, Any] | None = None
    """fsspec filesystem options for every URL involved (``endpoint_url``, ``key``, ...)."""

    def __post_init__(self) -> None:
        check_prefix(self.prefix)


@dataclass(frozen=True)
class PlannedStore:
    """The store a task opens itself (a Dask worker), with the identity it had when the
    export was planned: readers of a remote store hold no lock, so a store rewritten by an
    ingest meanwhile must stop the tasks that would read it, not give their files other
    data than the files written before."""

    url: str
    identity: str | None

    @classmethod
    def of(cls, store: Store) -> PlannedStore:
        return cls(store.url, store.identity())

    def open(self, storage_options: Mapping[str, Any] | None) -> Store:
        from zckpt.store import Store

        store = Store.open(self.url, storage_options=storage_options)
        if store.identity() != self.identity:
            raise StoreError("the store changed after this export was planned (rewritten by an ingest meanwhile?): "
                             "rerun the export", path=self.url)
        return store


@dataclass(frozen=True)
class ExportReport:
    out_dir: str
    ranks: tuple[RankResult, ...]
    """The files written by this run."""
    seconds: float
    kept: int = 0
    """Files of an interrupted (or complete) run of the same job found complete and kept."""

    @property
    def bytes_written(self) -> int:
        return sum(r.bytes for r in self.ranks)

    @property
    def bytes_read(self) -> int:
        """Store bytes read, data and checksum checks together (read amplification =
        ``bytes_read / bytes_written``)."""
        return sum(r.read_bytes + r.checked_bytes for r in self.ranks)


def check_prefix(prefix: object) -> None:
    """A file name prefix stays a name: no directory separators or NUL, so that
    ``--prefix '../../x_'`` cannot place files outside the output directory."""
    if not isinstance(prefix, str):
        raise UsageError(f"the file name prefix must be a str, got {type(prefix).__name__}")
    if any(c in prefix for c in ("/", "\\", "\0")):
        raise UsageError(f"file name prefix {prefix!r} must be a plain name (no '/', '\\' or NUL): the files go "
                         "into rank_<r>/ of the output directory")


def rank_file(out_dir: str | Path, rank: int, prefix: str, suffix: str = "") -> Path:
    return Path(out_dir) / f"rank_{rank}" / f"{prefix}{rank}{suffix}.ckpt"


def plan_export(
    store: Store,
    strategy: StrategyArg,
    ranks: Iterable[int] | None = None,
    storage_options: remote.StorageOptions = None,
    *,
    require_supplied: bool = False,
) -> ExportPlan:
    """The export plan; ``require_supplied`` refuses a destination strategy that lists
    parameters the store does not hold (:func:`refuse_store_unsupplied`)."""
    smap: StrategyMap | None = load_strategy(strategy, storage_options)
    plan = build_export_plan(store.specs(), smap, ranks=ranks)
    if require_supplied:
        refuse_store_unsupplied(store, plan, smap)
    return plan


def refuse_store_unsupplied(store: Store, plan: ExportPlan, smap: StrategyMap | None) -> None:
    """Fail by name when the destination ranks planned need parameters the store lacks (a
    partial pipeline source), rather than write files without them."""
    source = store.manifest.get("source") or {}
    refuse_unsupplied(needed_params(smap, (r.rank for r in plan.ranks)), (e.name for e in store.entries()),
                      left_out=source.get("left_out") or (), behind=source.get("left_behind"),
                      source=f"store {store.url}", dst=smap)


def check_coverage(store: Store, plan: ExportPlan) -> None:
    """Refuse to export from a store that lacks any region a destination rank needs, or
    whose manifest or checksum records are damaged (:meth:`Store.check_integrity`)."""
    store.check_integrity()
    if store.complete:
        return
    kinds = {e.name: e.kind for e in store.entries()}
    for rank in plan.ranks:
        for s in rank.slices:
            if kinds[s.name] == "str":
                continue
            missing = store.missing_in(s.name, s.box)
            if missing == [-1]:
                raise StoreError(
                    f"store is incomplete: destination rank {rank.rank} needs region {s.box.to_json()} that "
                    "no source shard covered",
                    path=store.path,
                    param=s.name,
                )
            if missing:
                raise StoreError(
                    f"store is incomplete: destination rank {rank.rank} needs data of source rank(s) {missing}, "
                    "which were never ingested",
                    path=store.path,
                    param=s.name,
                )


@fewer_collections()
def export(
    store_or_path: Store | str | Path,
    out_dir: str | Path,
    strategy: StrategyArg = None,
    *,
    ranks: Iterable[int] | None = None,
    options: ExportOptions = ExportOptions(),
) -> ExportReport:
    """Write ``out_dir/rank_<r>/<prefix><r>.ckpt`` for every (or each requested) destination rank."""
    if options.format != "ckpt":  # safetensors output: zckpt.export_safetensors
        from zckpt.export_safetensors import export_safetensors

        return export_safetensors(store_or_path, out_dir, strategy, ranks=ranks, options=options)
    t0 = time.perf_counter()
    with export_session(store_or_path, out_dir, strategy, ranks, options) as (store, plan, out_loc, out):
        return _export(store, plan, out_loc, out, options, t0)


@contextlib.contextmanager
def export_session(
    store_or_path: Store | str | Path, out_dir: str | Path, strategy: StrategyArg, ranks: Iterable[int] | None,
    options: ExportOptions,
) -> Iterator[tuple[Store, ExportPlan, remote.Location | None, Path]]:
    """The store (checked, held shared), its plan (covered) and the output directory (held
    exclusively) for as long as an export of any format writes: ``(store, plan, out_loc, out)``."""
    from zckpt.store import Store

    so = options.storage_options
    with reading(store_or_path):
        store = store_or_path if isinstance(store_or_path, Store) else Store.open(store_or_path, storage_options=so)
        store.check_integrity()  # before planning: a store with no manifest yet is refused as such
        plan = plan_export(store, strategy, ranks, so, require_supplied=not options.per_stage)
        check_coverage(store, plan)
        out_loc, out = output_dir(out_dir, so)
        with contextlib.nullcontext() if out_loc is not None else out_dirs.writing(out):
            yield store, plan, out_loc, out


def reading(store_or_path: Store | str | os.PathLike[str]) -> contextlib.AbstractContextManager[None]:
    """Hold a local store shared while it is read (:mod:`zckpt.locks`: an ingest cannot
    rewrite it meanwhile, and a reader is refused while one does); remote stores: nothing."""
    from zckpt.store import Store

    if isinstance(store_or_path, Store):
        local = store_or_path.path if store_or_path.location is None else None
    else:
        local = None if isinstance(store_or_path, str) and remote.is_remote(store_or_path) else \
            remote.local_path(store_or_path)
    return contextlib.nullcontext() if local is None else locks.store_reading(local)


def _export(store: Store, plan: ExportPlan, out_loc: remote.Location | None, out: Path, options: ExportOptions,
            t0: float) -> ExportReport:
    jobs = output_jobs(store, plan, out, options)
    fingerprint = export_fingerprint(store, jobs, options)
    if out_loc is not None:
        todo = resume_or_refuse_remote(out_loc, jobs, fingerprint, options.overwrite)
    else:
        todo = resume_or_refuse(out, jobs, fingerprint, options.overwrite)
    report = _write_jobs(store, todo, out_loc, out, options, t0)
    finish_output(out_loc, out, jobs, fingerprint, options.fsync)
    return replace(report, kept=len(jobs) - len(todo))


def _write_jobs(store: Store, jobs: list[tuple[RankExport, Path]], out_loc: remote.Location | None, out: Path,
                options: ExportOptions, t0: float) -> ExportReport:
    if options.reader not in ("zarr", "dask"):
        raise OutputError(f"unknown reader {options.reader!r} (zarr or dask)")
    sizes = {e.name: ms_dtype(e.ms_type).storage.itemsize for e in store.entries() if e.kind == "tensor"}
    units = [(r, target_name(out_loc, p)) for r, p in jobs]
    unit_bytes = [sum(s.box.size * sizes.get(s.name, 0) for s in r.slices) for r, _ in units]
    by_target = {t: n for (_, t), n in zip(units, unit_bytes, strict=True)}
    engine = Engine.of(options)
    options = replace(options, block_bytes=engine.share(options.block_bytes))
    if not jobs:
        return ExportReport(out_loc.url if out_loc is not None else str(out), (), time.perf_counter() - t0)
    local = store.location is None and out_loc is None
    sources = len((store.manifest.get("source") or {}).get("rank_files") or {})  # ranks the store was ingested from
    # the helper innermost: when this process fails, it is stopped before the publisher finishes
    with dask_client(engine) as client, Publisher(options.fsync) as publisher, \
            helper_for(local and client is None and len(units) > 1, options, sum(unit_bytes), sources,
                       "zckpt.export", "zckpt.store") as helper:
        options = replace(options, overlap=overlap_beside(options.overlap, client, helper))
        aside = hand_over(helper, units, unit_bytes, write_files, PlannedStore.of(store), options)
        # In this process the tasks share the parent's Store: its checksum records and chunk
        # metadata are loaded once, not once per destination file (at 512 source ranks that
        # reload was half of an export's CPU time). Cluster tasks open the store themselves.
        # They also hand their files to one publisher, which syncs each while the next is written.
        results = run_all(write_file, units, store if client is None else PlannedStore.of(store), options,
                          publisher if client is None else None, client=client,
                          label="export",
                          name=task_name,
                          size=lambda u: by_target[u[1]],
                          progress=options.progress, aside=aside)
    return ExportReport(out_loc.url if out_loc is not None else str(out), tuple(results), time.perf_counter() - t0)


def task_name(unit: tuple[RankExport, str]) -> str:
    """How progress names an export task: its rank and file (per-stage parts share a rank)."""
    return f"rank {unit[0].rank} {unit[1].rstrip('/').rsplit('/', 1)[-1]}"


def target_name(out_loc: remote.Location | None, path: Path) -> str:
    """What a task receives: a local path, or the URL of a remote file."""
    return str(path) if out_loc is None else out_loc.url_of(path.as_posix())


def write_files(units: list[tuple[RankExport, str]], store: PlannedStore, options: ExportOptions) -> list[RankResult]:
    """:func:`write_file` of several destination files with the store opened once and their
    own publisher (the helper's share of an export)."""
    opened = store.open(options.storage_options)
    with Publisher(options.fsync) as publisher:
        return [write_file(u, opened, options, publisher) for u in units]


def write_file(
    unit: tuple[RankExport, str], store: Store | PlannedStore, options: ExportOptions,
    publisher: Publisher | None = None, report: Report | None = None,
) -> RankResult:
    """Write one destination file from the store (a Dask task opens the planned store
    itself; in this process it is given the open store).

    A remote destination is written to a local temporary file first and uploaded when
    complete, so that its final name never holds a partial file."""
    rank, target = unit
    if isinstance(store, PlannedStore):
        store = store.open(options.storage_options)
    reader = StoreReader(store, options)
    reader.store.prefetch(s.name for s in rank.slices)
    ticker = Ticker(report)
    if not remote.is_remote(target):
        with disk_full_named(target):
            return reader.write_rank(rank, Path(target), ticker, publisher)
    with tempfile.TemporaryDirectory(prefix="zckpt-out-") as tmp:
        local = Path(tmp) / target.rstrip("/").rsplit("/", 1)[-1]
        result = reader.write_rank(rank, local, ticker)
        remote.upload(local, remote.locate(target, options.storage_options, OutputError), OutputError)
    return replace(result, path=target)


def export_fingerprint(store: Store, jobs: list[tuple[RankExport, Path]], options: ExportOptions) -> str:
    """Identity of an export: same store content (its layout fingerprint and, since ingest
    ids, the identity of the ingest that wrote it), same files with the same slices."""
    doc = {
        "store": store.manifest.get("fingerprint") or hashlib.sha256(
            json.dumps(store.manifest.get("entries", []), sort_keys=True).encode()).hexdigest(),
        "ingest": store.identity(),
        "files": [[str(p.name), [[s.name, s.box.to_json()] for s in r.slices]] for r, p in jobs],
        "crc": options.crc,
        "format": "ckpt",
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def output_jobs(store: Store, plan: ExportPlan, out: Path, options: ExportOptions) -> list[tuple[RankExport, Path]]:
    """The files to write: one per destination rank, or one per (rank, source stage) part."""
    return stage_jobs({e.name: e.stages for e in store.entries()}, plan, out, options)


def stage_jobs(
    stages: Mapping[str, tuple[int, ...]], plan: ExportPlan, out: Path, options: ExportOptions
) -> list[tuple[RankExport, Path]]:
    """:func:`output_jobs` given the source pipeline stages holding each entry."""
    if not options.per_stage:
        return [(r, rank_file(out, r.rank, options.prefix)) for r in plan.ranks]
    all_stages = sorted({s for v in stages.values() for s in v})
    jobs = []
    for r in plan.ranks:
        for s in all_stages:
            part = tuple(x for x in r.slices if s in stages[x.name])
            if part:
                jobs.append((RankExport(r.rank, part), rank_file(out, r.rank, options.prefix, f"_part{s}")))
    return jobs


def export_rank(
    store: Store,
    rank: int,
    target: str | Path,
    strategy: StrategyArg = None,
    *,
    options: ExportOptions = ExportOptions(),
) -> RankResult:
    """Write one destination rank to an explicit file name (``transform_checkpoint_by_rank``)."""
    with reading(store):
        store.check_integrity()
        plan = plan_export(store, strategy, [rank], require_supplied=True)
        check_coverage(store, plan)
        path = Path(target)
        if path.exists() and not options.overwrite:
            raise OutputError("output file already exists (--overwrite replaces it)", path=path)
        with disk_full_named(path):
            return StoreReader(store, options).write_rank(plan.ranks[0], path)


PACKED_GAP = 64 * 1024
"""Packed tensors of one batch at most this many bytes apart in their chunk file are read
with one call (the bytes between them are read only to be skipped)."""


class StoreReader:
    """Reads destination slices out of a store as lazy Dask arrays."""

    def __init__(self, store: Store, options: ExportOptions) -> None:
        self.store = store
        self.options = options
        self._entries = {e.name: e for e in store.entries()}
        self._lazy: dict[str, Any] = {}
        self._checked: Checked = set()
        self.band_bytes = batch_bytes(options.block_bytes, wants_overlap(options.overlap), local=store.location is None)
        """Largest batch of slices read at once (two are in flight when reading ahead)."""
        self.read_bytes = 0
        self.checked_bytes = 0
        self._rows = bytearray()
        self._sizes: dict[Path, int] = {}
        """Sizes of the chunk and shard files this task copies ranges of."""
        """Chunk rows being cut (one band is read at a time): reused, so that each tile does
        not fault in fresh memory."""

    def kind(self, name: str) -> str:
        return self._entries[name].kind

    def ms_type(self, name: str) -> str:
        return self._entries[name].ms_type

    def string(self, name: str) -> str:
        return self._entries[name].value or ""

    def map_bytes(self, name: str) -> bytes:
        return np.asarray(self.store.array(name)[...]).tobytes()

    def lazy(self, name: str) -> Any:
        """``name`` as a lazy ``dask.array`` over its Zarr array (Dask is imported only here)."""
        import dask.array as da

        if name not in self._lazy:
            self._lazy[name] = da.from_zarr(self.store.array(name))  # type: ignore[no-untyped-call]
        return self._lazy[name]

    def bands(self, name: str, box: Box) -> list[Box]:
        """The slice cut into C-order pieces of at most ``band_bytes`` (rows, or parts of a row)."""
        if box.ndim == 0 or box.size == 0 or self._packed_whole(name, box):
            return [box]
        itemsize = ms_dtype(self._entries[name].ms_type).storage.itemsize
        return c_order_pieces(box, max(1, self.band_bytes // itemsize))

    def materialise(self, items: list[tuple[str, Box]]) -> list[np.ndarray]:
        """Read a batch of slices: raw chunk files directly, else concurrent Zarr reads, or
        one Dask computation of lazy views. Every chunk used is checked against its recorded
        checksum first (a chunk read whole is checked on the bytes just read)."""
        verify = self.options.verify_checksums
        if self.options.reader == "zarr":
            packed_ones = self._read_packed(items)
            direct = [packed_ones[i] if i in packed_ones else self._read_raw(name, box)
                      for i, (name, box) in enumerate(items)]
            rest = [(name, box) for (name, box), got in zip(items, direct, strict=True) if got is None]
            if verify:
                for name, box in rest:
                    self.checked_bytes += self.store.verify_chunks(name, box, self._checked)
            fetched = iter(self.store.read_many([(name, box.slices()) for name, box in rest]))
            result = [got if got is not None else next(fetched) for got in direct]
            self.read_bytes += sum(a.nbytes for a in result)
            return result
        if verify:
            for name, box in items:
                self.checked_bytes += self.store.verify_chunks(name, box, self._checked)
        lazy = [self.lazy(name)[box.slices()] if box.ndim else self.lazy(name) for name, box in items]
        import dask

        computed = dask.compute(*lazy, scheduler=self.options.dask_scheduler)  # type: ignore[attr-defined,no-untyped-call]
        arrays = [np.asarray(x) for x in computed]
        self.read_bytes += sum(a.nbytes for a in arrays)
        return arrays

    def _packed_whole(self, name: str, box: Box) -> bool:
        """Whether the slice is a whole packed tensor (:mod:`zckpt.packed`): such tensors
        are read together, many per call, instead of one file range each."""
        e = self._entries[name]
        return e.offset is not None and box.stop == e.shape and not any(box.start)

    def _read_packed(self, items: list[tuple[str, Box]]) -> dict[int, np.ndarray]:
        """The whole packed tensors of a batch (by position in ``items``): those that lie
        close together in one packed chunk file are read with one call and checked once per
        recorded block; each tensor is a view of the bytes read. A 100 000-tensor shard is
        then a few hundred reads, not 100 000 copies."""
        found: list[tuple[Path, str, int, int, int, int]] = []
        for i, (name, box) in enumerate(items):
            # a run's records cover its neighbours too: stores with a record per tensor read each alone
            if self._packed_whole(name, box) and box.size and self.store.record_owner(name) != name:
                info = self.store.chunk_info(name)
                if info.at is not None and info.folder is not None:
                    found.append((info.folder, info.at[0], info.at[1], info.inner_bytes, info.at[2], i))
        found.sort(key=lambda p: (str(p[0]), p[1], p[2]))
        out: dict[int, np.ndarray] = {}
        group: list[tuple[Path, str, int, int, int, int]] = []
        for place in [*found, None]:
            if (place is not None and group and place[:2] == group[-1][:2]
                    and place[2] - (group[-1][2] + group[-1][3]) <= PACKED_GAP):
                group.append(place)
                continue
            if group:
                self._read_packed_run(items, group, out)
            group = [place] if place is not None else []
        return out

    def _read_packed_run(self, items: list[tuple[str, Box]], group: list[tuple[Path, str, int, int, int, int]],
                         out: dict[int, np.ndarray]) -> None:
        folder, key, start, _, file_bytes, first = group[0]
        stop = max(at + n for _, _, at, n, _, _ in group)
        raw = np.empty(stop - start, dtype=np.uint8)
        self._read_span(items[first][0], _Span(key, folder / key, start, stop - start, file_bytes), raw)
        self.checked_bytes += raw.nbytes - sum(n for _, _, _, n, _, _ in group)
        for _, _, at, n, _, i in group:
            name, box = items[i]
            dtype = ms_dtype(self._entries[name].ms_type).storage
            out[i] = raw[at - start : at - start + n].view(dtype).reshape(box.shape)

    def _read_raw(self, name: str, box: Box) -> np.ndarray | None:
        """Read a slice straight from raw chunk (or shard) files when chunks span the array's
        full width: each chunk then holds whole rows, so the slice's rows are one byte range
        per chunk, and chunks that follow each other in a shard one range together.
        ``None`` when that does not hold (zarr reads it instead)."""
        arr = self.store.chunk_info(name)
        if box.size == 0 or not arr.raw:
            return None
        dtype = ms_dtype(self._entries[name].ms_type).storage
        if tuple(arr.chunks[1:]) != tuple(arr.shape[1:]):
            return self._read_tiles(name, box, dtype)
        if box.ndim == 0:
            spans = self._row_spans(name, box, dtype.itemsize)
            if spans is None:
                return None
            out = np.empty((), dtype=dtype)
            self._read_spans(name, spans, out.reshape(-1).view(np.uint8))
            return out
        spans = self._row_spans(name, Box((box.start[0], *([0] * (box.ndim - 1))), (box.stop[0], *arr.shape[1:])),
                                dtype.itemsize)
        if spans is None:
            return None
        out = np.empty((box.shape[0],) + tuple(arr.shape[1:]), dtype=dtype)
        self._read_spans(name, spans, out.reshape(-1).view(np.uint8))
        if box.shape[1:] == tuple(arr.shape[1:]):
            return out
        self.checked_bytes += out.nbytes - box.size * dtype.itemsize
        return np.ascontiguousarray(out[(slice(None),) + box.slices()[1:]])

    def _row_spans(self, name: str, box: Box, itemsize: int) -> list[_Span] | None:
        """The byte ranges holding ``box``, whose trailing dimensions are exactly one chunk
        column: per chunk along dimension 0 the rows ``box`` takes, merged where they follow
        each other in one file. ``None`` when chunks are not raw local files."""
        info = self.store.chunk_info(name)
        if box.ndim == 0:
            at = self.store.chunk_at(name, ())
            return None if at is None else [_Span(at[0], at[1], at[2], itemsize, at[3])]
        rows = info.chunks[0]
        row_bytes = math.prod(info.chunks[1:]) * itemsize
        column = tuple(s // c for s, c in zip(box.start[1:], info.chunks[1:], strict=True))
        spans: list[_Span] = []
        first, stop = box.start[0], box.stop[0]
        for k in range(first // rows, (stop - 1) // rows + 1):
            at = self.store.chunk_at(name, (k, *column))
            if at is None:
                return None
            lo, hi = max(first, k * rows), min(stop, (k + 1) * rows)
            offset, length = at[2] + (lo - k * rows) * row_bytes, (hi - lo) * row_bytes
            last = spans[-1] if spans else None
            if last is not None and last.path == at[1] and last.offset + last.length == offset:
                spans[-1] = last._replace(length=last.length + length)  # the next chunk of the same shard
            else:
                spans.append(_Span(at[0], at[1], offset, length, at[3]))
        return spans

    def _read_spans(self, name: str, spans: list[_Span], dest: np.ndarray) -> None:
        """Fill ``dest`` (bytes) with ``spans`` one after another, each read with one call
        and checked on the bytes read."""
        pos = 0
        for sp in spans:
            self._read_span(name, sp, dest[pos : pos + sp.length])
            pos += sp.length
        if pos != len(dest):
            raise AssertionError(f"{name}: spans cover {pos} of {len(dest)} bytes")

    def _read_span(self, name: str, sp: _Span, dest: np.ndarray) -> None:
        with self._open_chunk(name, sp.key, sp.path, sp.file_bytes) as f:
            got = os.preadv(f.fileno(), [dest.data], sp.offset)
        if got != sp.length:
            raise StoreError(f"chunk {sp.key} ended early: the store is damaged", path=sp.path, param=name)
        check = self._span_check(name, sp.key, sp.path, sp.file_bytes, sp.offset, sp.length)
        if check is not None:
            check(sp.offset, dest.data)

    def _read_tiles(self, name: str, box: Box, dtype: np.dtype) -> np.ndarray | None:
        """Read a slice from raw chunks of any shape: from each chunk, the rows the slice
        touches (one range; ranges that follow each other in a shard file are read as one)
        are read and checked, and the slice's part of them copied."""
        info = self.store.chunk_info(name)
        out = np.empty(box.shape, dtype=dtype)
        row_bytes = math.prod(info.chunks[1:]) * dtype.itemsize
        parts: list[tuple[_Span, Box, tuple[int, ...]]] = []
        for t in tiles(box, info.chunks):
            coords = tuple(a // c for a, c in zip(t.start, info.chunks, strict=True))
            at = self.store.chunk_at(name, coords)
            if at is None:
                return None
            origin = tuple(c * k for c, k in zip(coords, info.chunks, strict=True))
            r0, r1 = t.start[0] - origin[0], t.stop[0] - origin[0]
            parts.append((_Span(at[0], at[1], at[2] + r0 * row_bytes, (r1 - r0) * row_bytes, at[3]), t, origin))
        group: list[tuple[_Span, Box, tuple[int, ...]]] = []
        for part in [*parts, None]:
            if part is not None and group and _follows(group[-1][0], part[0]):
                group.append(part)
                continue
            if group:
                self._cut_group(name, group, box, out, info.chunks, dtype)
            group = [part] if part is not None else []
        return out

    def _cut_group(self, name: str, group: list[tuple[_Span, Box, tuple[int, ...]]], box: Box, out: np.ndarray,
                   chunks: tuple[int, ...], dtype: np.dtype) -> None:
        """Read chunk rows that follow each other in one file with one call, then copy each
        tile's part of its chunk rows into ``out``."""
        first = group[0][0]
        whole = _Span(first.key, first.path, first.offset, sum(sp.length for sp, _, _ in group), first.file_bytes)
        raw = self._scratch_rows((whole.length,), np.dtype(np.uint8))
        self._read_span(name, whole, raw)
        pos = 0
        for sp, t, origin in group:
            rows = raw[pos : pos + sp.length].view(dtype).reshape((t.stop[0] - t.start[0], *chunks[1:]))
            pos += sp.length
            self.checked_bytes += rows.nbytes - t.size * dtype.itemsize
            local = tuple(slice(a - o, b - o) for a, b, o in zip(t.start[1:], t.stop[1:], origin[1:], strict=True))
            out[t.relative_to(box).slices()] = rows[(slice(None), *local)]

    def _scratch_rows(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = math.prod(shape) * dtype.itemsize
        if len(self._rows) < nbytes:
            self._rows = bytearray(nbytes)
        return np.frombuffer(self._rows, dtype=np.uint8, count=nbytes).view(dtype).reshape(shape)

    @staticmethod
    def _open_chunk(name: str, key: str, path: Path, chunk_bytes: int) -> BinaryIO:
        """A raw chunk (or shard) file, open for reading, refused by name when missing or of
        the wrong size."""
        try:
            f = safe_paths.open_binary(path, StoreError, name)
        except FileNotFoundError:
            raise _chunk_missing(name, key, path) from None
        try:
            _check_chunk_size(name, key, path, os.fstat(f.fileno()).st_size, chunk_bytes)
        except StoreError:
            f.close()
            raise
        return f

    def _span_check(self, name: str, key: str, path: Path, file_bytes: int, offset: int,
                    length: int) -> Sink | None:
        """How the bytes ``[offset, offset + length)`` of a chunk or shard file are checked as
        they are read or copied: a :class:`SpanCheck` over the recorded blocks they touch of
        each record (a chunk's, or the runs of a shard the range crosses), fed as one sink
        (``None`` when checks are off, nothing is recorded or those blocks were checked
        already). The parts of edge blocks outside the range count as read only to check."""
        if not self.options.verify_checksums:
            return None
        checks = []
        owner = self.store.record_owner(name)  # packed tensors share their run's blocks
        for rkey, want in self.store.records_over(name, key, offset, offset + length):
            part = want.covers(offset, offset + length)
            if part is None:
                continue
            size = want.length if want.length is not None else file_bytes
            blocks = want.blocks_in(part[0], part[1], size)
            if all((owner, rkey, i) in self._checked for i in blocks):
                continue
            self._checked.update((owner, rkey, i) for i in blocks)  # a failure aborts this file

            def fail(bad: Mismatch, want: ChunkSums = want) -> StoreError:
                return StoreError(f"chunk {key} fails its checksum ({want.where()}{bad}): the store is damaged",
                                  path=path, param=name)

            check = SpanCheck(path, want, size, part[0], part[1] - part[0], fail, base=want.origin)
            self.checked_bytes += check.extra
            checks.append(check)
        if not checks:
            return None
        return SpanChecks(checks).feed

    def _block_checks(self, name: str, key: str, path: Path, file_bytes: int, offset: int,
                      length: int) -> tuple[BlockCheck, ...]:
        """The checks of the recorded blocks that bytes ``[offset, offset + length)`` of a
        chunk or shard file touch, leaving out blocks this task checked already (at either
        end of the range: ranges that follow each other share their edge blocks), to run
        once the writer has copied the range. The parts of those blocks outside the range
        count as read only to check."""
        if not self.options.verify_checksums:
            return ()
        done = self._checked
        stop = offset + length
        parts = []
        for rkey, want in self.store.records_over(name, key, offset, stop):
            part = want.covers(offset, stop)
            if part is None:
                continue
            size = want.length if want.length is not None else file_bytes
            blocks = want.blocks_in(part[0], part[1], size)
            first, end = blocks.start, blocks.stop
            while first < end and (name, rkey, first) in done:
                first += 1
            while end > first and (name, rkey, end - 1) in done:
                end -= 1
            if first == end:
                continue
            done.update((name, rkey, i) for i in range(first, end))  # a failure aborts this file
            b = want.block_size(size)
            self.checked_bytes += max(0, part[0] - first * b) + max(0, min(size, end * b) - part[1])
            parts.append((want, size, first, end))
        if not parts:
            return ()

        def fail(want: ChunkSums, bad: Mismatch) -> StoreError:
            return StoreError(f"chunk {key} fails its checksum ({want.where()}{bad}): the store is damaged",
                              path=path, param=name)

        return (BlockCheck(path, tuple(parts), fail),)

    def file_ranges(self, name: str, box: Box) -> list[FileRange] | None:
        """The slice as byte ranges of raw chunk or shard files, when it is one: its
        trailing dimensions are exactly one chunk's (whole rows of the array, or one column
        block of a tensor-parallel split stored as its own chunks), so its rows are
        contiguous in each chunk, and chunks that follow each other in a shard give one
        range. The writer then copies them file to file, checking the blocks they cover in
        the same pass."""
        if self.options.reader != "zarr" or box.size == 0 or self._packed_whole(name, box):
            return None  # a whole packed tensor is read with its neighbours (_read_packed)
        arr = self.store.chunk_info(name)
        if not arr.raw or not _one_chunk_column(box, arr.chunks):
            return None
        spans = self._row_spans(name, box, ms_dtype(self._entries[name].ms_type).storage.itemsize)
        if spans is None:
            return None
        out = []
        for sp in spans:
            size = self._sizes.get(sp.path)
            if size is None:  # once per shard file, not per range (a shard gives a file hundreds)
                size = safe_paths.regular_size(sp.path, StoreError, name)  # the writer opens it by name
                if size is None:
                    raise _chunk_missing(name, sp.key, sp.path)
                self._sizes[sp.path] = size
            _check_chunk_size(name, sp.key, sp.path, size, sp.file_bytes)
            checks = (_StoreCheck(self, name, sp),) if self.options.verify_checksums else ()
            out.append(FileRange(sp.path, sp.offset, sp.length, None, checks))
        self.read_bytes += sum(r.length for r in out)
        return out

    def write_rank(self, rank: RankExport, target: Path, ticker: Ticker | None = None,
                   publisher: Publisher | None = None) -> RankResult:
        return write_ckpt_rank(self, rank, target, crc=self.options.crc, fsync=self.options.fsync,
                               overlap=self.options.overlap, ticker=ticker, publisher=publisher)


class _Span(NamedTuple):
    """``length`` bytes at ``offset`` of the chunk or shard file ``path`` (key ``key``,
    ``file_bytes`` long when intact). A tuple: a 512-rank export makes tens of thousands."""

    key: str
    path: Path
    offset: int
    length: int
    file_bytes: int


@dataclass(frozen=True)
class _StoreCheck:
    """The checks of one copied range, worked out when the writer copies it (it reads the
    range's bytes through the blocks these checks read: :meth:`CkptWriter._copy_range`).
    Checks run in the order of the ranges, so blocks shared by ranges that follow each
    other are checked once."""

    reader: StoreReader
    name: str
    span: _Span

    @property
    def nbytes(self) -> int:
        return self.span.length

    def run(self, read_at: ReadAt) -> None:
        sp = self.span
        for check in self.reader._block_checks(self.name, sp.key, sp.path, sp.file_bytes, sp.offset, sp.length):
            check.run(read_at)


def _follows(a: _Span, b: _Span) -> bool:
    return a.path == b.path and a.offset + a.length == b.offset


def _chunk_missing(name: str, key: str, path: Path) -> StoreError:
    return StoreError(f"chunk {key} is missing: the store is damaged", path=path, param=name)


def _check_chunk_size(name: str, key: str, path: Path, size: int, chunk_bytes: int) -> None:
    """A raw chunk file holds exactly its chunk's values (a shard file its inner chunks and
    index); any other size means damage."""
    if size != chunk_bytes:
        raise StoreError(f"chunk {key} holds {size} bytes, not the {chunk_bytes} of its values: "
                         "the store is damaged", path=path, param=name)


def _one_chunk_column(box: Box, chunks: tuple[int, ...]) -> bool:
    """Whether ``box`` spans exactly one chunk in every dimension but the first (chunks
    are stored full size, edge chunks padded, so a narrower box would not be contiguous)."""
    return all(
        b - a == c and a % c == 0 for a, b, c in zip(box.start[1:], box.stop[1:], chunks[1:], strict=True)
    )
