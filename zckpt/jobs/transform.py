"""The direct path: destination files written straight from the source shards, no store.

``ingest`` + ``export`` write the model twice (into the store, then out of it). Here the
same two plans are made (the ingest plan picks one source rank per box, the export plan
gives each destination rank its slices) and the output format's writer (:mod:`zckpt.write.writers`)
writes each destination file from a :class:`~zckpt.sources.reader.SourceReader`: every needed
source byte is read once, pieces that are whole rows on both sides are copied by the
kernel. What ingest refuses is refused here too, before any file is written: regions no
present shard holds (named with the missing ranks), unlisted tensors that differ across
the ranks holding them, parameters shared by pipeline stages that disagree. One
destination file is one task (in this process, on a LocalCluster or on a Dask cluster).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import OutputError, SourceError, UsageError
from zckpt.core.layout import Box
from zckpt.formats.entries import EntryInfo
from zckpt.formats.strategy import StrategyMap
from zckpt.io import remote
from zckpt.io.fileio import Publisher
from zckpt.io.read_ahead import Order
from zckpt.jobs.export import safetensors_fingerprint
from zckpt.jobs.export_job import ExportOptions, ExportReport, files_digest, stage_jobs
from zckpt.plan.export_plan import build_export_plan
from zckpt.plan.mf_iteration import COMMON_FIELDS
from zckpt.plan.values import ExportPlan, IngestPlan, RankExport, Slice, TensorSpec, Write
from zckpt.run.choose import placement
from zckpt.run.collect import fewer_collections
from zckpt.run.engines import travelling, wants_overlap
from zckpt.run.progress import Report, Ticker
from zckpt.sources.partial_inputs import needed_params, refuse_unsupplied
from zckpt.sources.prepare import prepare_ingest
from zckpt.sources.reader import Corners, SourceBoxes, SourceReader
from zckpt.sources.replicas import CheckJob, compare_replicas, merged, replica_jobs
from zckpt.sources.strategies import StrategyArg, load_strategy
from zckpt.write.boxes import RankResult
from zckpt.write.destinations import OutputDir, output_dir, output_file, refuse_present
from zckpt.write.mindformers_dir import build_iteration, common_document, published
from zckpt.write.safetensors_file import SUFFIX, no_safetensors_form
from zckpt.write.writers import OUTPUTS, group_writer, source_major, write_rank

_PIPELINE_ONLY = ("accu_grads", "adam_v", "adam_m")


@dataclass(frozen=True)
class TransformOptions(ExportOptions):
    """Export's options (prefix, format, crc, workers, ...) plus what ingest checks on the
    way. ``per_stage`` forces per-stage parts; MindSpore's rule
    (:func:`is_single_stage_conversion`) turns them on by itself."""

    verify_crc: bool = True
    """Check each source ``.ckpt``'s ``crc_num`` trailer (safetensors: its ``crc_num``
    metadata) when planning, as ingest does."""
    verify_replicas: bool = False
    """Also compare replicas inside one pipeline stage (unlisted tensors and parameters
    shared across stages are always compared)."""
    file_suffix: str | None = None
    """MindSpore's ``file_suffix``: which checkpoint of each ``rank_<r>`` directory is read
    (see :class:`zckpt.jobs.ingest.IngestOptions`)."""
    choice_func: Callable[[str], bool] | None = None
    """MindSpore's ``choice_func``: ``False`` for an entry name leaves the entry out."""


@dataclass(frozen=True)
class TransformReport(ExportReport):
    bytes_compared: int = 0
    """Source bytes compared between replicas before writing."""


@dataclass(frozen=True)
class TransformPlan:
    source: IngestPlan
    export: ExportPlan
    src_strategy: StrategyMap | None
    dst_strategy: StrategyMap | None
    indexes: Mapping[int, Mapping[str, EntryInfo]]
    """Every source file's index, read while planning (where each payload lies)."""

    @cached_property
    def _writes_by_name(self) -> dict[str, list[Write]]:
        out: dict[str, list[Write]] = {}
        for w in self.source.writes:
            out.setdefault(w.name, []).append(w)
        return out

    @cached_property
    def _specs(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.source.tensors}

    @cached_property
    def _corners(self) -> Corners:
        return Corners()

    def boxes(self, rank: RankExport) -> SourceBoxes:
        """Where the slices of one destination file live."""
        return SourceBoxes.of(self._specs, self._writes_by_name, rank.slices, self.indexes, self.source.rank_files,
                              self._corners)


