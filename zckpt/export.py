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
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zckpt import out_dirs, remote
from zckpt.collect import fewer_collections
from zckpt.dtypes import ms_dtype
from zckpt.errors import OutputError, StoreError, UsageError
from zckpt.fileio import Publisher, disk_full_named
from zckpt.formats.strategy import StrategyMap
from zckpt.helper import hand_over, helper_for, overlap_beside
from zckpt.out_dirs import finish_output, output_dir, resume_or_refuse, resume_or_refuse_remote
from zckpt.partial_inputs import needed_params, refuse_unsupplied
from zckpt.plan import ExportPlan, RankExport, build_export_plan
from zckpt.progress import Report, Ticker
from zckpt.rank_writer import RankResult
from zckpt.runner import Engine, dask_client, run_all
from zckpt.store_reader import StoreReader, check_coverage, reading
from zckpt.strategies import StrategyArg, load_strategy

if TYPE_CHECKING:  # imported where used: the direct path shares this module's options and never needs Zarr
    from zckpt.store import Store

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
