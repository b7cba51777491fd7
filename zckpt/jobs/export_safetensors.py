"""Export to safetensors: each destination rank as ``rank_<r>/<prefix><r>.safetensors``.

The export job around the safetensors rank writer (:mod:`zckpt.write.safetensors_rank`, which
holds the layout: one file, or HF-style parts and an index): the refusals before a file is
written (MapParameter entries, outputs present already), the job's identity, the tasks, and
a remote destination, where each rank is written in a local temporary directory and its
files uploaded (parts before the index) once complete. MindSpore's own safetensors jobs use
this layout, so the files load with ``mindspore.load_checkpoint(f, format="safetensors")``
and with any safetensors reader.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import OutputError
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
from zckpt.plan.values import ExportPlan, RankExport
from zckpt.run.choose import placement
from zckpt.run.progress import Report, Ticker
from zckpt.sources.strategies import StrategyArg
from zckpt.store.reader import StoreReader
from zckpt.store.store import Store
from zckpt.write import out_records
from zckpt.write.boxes import RankResult
from zckpt.write.out_dirs import output_folders
from zckpt.write.safetensors_file import SUFFIX
from zckpt.write.safetensors_rank import existing_outputs, remote_outputs
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
            clash = [out_loc.url_of(p) for _, target in jobs for p in remote_outputs(out_loc, target.as_posix())]
        if clash and out_loc is None and out_records.finished_as_recorded(out, fingerprint):
            return ExportReport(str(out), (), time.perf_counter() - t0, kept=len(jobs))  # complete: left as it is
        if clash:
            raise OutputError(f"{len(clash)} output file(s) already exist (--overwrite replaces them)", path=clash[0])
    if out_loc is None:
        output_folders(out, [p for _, p in jobs])
    sizes = {e.name: ms_dtype(e.ms_type).storage.itemsize for e in store.entries() if e.kind == "tensor"}
    units = [(r, target_name(out_loc, p)) for r, p in jobs]
    with placement(options) as place, place.running():
        options = replace(options, block_bytes=place.share(options.block_bytes), overlap=place.overlap())
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
            return rank_writer(options).write(reader, rank, Path(target), ticker)
    return _write_remote_rank(reader, rank, target, options, ticker)


def _write_remote_rank(
    reader: StoreReader, rank: RankExport, target: str, options: ExportOptions, ticker: Ticker | None = None
) -> RankResult:
    """Write the rank's files in a local temporary directory, upload each when complete (the
    parts before the index that names them), then remove what an earlier export of this
    rank left that this one did not write (e.g. parts of another split)."""
    loc = remote.locate(target, options.storage_options, OutputError)
    folder = loc.sibling("")
    stale = set(remote_outputs(loc, loc.path))
    with tempfile.TemporaryDirectory(prefix="zckpt-out-") as tmp:
        name = target.rstrip("/").rsplit("/", 1)[-1]
        result = rank_writer(options).write(reader, rank, Path(tmp) / name, ticker)
        made = sorted(p.name for p in Path(tmp).iterdir())
        index = Path(result.path).name if Path(result.path).name.endswith(INDEX_SUFFIX) else None
        for n in [m for m in made if m != index] + ([index] if index else []):
            remote.upload(Path(tmp) / n, folder.child(n), OutputError)
    written = {folder.child(n).path for n in made}
    for p in sorted(stale - written):
        remote.remove(remote.Location(loc.url_of(p), loc.fs, p), OutputError)
    return replace(result, path=folder.child(Path(result.path).name).url)
