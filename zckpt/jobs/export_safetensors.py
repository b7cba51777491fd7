"""Export to safetensors: each destination rank as ``rank_<r>/<prefix><r>.safetensors``.

The export job around the safetensors rank writer (:mod:`zckpt.write.safetensors_rank`, which
holds the layout: one file, or HF-style parts and an index): the refusals before a file is
written (MapParameter entries, outputs present already), the job's identity and the tasks;
each task publishes its rank's files through its destination
(:meth:`zckpt.write.destinations.OutputFile.publish_parts`: a remote rank is written in a
local temporary directory and its files uploaded, parts before the index, once complete).
MindSpore's own safetensors jobs use
this layout, so the files load with ``mindspore.load_checkpoint(f, format="safetensors")``
and with any safetensors reader.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import OutputError
from zckpt.jobs.export_job import (
    ExportOptions,
    ExportReport,
    PlannedStore,
    export_fingerprint,
    export_session,
    output_jobs,
    task_name,
)
from zckpt.plan.values import ExportPlan, RankExport
from zckpt.run.choose import placement
from zckpt.run.progress import Report, Ticker
from zckpt.sources.strategies import StrategyArg
from zckpt.store.reader import StoreReader
from zckpt.store.store import Store
from zckpt.write.boxes import RankResult
from zckpt.write.destinations import OutputDir, output_file, refuse_present
from zckpt.write.safetensors_file import SUFFIX
from zckpt.write.writers import rank_writer


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
    with export_session(store_or_path, out_dir, strategy, ranks, options) as (store, plan, dest):
        return _export_safetensors(store, plan, dest, options, t0)


def _export_safetensors(store: Store, plan: ExportPlan, dest: OutputDir, options: ExportOptions,
                        t0: float) -> ExportReport:
    kinds = {e.name: e.kind for e in store.entries()}
    for r in plan.ranks:
        for s in r.slices:
            if kinds[s.name] == "map":
                raise OutputError("MapParameter entries have no safetensors form (MindSpore cannot save them as "
                                  "safetensors either); export this store as .ckpt", param=s.name)
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
    with placement(options) as place, place.running():
        options = replace(options, block_bytes=place.share(options.block_bytes), overlap=place.overlap())
        results = place.run(write_safetensors_file, units, PlannedStore.of(store), options, label="export",
                            progress=options.progress, name=task_name,
                            size=lambda u: sum(s.box.size * sizes.get(s.name, 0) for s in u[0].slices))
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
    ticker = Ticker(report)
    return output_file(target, options.storage_options).publish_parts(
        lambda path: rank_writer(options).write(reader, rank, path, ticker))
