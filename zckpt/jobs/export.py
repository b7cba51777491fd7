"""Export: materialise each destination rank's slices from the store into ``.ckpt`` or
``.safetensors`` files.

Each destination rank is one Dask task (ranks run in parallel with ``workers``). Inside a
rank, slices are cut into bands of at most ``block_bytes`` and materialised batch by batch,
then streamed into the rank's file, which is written under a temporary name and renamed
only when complete. Two readers materialise a batch: ``"zarr"`` (default) issues the whole
batch as concurrent Zarr reads in one event-loop round trip; ``"dask"`` builds each slice as
a lazy ``dask.array`` view of the Zarr array and computes the batch with Dask. Both give the
same bytes; the Zarr reader avoids Dask's per-chunk task overhead (about 4x faster on
models with hundreds of small tensors, see bench/RESULTS.md).

Safetensors outputs (:func:`export_safetensors`) are written by the safetensors rank writer
(:mod:`zckpt.write.safetensors_rank`: one file, or HF-style parts and an index), after their
own refusals (MapParameter entries, outputs present already); each task publishes its rank's
files through its destination (a remote rank's files are uploaded as they are written,
parts before the index, each visible once complete). MindSpore's own safetensors jobs use this
layout, so the files load with ``mindspore.load_checkpoint(f, format="safetensors")`` and
with any safetensors reader.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import OutputError, UsageError
from zckpt.io.fileio import Publisher, disk_full_named
from zckpt.io.new_files import Opener, local
from zckpt.jobs.export_job import (
    ExportOptions,
    ExportReport,
    PlannedStore,
    export_fingerprint,
    export_session,
    output_jobs,
    plan_export,
    read_store_ahead,
    task_name,
)
from zckpt.plan.values import ExportPlan, RankExport
from zckpt.run.choose import placement
from zckpt.run.collect import fewer_collections
from zckpt.run.engines import travelling
from zckpt.run.progress import Report, Ticker
from zckpt.sources.strategies import StrategyArg, load_strategy
from zckpt.store.reader import StoreReader, check_coverage, reading
from zckpt.write.boxes import RankResult
from zckpt.write.destinations import OutputDir, output_file, refuse_present
from zckpt.write.mindformers_dir import build_iteration, common_document, published
from zckpt.write.safetensors_file import SUFFIX, no_safetensors_form
from zckpt.write.writers import group_writer, rank_writer, source_major, write_rank

if TYPE_CHECKING:  # imported where used: importing this module does not load Zarr
    from zckpt.store.store import Store


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
    store_or_path, out_dir = travelling(store_or_path, options.scheduler), travelling(out_dir, options.scheduler)
    if options.format == "mindformers":
        if ranks is not None:
            raise UsageError("a MindFormers iteration holds every destination rank: --rank does not apply")
        return export_iteration(store_or_path, out_dir, strategy, options=options)
    if options.format != "ckpt":  # safetensors output: export_safetensors below
        return export_safetensors(store_or_path, out_dir, strategy, ranks=ranks, options=options)
    t0 = time.perf_counter()
    with export_session(store_or_path, out_dir, strategy, ranks, options) as (store, plan, dest):
        return _export(store, plan, dest, options, t0)


def _export(store: Store, plan: ExportPlan, dest: OutputDir, options: ExportOptions, t0: float) -> ExportReport:
    jobs = output_jobs(store, plan, dest.path, options)
    fingerprint = export_fingerprint(store, jobs, options)
    todo = dest.resume_or_refuse(jobs, fingerprint, options.overwrite)
    report = _write_jobs(store, todo, dest, options, t0, plan)
    dest.finish(jobs, fingerprint, options.fsync)
    return replace(report, kept=len(jobs) - len(todo))


def export_iteration(store_or_path: Store | str | Path, out_dir: str | Path, strategy: StrategyArg = None, *,
                     options: ExportOptions = ExportOptions(format="mindformers")) -> ExportReport:
    """A MindFormers iteration directory (:mod:`zckpt.write.mindformers_dir`) for every destination rank."""
    t0 = time.perf_counter()
    if options.per_stage:
        raise UsageError("--per-stage has no MindFormers form: an iteration holds every rank's files")
    with export_session(store_or_path, out_dir, strategy, None, options) as (store, plan, dest):
        if not dest.local:
            raise UsageError("a MindFormers iteration is written to a local directory", path=dest.url)
        specs = {t.name: t for t in store.specs()}
        rank_files = (store.manifest.get("source") or {}).get("rank_files") or {}
        sources = [f.get("path", "") if isinstance(f, dict) else str(f) for f in rank_files.values()]
        report, final = build_iteration(dest.path, plan.ranks, specs, load_strategy(strategy, options.storage_options),
                                        common_document(StoreReader(store, options), specs), sources, options,
                                        lambda jobs: _write_jobs(store, jobs, dest, options, t0, plan))
    return replace(report, out_dir=str(final), ranks=published(report.ranks, final))


def _write_jobs(store: Store, jobs: list[tuple[RankExport, Path]], dest: OutputDir, options: ExportOptions,
                t0: float, plan: ExportPlan) -> ExportReport:
    if options.reader not in ("zarr", "dask"):
        raise OutputError(f"unknown reader {options.reader!r} (zarr or dask)")
    sizes = {e.name: ms_dtype(e.ms_type).storage.itemsize for e in store.entries() if e.kind == "tensor"}
    units = [(r, dest.target(p)) for r, p in jobs]
    unit_bytes = [sum(s.box.size * sizes.get(s.name, 0) for s in r.slices) for r, _ in units]
    by_target = {t: n for (_, t), n in zip(units, unit_bytes, strict=True)}
    if not jobs:
        return ExportReport(dest.url, (), time.perf_counter() - t0)
    read_store_ahead(store, plan, [r for r, _ in units], options)
    local = store.location is None and dest.local
    sources = len((store.manifest.get("source") or {}).get("rank_files") or {})  # ranks the store was ingested from
    # the source ranks only: a second process did not pay where many destination files come from
    # few sources (16 -> 512 ranks, 2 GiB, cold: 6.19 -> 6.48 s; transform: 8.58 -> 7.34 s)
    with placement(options, helper_possible=local and len(units) > 1, nbytes=sum(unit_bytes), ranks=sources,
                   modules=("zckpt.jobs.export", "zckpt.store.store"), fsync=options.fsync) as place, \
            place.running() as client:
        options = replace(options, block_bytes=place.share(options.block_bytes), overlap=place.overlap())
        planned = PlannedStore.of(store)
        # In this process the tasks share the parent's Store: its checksum records and chunk
        # metadata are loaded once, not once per destination file (at 512 source ranks that
        # reload was half of an export's CPU time). Cluster tasks open the store themselves.
        # They also hand their files to one publisher, which syncs each while the next is written.
        shared = store if client is None else planned
        publisher = place.publisher if client is None else None
        cut = source_major(StoreReader(store, options), [r for r, _ in units], options, place.tasks()) \
            if local else None
        if cut is not None:
            batches = [[units[i] for i in g] for g in cut]
            batch_bytes = [sum(by_target[t] for _, t in b) for b in batches]
            helped = place.hand_over(batches, batch_bytes, write_groups, planned, options)
            options = replace(options, overlap=place.overlap(helped is not None))
            done = place.run(write_group, batches, shared, options, publisher, label="export",
                             name=lambda b: f"ranks {b[0][0].rank}-{b[-1][0].rank}", progress=options.progress,
                             size=lambda b: sum(by_target[t] for _, t in b), aside=helped)
            return ExportReport(dest.url, tuple(r for rs in done for r in rs), time.perf_counter() - t0)
        aside = place.hand_over(units, unit_bytes, write_files, planned, options)
        options = replace(options, overlap=place.overlap(aside is not None))
        results = place.run(write_file, units, shared, options, publisher, label="export", name=task_name,
                            size=lambda u: by_target[u[1]], progress=options.progress, aside=aside)
    return ExportReport(dest.url, tuple(results), time.perf_counter() - t0)


def write_groups(batches: list[list[tuple[RankExport, str]]], store: PlannedStore,
                 options: ExportOptions) -> list[list[RankResult]]:
    """:func:`write_group` of several groups with the store opened once and their own
    publisher (the helper's share of a source-major export)."""
    opened = store.open(options.storage_options)
    with Publisher(options.fsync) as publisher:
        return [write_group(b, opened, options, publisher) for b in batches]


def write_group(batch: list[tuple[RankExport, str]], store: Store | PlannedStore, options: ExportOptions,
                publisher: Publisher | None = None, report: Report | None = None) -> list[RankResult]:
    """Write a group of destination files from one pass over the store (a task)."""
    if isinstance(store, PlannedStore):
        store = store.open(options.storage_options)
    reader = StoreReader(store, options)
    store.prefetch(dict.fromkeys(s.name for r, _ in batch for s in r.slices))
    return group_writer(options).write(reader, [(r, Path(t)) for r, t in batch], Ticker(report), publisher)


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
    itself; in this process it is given the open store), published as its destination
    publishes a file (:func:`zckpt.write.destinations.output_file`)."""
    rank, target = unit
    if isinstance(store, PlannedStore):
        store = store.open(options.storage_options)
    reader = StoreReader(store, options)
    reader.store.prefetch(s.name for s in rank.slices)
    return write_rank(output_file(target, options.storage_options), reader, rank, options, Ticker(report), publisher)


def export_rank(
    store: Store,
    rank: int,
    target: str | Path,
    strategy: StrategyArg = None,
    *,
    options: ExportOptions = ExportOptions(),
    files: Opener = local,
) -> RankResult:
    """Write one destination rank to an explicit file name (``transform_checkpoint_by_rank``),
    each new file opened by ``files``."""
    with reading(store):
        store.check_integrity()
        plan = plan_export(store, strategy, [rank], require_supplied=True)
        check_coverage(store, plan)
        path = Path(target)
        if path.exists() and not options.overwrite:
            raise OutputError("output file already exists (--overwrite replaces it)", path=path)
        with disk_full_named(path):
            return rank_writer(options).write(StoreReader(store, options), plan.ranks[0], path, files=files)


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
    store_or_path, out_dir = travelling(store_or_path, options.scheduler), travelling(out_dir, options.scheduler)
    t0 = time.perf_counter()
    with export_session(store_or_path, out_dir, strategy, ranks, options) as (store, plan, dest):
        return _export_safetensors(store, plan, dest, options, t0)


def _export_safetensors(store: Store, plan: ExportPlan, dest: OutputDir, options: ExportOptions,
                        t0: float) -> ExportReport:
    kinds = {e.name: e.kind for e in store.entries()}
    for r in plan.ranks:
        for s in r.slices:
            if kinds[s.name] == "map":
                raise no_safetensors_form(s.name, "export this store as .ckpt")
    jobs = [(r, p.with_suffix(SUFFIX)) for r, p in output_jobs(store, plan, dest.path, options)]
    fingerprint = safetensors_fingerprint(export_fingerprint(store, jobs, options), options)
    if not options.overwrite:
        clash = dest.present(jobs)
        if clash and dest.finished_as_recorded(fingerprint):
            return ExportReport(dest.url, (), time.perf_counter() - t0, kept=len(jobs))  # complete: left as it is
        refuse_present(clash)
    dest.make_folders(p for _, p in jobs)
    sizes = {e.name: ms_dtype(e.ms_type).storage.itemsize for e in store.entries() if e.kind == "tensor"}
    units = [(r, dest.target(p)) for r, p in jobs]
    nbytes = {t: sum(s.box.size * sizes.get(s.name, 0) for s in r.slices) for r, t in units}
    read_store_ahead(store, plan, [r for r, _ in units], options)
    with placement(options) as place, place.running():
        options = replace(options, block_bytes=place.share(options.block_bytes), overlap=place.overlap())
        cut = source_major(StoreReader(store, options), [r for r, _ in units], options, place.tasks()) \
            if store.location is None and dest.local else None
        if cut is not None:
            done = place.run(write_group, [[units[i] for i in g] for g in cut], PlannedStore.of(store), options,
                             label="export", progress=options.progress,
                             name=lambda b: f"ranks {b[0][0].rank}-{b[-1][0].rank}",
                             size=lambda b: sum(nbytes[t] for _, t in b))
            results = [r for rs in done for r in rs]
        else:
            results = place.run(write_safetensors_file, units, PlannedStore.of(store), options, label="export",
                                progress=options.progress, name=task_name, size=lambda u: nbytes[u[1]])
    dest.remember_all(fingerprint)
    return ExportReport(dest.url, tuple(results), time.perf_counter() - t0)


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
    return write_rank(output_file(target, options.storage_options), reader, rank, options, Ticker(report))