@dataclass(frozen=True)
class DirectJob:
    """One destination file: its slices, its name, where their boxes live."""

    rank: RankExport
    target: str
    boxes: SourceBoxes


def is_single_stage_conversion(src: StrategyMap | None, dst: StrategyMap | None) -> bool:
    """MindSpore's rule for the per-stage conversion: the source strategy is one pipeline
    stage's file whose parameters are a strict subset of a single-stage destination's. The
    output is then ``rank_<r>/<prefix><r>_part<stage>.ckpt``."""
    if src is None or dst is None or src.stage_num != 1 or dst.stage_num != 1:
        return False
    src_keys = {n for n in src.layouts if not n.startswith(_PIPELINE_ONLY)}
    dst_keys = {n for n in dst.layouts if not n.startswith(_PIPELINE_ONLY)}
    return src_keys < dst_keys


def refuse_remote_iteration(format: str, dest: OutputDir) -> None:
    """A MindFormers iteration is written to a local directory (as by export)."""
    if format == "mindformers" and not dest.local:
        raise UsageError("a MindFormers iteration is written to a local directory", path=dest.url)


def plan_transform(
    src: str | Path | Mapping[int, str | Path],
    src_strategy: StrategyArg,
    dst_strategy: StrategyArg,
    ranks: Iterable[int] | None = None,
    *,
    verify_crc: bool = True,
    missing: str = "whose files are missing",
    file_suffix: str | None = None,
    choice_func: Callable[[str], bool] | None = None,
    storage_options: remote.StorageOptions = None,
    order: Order = "starts",
) -> TransformPlan:
    """Both plans, refusing any region a planned destination slice needs that no present
    source file holds (by parameter, with the source ranks that would hold it). ``order``: how
    the source files are read after (:class:`zckpt.sources.indexes.IndexReading`)."""
    prepared = prepare_ingest(src, src_strategy, require_complete=False, verify_crc=verify_crc, order=order,
                              file_suffix=file_suffix, choice_func=choice_func, storage_options=storage_options)
    source, smap, indexes = prepared.plan, prepared.strategy, prepared.indexes
    dmap = load_strategy(dst_strategy, storage_options)
    export = build_export_plan(source.tensors, dmap, ranks=ranks)
    for rank in export.ranks:
        for s in rank.slices:
            for box, holders in source.uncovered.get(s.name, ()):
                if box.intersect(s.box) is not None:
                    raise SourceError(f"destination rank {rank.rank} needs region {box.to_json()}, held by source "
                                      f"rank(s) {list(holders)}, {missing}", path=_where(src), param=s.name)
    return TransformPlan(source, export, smap, dmap, indexes)


def _where(src: str | Path | Mapping[int, str | Path]) -> str | None:
    return None if isinstance(src, Mapping) else str(src)


@fewer_collections()
def transform(
    src: str | Path,
    out_dir: str | Path,
    src_strategy: StrategyArg = None,
    dst_strategy: StrategyArg = None,
    *,
    ranks: Iterable[int] | None = None,
    options: TransformOptions = TransformOptions(),
) -> TransformReport:
    """Write ``out_dir/rank_<r>/<prefix><r>.ckpt`` (or ``.safetensors``) for every (or each
    requested) destination rank straight from the source job in ``src``."""
    t0 = time.perf_counter()
    src, out_dir = travelling(src, options.scheduler), travelling(out_dir, options.scheduler)
    if options.format not in OUTPUTS:
        raise UsageError(f"unknown output format {options.format!r} ({' or '.join(OUTPUTS)})")
    if options.format == "mindformers" and ranks is not None:
        raise UsageError("a MindFormers iteration holds every destination rank: --rank does not apply")
    dest = output_dir(out_dir, options.storage_options)
    refuse_remote_iteration(options.format, dest)
    plan = plan_transform(src, src_strategy, dst_strategy, ranks, verify_crc=options.verify_crc,
                          file_suffix=options.file_suffix, choice_func=options.choice_func,
                          storage_options=options.storage_options, order=_reading(options, ranks))
    options = replace(options, choice_func=None)  # applied in the plan; tasks need not carry (pickle) it
    if options.format == "mindformers":
        refuse_source_unsupplied(plan, src)
        with dest.holding():
            return _transform_iteration(plan, dest, options, t0)
    per_stage = options.per_stage or is_single_stage_conversion(plan.src_strategy, plan.dst_strategy)
    options = replace(options, per_stage=per_stage)
    if not per_stage:
        refuse_source_unsupplied(plan, src)
    with dest.holding():
        return _transform_into(plan, dest, options, t0)


