"""What an export is, whatever format it writes: its options, its plan, the files it
writes, its identity and its report.

:func:`export_session` holds the store and the output directory for as long as an export
writes; :func:`output_jobs` names its files (one per destination rank, or per source
stage); :func:`export_fingerprint` identifies it, so that a rerun keeps what a previous run
completed. The ``.ckpt`` export (:mod:`zckpt.export`) and the safetensors export
(:mod:`zckpt.jobs.export`) are both built on these.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import marshal
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zckpt.core.errors import StoreError, UsageError
from zckpt.formats.strategy import StrategyMap
from zckpt.io import remote
from zckpt.io.read_ahead import read_soon
from zckpt.plan.export_plan import build_export_plan
from zckpt.plan.values import ExportPlan, RankExport
from zckpt.run.engines import Engine
from zckpt.sources.partial_inputs import needed_params, refuse_unsupplied
from zckpt.sources.strategies import StrategyArg, load_strategy
from zckpt.store.reader import check_coverage, reading
from zckpt.store.store import Store
from zckpt.write.boxes import RankResult
from zckpt.write.destinations import OutputDir, output_dir

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
    second process (:mod:`zckpt.run.helper`) while this one writes the others. ``None`` (auto):
    from :data:`zckpt.run.helper.HELPER_BYTES` on, with a core to spare and no Dask cluster."""
    overlap: bool | None = None
    """Each task reads and checks on a second thread while it writes: the next band of
    slices is read ahead (the batches written and read ahead together within ``block_bytes``:
    :func:`zckpt.write.boxes.batch_bytes`). ``None`` (auto):
    only when every host runs fewer tasks at once than it has cores
    (:func:`zckpt.run.engines.overlap_for`)."""
    scheduler: str | None = None
    progress: bool | str = False
    """Progress on stderr: ``"bars"`` (or ``True``), ``"json"`` (one JSON object per line),
    ``"off"`` (or ``False``); per task (rank) and parameter, wherever the tasks run."""
    per_stage: bool = False
    """Write one ``<prefix><r>_part<s>.ckpt`` per source pipeline stage ``s`` (MindSpore's per-stage
    conversion): the parts of a rank together hold what the single file would."""
    # --- safetensors output (zckpt.jobs.export) ---
    format: str = "ckpt"
    """``"ckpt"``, ``"safetensors"`` (``rank_<r>/<prefix><r>.safetensors``, MindSpore's layout) or
    ``"mindformers"`` (an ``iteration_XXXXXXXX/`` directory, :mod:`zckpt.write.mindformers_dir`)."""
    max_file_bytes: int = 0
    """safetensors only: split a rank above this size into HF-style parts + index (0: never)."""
    storage_options: Mapping[str, Any] | None = None
    """fsspec filesystem options for every URL involved (``endpoint_url``, ``key``, ...)."""
    # --- MindFormers output (format "mindformers") ---
    iteration: int | None = None
    """The iteration directory to write (default: the source's iteration, else its ``global_step``, else 0)."""
    remove_redundancy: bool = False
    """Save each piece once (MindFormers' ``save_remove_redundancy``), by the rank its balancing picks."""

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


@contextlib.contextmanager
def export_session(
    store_or_path: Store | str | Path, out_dir: str | Path, strategy: StrategyArg, ranks: Iterable[int] | None,
    options: ExportOptions,
) -> Iterator[tuple[Store, ExportPlan, OutputDir]]:
    """The store (checked, held shared), its plan (covered) and the output directory (held
    while the export writes it) for as long as an export of any format writes: ``(store, plan, dest)``."""

    so = options.storage_options
    with reading(store_or_path):
        store = store_or_path if isinstance(store_or_path, Store) else Store.open(store_or_path, storage_options=so)
        store.check_integrity()  # before planning: a store with no manifest yet is refused as such
        plan = plan_export(store, strategy, ranks, so, require_supplied=not options.per_stage)
        check_coverage(store, plan)
        dest = output_dir(out_dir, so)
        with dest.holding():
            yield store, plan, dest


def read_store_ahead(store: Store, plan: ExportPlan, ranks: Sequence[RankExport], options: ExportOptions) -> None:
    """Start reading every store file of the tensors written, in their order
    (:func:`zckpt.io.read_ahead.read_soon`: when they fit its share of memory), where ``ranks``
    are every rank of the destination (together they need every byte of those files) and the
    tasks run on this machine (in this process, a helper process or a LocalCluster: one page
    cache). Fewer ranks may need a thin band of each file (a column split): they read what
    they need, no more. Read and written at once, this VM's disk moved about 800 MiB/s each
    way, busy 55-70%; read first (as ``cp`` does) it read 2.5-2.8 GiB/s, then wrote 2.0-2.3
    GiB/s: a tp8xdp2 -> tp2xdp4 export of 2 GiB took 2.15-2.38 s against 2.76-3.70 s
    (alternating, cold)."""
    if store.location is None and Engine.of(options).scheduler is None \
            and len(ranks) == len(plan.ranks) == plan.device_num:
        read_soon(store.files_of(dict.fromkeys(s.name for r in ranks for s in r.slices)))


def task_name(unit: tuple[RankExport, str]) -> str:
    """How progress names an export task: its rank and file (per-stage parts share a rank)."""
    return f"rank {unit[0].rank} {unit[1].rstrip('/').rsplit('/', 1)[-1]}"


def export_fingerprint(store: Store, jobs: list[tuple[RankExport, Path]], options: ExportOptions) -> str:
    """Identity of an export: same store content (its layout fingerprint and, since ingest
    ids, the identity of the ingest that wrote it), same files with the same slices."""
    doc = {
        "store": store.manifest.get("fingerprint") or hashlib.sha256(
            json.dumps(store.manifest.get("entries", []), sort_keys=True).encode()).hexdigest(),
        "ingest": store.identity(),
        "files": files_digest(jobs),
        "crc": options.crc,
        "format": "ckpt",
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def files_digest(jobs: Sequence[tuple[RankExport, Path]]) -> str:
    """A digest of the files to write and each one's slices (name and box). ``marshal``'s
    version 2 encodes values alone (no references to objects met before), so equal plans
    give equal bytes; at 512 ranks it takes 0.03 s where JSON took 0.5 s."""
    h = hashlib.sha256()
    for r, p in jobs:
        h.update(marshal.dumps((p.name, [(s.name, s.box.start, s.box.stop) for s in r.slices]), 2))
    return h.hexdigest()


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