def _reading(options: TransformOptions, ranks: Iterable[int] | None) -> Order:
    """How a transform reads its source files: every rank of the destination, in this
    machine's processes, reads every byte, each tensor from all its shards at once (the
    sources are then read ahead in that order, :mod:`zckpt.io.read_ahead`); else what its
    ranks need, which may be a thin band of each file."""
    return "together" if ranks is None and options.scheduler is None else "starts"


def _transform_iteration(plan: TransformPlan, dest: OutputDir, options: TransformOptions,
                         t0: float) -> TransformReport:
    """A MindFormers iteration directory (:mod:`zckpt.write.mindformers_dir`) for every destination rank."""
    if options.per_stage:
        raise UsageError("--per-stage has no MindFormers form: an iteration holds every rank's files")
    specs = {t.name: t for t in plan.source.tensors}
    names = [Slice(n, Box.full(specs[n].shape)) for n in COMMON_FIELDS if n in specs]
    with SourceReader(union_boxes(plan, [RankExport(-1, tuple(names))]), options.block_bytes,
                      storage_options=options.storage_options) as reader:
        common = common_document(reader, specs)
    report, final = build_iteration(dest.path, plan.export.ranks, specs, plan.dst_strategy, common,
                                    plan.source.rank_files.values(), options,
                                    lambda jobs: _run(plan, [(r, str(p)) for r, p in jobs], dest.url, options, t0))
    return replace(report, out_dir=str(final), ranks=published(report.ranks, final))


def _transform_into(plan: TransformPlan, dest: OutputDir, options: TransformOptions, t0: float) -> TransformReport:
    """:func:`transform` once the output directory is held (:func:`zckpt.io.locks.output_writing`)."""
    stages = {t.name: t.stages for t in plan.source.tensors}
    jobs = stage_jobs(stages, plan.export, dest.path, options)
    if options.format == "safetensors":
        maps = [t.name for t in plan.source.tensors if t.kind == "map"]
        if maps:
            raise no_safetensors_form(maps[0], "write .ckpt")

        fingerprint = safetensors_fingerprint(_fingerprint(plan, jobs, options), options)
        jobs = [(r, p.with_suffix(SUFFIX)) for r, p in jobs]
        if not options.overwrite and dest.finished_as_recorded(fingerprint):
            return TransformReport(dest.url, (), time.perf_counter() - t0, kept=len(jobs))  # complete: left as it is
        jobs = _safetensors_jobs(dest, jobs, options.overwrite)
        dest.make_folders(p for _, p in jobs)
        report = _run(plan, [(r, dest.target(p)) for r, p in jobs], dest.url, options, t0)
        dest.remember_all(fingerprint)
        return report
    fingerprint = _fingerprint(plan, jobs, options)
    todo = dest.resume_or_refuse(jobs, fingerprint, options.overwrite)
    report = _run(plan, [(r, dest.target(p)) for r, p in todo], dest.url, options, t0)
    dest.finish(jobs, fingerprint, options.fsync)
    return replace(report, kept=len(jobs) - len(todo))


@fewer_collections()
def transform_rank(
    files: Mapping[int, str | Path],
    rank: int,
    target: str | Path,
    src_strategy: StrategyArg = None,
    dst_strategy: StrategyArg = None,
    *,
    options: TransformOptions = TransformOptions(),
) -> TransformReport:
    """Write destination ``rank`` to the file ``target`` from the source files given as
    ``{source rank: file}`` (``transform_checkpoint_by_rank``): only the ranks it needs."""
    t0 = time.perf_counter()
    out = output_file(target, options.storage_options)
    plan = plan_transform(files, src_strategy, dst_strategy, [rank], verify_crc=options.verify_crc,
                          missing="none of which is in checkpoint_files_map", choice_func=options.choice_func,
                          storage_options=options.storage_options)
    options = replace(options, choice_func=None)
    if out.is_dir():
        raise OutputError("the destination file is a directory", path=out.url)
    if not options.overwrite and out.exists():
        raise OutputError("output file already exists (--overwrite replaces it)", path=out.url)
    refuse_source_unsupplied(plan, files)
    return _run(plan, [(plan.export.ranks[0], out.url)], out.folder, options, t0)


def refuse_source_unsupplied(plan: TransformPlan, src: str | Path | Mapping[int, str | Path]) -> None:
    """Fail by name when the destination files need parameters no source file holds (a
    partial pipeline source), rather than write them without those parameters."""
    refuse_unsupplied(needed_params(plan.dst_strategy, (r.rank for r in plan.export.ranks)),
                      (t.name for t in plan.source.tensors), left_out=plan.source.left_out,
                      behind=plan.source.left_behind,
                      source="the source files" if isinstance(src, Mapping) else f"source {src}",
                      dst=plan.dst_strategy)


def _run(plan: TransformPlan, files: list[tuple[RankExport, str]], out: str, options: TransformOptions,
         t0: float) -> TransformReport:
    """Write ``files`` (destination rank, target): source-major in groups where that reads
    far less, else one by one (a :class:`DirectJob` each)."""
    if not files:  # a complete directory of this same transform: nothing to read or write
        return TransformReport(out, (), time.perf_counter() - t0)
    checks = check_jobs(plan, {n for r, _ in files for n in r.names}, options.verify_replicas)
    sizes = {t.name: ms_dtype(t.ms_type).storage.itemsize for t in plan.source.tensors if t.kind == "tensor"}
    unit_bytes = [sum(s.box.size * sizes.get(s.name, 0) for s in r.slices) for r, _ in files]
    by_target = {t: n for (_, t), n in zip(files, unit_bytes, strict=True)}
    local = not any(remote.is_remote(t) for _, t in files) and \
        not any(remote.is_remote(str(p)) for p in plan.source.rank_files.values())
    with placement(options, helper_possible=local and len(files) > 1, nbytes=sum(unit_bytes),
                   ranks=max(len(plan.source.rank_files), len(files)), modules=("zckpt.jobs.transform",),
                   fsync=options.fsync) as place, place.running() as client:
        options = replace(options, block_bytes=place.share(options.block_bytes), overlap=place.overlap())
        if not options.verify_replicas:  # (each check scans its job's writes: apart when every replica is compared)
            checks = merged(checks, place.tasks() if client is not None else 1)
        compared = place.run(compare_replicas, checks, options, label="verify", size=lambda j: j.nbytes,
                             name=lambda j: f"rank {j.rank}", progress=options.progress)
        # In this process, one publisher syncs each local file while the next is written.
        publisher = place.publisher if client is None and local else None
        cut = source_major_groups(plan, [r for r, _ in files], options, place.tasks()) if local else None
        if cut is not None:
            groups = [([files[i] for i in g], union_boxes(plan, [files[i][0] for i in g])) for g in cut]
            group_bytes = [sum(by_target[t] for _, t in g) for g, _ in groups]
            helped = place.hand_over(groups, group_bytes, write_direct_groups, options)
            options = replace(options, overlap=place.overlap(helped is not None))
            done = place.run(write_direct_group, groups, options, publisher, label="transform",
                             name=lambda g: f"ranks {g[0][0][0].rank}-{g[0][-1][0].rank}",
                             progress=options.progress, size=lambda g: sum(by_target[t] for _, t in g[0]),
                             aside=helped)
            return TransformReport(out, tuple(r for rs in done for r in rs), time.perf_counter() - t0,
                                   bytes_compared=sum(compared))
        units = [DirectJob(r, t, plan.boxes(r)) for r, t in files]
        aside = place.hand_over(units, unit_bytes, write_direct_files, options)
        options = replace(options, overlap=place.overlap(aside is not None))
        results = place.run(write_direct_file, units, options, publisher, label="transform", name=_task_name,
                            progress=options.progress, size=lambda u: by_target[u.target], aside=aside)
    return TransformReport(out, tuple(results), time.perf_counter() - t0, bytes_compared=sum(compared))


def source_major_groups(plan: TransformPlan, ranks: Sequence[RankExport], options: TransformOptions,
                        tasks: int) -> list[list[int]] | None:
    """The groups of ``ranks`` to write source-major (:func:`zckpt.write.writers.source_major`), if any."""
    with SourceReader(union_boxes(plan, ranks), options.block_bytes,
                      storage_options=options.storage_options) as reader:
        return source_major(reader, ranks, options, tasks)


def union_boxes(plan: TransformPlan, ranks: Sequence[RankExport]) -> SourceBoxes:
    """Where the entries of several destination files live: every source box of each (one
    test per entry, not one per slice: 512 files hold 50 000 slices)."""
    specs = {t.name: t for t in plan.source.tensors}
    names = dict.fromkeys(s.name for r in ranks for s in r.slices)
    return plan.boxes(RankExport(-1, tuple(Slice(n, Box.full(specs[n].shape)) for n in names)))


def write_direct_groups(groups: list[tuple[list[tuple[RankExport, str]], SourceBoxes]],
                        options: TransformOptions) -> list[list[RankResult]]:
    """:func:`write_direct_group` of several groups with their own publisher (the helper's share)."""
    with Publisher(options.fsync) as publisher:
        return [write_direct_group(g, options, publisher) for g in groups]


def write_direct_group(unit: tuple[list[tuple[RankExport, str]], SourceBoxes], options: TransformOptions,
                       publisher: Publisher | None = None, report: Report | None = None) -> list[RankResult]:
    """Write a group of destination files from one pass over the source shards (a task)."""
    files, boxes = unit
    with SourceReader(boxes, options.block_bytes, overlap=wants_overlap(options.overlap),
                      storage_options=options.storage_options) as reader:
        return group_writer(options).write(reader, [(r, Path(t)) for r, t in files], Ticker(report), publisher)


def _task_name(job: DirectJob) -> str:
    return f"rank {job.rank.rank} {Path(job.target).name}"


def _safetensors_jobs(dest: OutputDir, jobs: list[tuple[RankExport, Path]],
                      overwrite: bool) -> list[tuple[RankExport, Path]]:
    out = [(r, p.with_suffix(SUFFIX)) for r, p in jobs]
    if not overwrite:
        refuse_present(dest.present(out))
    return out


def _fingerprint(plan: TransformPlan, jobs: list[tuple[RankExport, Path]], options: TransformOptions) -> str:
    """Identity of a transform: the same source files (path, size, time) and the same
    destination files with the same slices. A rerun after a crash resumes on it."""
    files = {}
    for rank, p in sorted(plan.source.rank_files.items()):
        if remote.is_remote(str(p)):
            size, version = remote.identity(remote.locate(str(p), options.storage_options, SourceError), SourceError)
            files[str(rank)] = [str(p), size, version]
            continue
        st = os.stat(p)
        files[str(rank)] = [str(Path(p).resolve()), st.st_size, st.st_mtime_ns]
    doc = {
        "sources": files,
        "files": files_digest(jobs),
        "crc": options.crc,
        "format": "ckpt",
        "path": "direct",
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def write_direct_files(jobs: list[DirectJob], options: TransformOptions) -> list[RankResult]:
    """:func:`write_direct_file` of several destination files with their own publisher (the
    helper's share of a transform)."""
    with Publisher(options.fsync) as publisher:
        return [write_direct_file(j, options, publisher) for j in jobs]


def write_direct_file(job: DirectJob, options: TransformOptions, publisher: Publisher | None = None,
                      report: Report | None = None) -> RankResult:
    """Write one destination file from the source shards (a Dask task)."""
    with SourceReader(job.boxes, options.block_bytes, overlap=wants_overlap(options.overlap),
                      storage_options=options.storage_options) as reader:
        return write_rank(output_file(job.target, options.storage_options), reader, job.rank, options,
                          Ticker(report), publisher)


def check_jobs(plan: TransformPlan, names: set[str], verify_replicas: bool) -> list[CheckJob]:
    """The replica comparisons to run before writing, for the entries the destination files hold."""
    return replica_jobs(plan.source, plan.indexes, names, verify_replicas)
