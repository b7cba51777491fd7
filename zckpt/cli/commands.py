"""One handler per ``zckpt`` subcommand: the parsed arguments turned into a job's options, the
job run, its report printed.

Each handler is a short call into :mod:`zckpt.jobs` (or the layer that does the work) and
returns the exit code; refusals are raised as :class:`~zckpt.core.errors.ZckptError` for
:func:`zckpt.cli.main.main` to print. The parser is :mod:`zckpt.cli.parser`, the words of the
reports :mod:`zckpt.cli.report`.

The jobs are imported inside the handlers: they import numpy, which must come after
:func:`zckpt.cli.main.run` has set :data:`~zckpt.cli.main.ONE_THREAD`, and each command
loads only its own modules (a command's start stays short; ``tests/test_lazy_zarr.py``
checks that ``export`` loads neither zarr nor Dask).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zckpt.cli.args import parse_size, parse_storage_options
from zckpt.cli.report import choices_json, emit, files_doc, files_line, human_bytes, rank_ranges, rate, source_lines
from zckpt.core.errors import CommandLineError, OutputError, UsageError
from zckpt.run.engines import Budget, memory_budget

if TYPE_CHECKING:
    from zckpt.formats.strategy import StrategyMap
    from zckpt.jobs.dryrun import DryRunReport
    from zckpt.jobs.reads import PlanReads

def _budget(a: argparse.Namespace) -> Budget:
    """``--max-mem`` and the step sizes given beside it, all in bytes."""
    b = memory_budget(a.max_mem)
    return replace(b, block_bytes=getattr(a, "block_bytes", None) or b.block_bytes,
                   chunk_bytes=getattr(a, "chunk_bytes", None) or b.chunk_bytes)


def _choice_func(a: argparse.Namespace) -> Callable[[str], bool] | None:
    """``--specify-prefix`` / ``--filter-prefix`` as MindSpore's ``choice_func`` (None: every entry)."""
    if not a.specify_prefix and not a.filter_prefix:
        return None
    # per command, after ONE_THREAD (module docstring)
    from zckpt.jobs.segmented import check_prefix, name_filter

    try:
        spec = check_prefix(a.specify_prefix, "--specify-prefix") if a.specify_prefix else None
        filt = check_prefix(a.filter_prefix, "--filter-prefix") if a.filter_prefix else None
    except UsageError as err:
        raise CommandLineError(err.message) from None
    return name_filter(spec, filt, None)


def _progress(a: argparse.Namespace) -> str:
    """Progress on stderr: JSON lines with --json (machine-readable), bars on a terminal,
    nothing with --quiet."""
    if a.quiet:
        return "off"
    if a.json:
        return "json"
    return "bars" if sys.stderr.isatty() else "off"


def _cmd_ingest(a: argparse.Namespace) -> int:
    # per command, after ONE_THREAD (module docstring)
    from zckpt.jobs.ingest import IngestOptions, ingest
    from zckpt.sources.partial_inputs import partial_line

    budget = _budget(a)
    opts = IngestOptions(
        chunk_bytes=budget.chunk_bytes, block_bytes=budget.block_bytes, verify_replicas=a.verify_replicas,
        overwrite=a.overwrite, workers=a.workers, processes=a.processes, scheduler=a.scheduler,
        overlap=a.overlap, progress=_progress(a),
        storage_options=parse_storage_options(a.storage_option) or None, file_suffix=a.file_suffix,
        choice_func=_choice_func(a), helper=a.helper, serve=tuple(a.serve),
    )
    if a.pack_bytes is not None:
        opts = replace(opts, pack_bytes=a.pack_bytes)
    if a.pack_count is not None:
        opts = replace(opts, pack_count=a.pack_count)
    if a.dry_run:
        from zckpt.jobs.dryrun import dry_run_ingest  # --dry-run's modules: only when asked

        return _dry_run(dry_run_ingest(a.src_dir, a.store, a.strategy, opts), a.json)
    r = ingest(a.src_dir, a.store, a.strategy, opts)
    choices = dict(r.file_choices)
    emit(
        {"store": r.store, "ranks_read": list(r.ranks_read), "ignored_ranks": list(r.ignored_ranks),
         "tensors": r.tensors, "bytes_written": r.bytes_written,
         "bytes_compared": r.bytes_compared, "seconds": r.seconds, "complete": r.complete,
         "rank_files": {str(k): v for k, v in r.rank_files.items()}, "file_choices": choices_json(choices),
         "same_as_rank0": list(r.same_as_rank0), "left_behind": dict(r.left_behind),
         "redone": {str(k): v for k, v in r.redone.items()}, "already_complete": r.already_complete,
         "store_ranks": list(r.store_ranks)},
        a.json,
        source_lines(dict(r.rank_files), choices, r.same_as_rank0)
        + [f"source rank {k} ingested again: {v}" for k, v in sorted(r.redone.items())]
        + ([f"{r.store}: already complete ({r.tensors} entries from {len(r.store_ranks)} source ranks), nothing to "
            "do"] if r.already_complete else
           [f"ingested {r.tensors} entries from {len(r.ranks_read)} source rank(s) into {r.store}",
            f"{human_bytes(r.bytes_written)} written, {human_bytes(r.bytes_compared)} compared with replicas, "
            f"{r.seconds:.2f} s ({rate(r.bytes_written, r.seconds)}), complete: {r.complete}"])
        + ([f"ignored rank file(s) outside the strategy's stages: {list(r.ignored_ranks)}"] if r.ignored_ranks else [])
        + ([partial_line(r.left_behind)] if r.left_behind else []),
        quiet=a.quiet,
    )
    return 0


def _cmd_export(a: argparse.Namespace) -> int:
    # per command, after ONE_THREAD (module docstring)
    from zckpt.jobs.export import export
    from zckpt.jobs.export_job import ExportOptions

    budget = _budget(a)
    opts = ExportOptions(prefix=a.prefix, overwrite=a.overwrite, crc=a.crc, block_bytes=budget.block_bytes,
                         reader=a.reader, workers=a.workers, processes=a.processes, scheduler=a.scheduler,
                         overlap=a.overlap, per_stage=a.per_stage, helper=a.helper,
                         progress=_progress(a), verify_checksums=not a.no_verify_checksums)
    opts = replace(opts, format=a.format, max_file_bytes=a.max_file_bytes, iteration=a.iteration,
                   remove_redundancy=a.remove_redundancy,
                   storage_options=parse_storage_options(a.storage_option) or None)
    if a.dry_run:
        from zckpt.jobs.dryrun import dry_run_export  # --dry-run's modules: only when asked

        return _dry_run(dry_run_export(a.store, a.out, a.strategy, ranks=a.rank, options=opts), a.json)
    r = export(a.store, a.out, a.strategy, ranks=a.rank, options=opts)
    lines = [f"  rank {x.rank}: {x.path} ({x.tensors} tensors, {human_bytes(x.bytes)})" for x in r.ranks]
    lines.append(files_line(r))
    emit(files_doc(r), a.json, lines, quiet=a.quiet)
    return 0


def _cmd_transform(a: argparse.Namespace) -> int:
    # per command, after ONE_THREAD (module docstring)
    from zckpt.jobs.transform import TransformOptions, transform

    budget = _budget(a)
    opts = TransformOptions(prefix=a.prefix, overwrite=a.overwrite, crc=a.crc, block_bytes=budget.block_bytes,
                            workers=a.workers, processes=a.processes, scheduler=a.scheduler, overlap=a.overlap,
                            per_stage=a.per_stage, progress=_progress(a), format=a.format,
                            max_file_bytes=a.max_file_bytes, verify_crc=not a.no_verify_checksums,
                            verify_replicas=a.verify_replicas, file_suffix=a.file_suffix,
                            choice_func=_choice_func(a), helper=a.helper, iteration=a.iteration,
                            remove_redundancy=a.remove_redundancy,
                            storage_options=parse_storage_options(a.storage_option) or None)
    if a.dry_run:
        from zckpt.jobs.dryrun import dry_run_transform  # --dry-run's modules: only when asked

        return _dry_run(dry_run_transform(a.src_dir, a.out, a.src_strategy, a.dst_strategy, ranks=a.rank,
                                          options=opts), a.json)
    r = transform(a.src_dir, a.out, a.src_strategy, a.dst_strategy, ranks=a.rank, options=opts)
    lines = [f"  rank {x.rank}: {x.path} ({x.tensors} tensors, {human_bytes(x.bytes)})" for x in r.ranks]
    lines.append(files_line(r, " straight from the source shards; "
                               f"{human_bytes(r.bytes_compared)} compared with replicas"))
    emit({**files_doc(r), "bytes_written": r.bytes_written, "bytes_read": r.bytes_read,
           "bytes_compared": r.bytes_compared}, a.json, lines, quiet=a.quiet)
    return 0


def _dry_run(report: DryRunReport, as_json: bool) -> int:
    """Print a dry run's report (:mod:`zckpt.jobs.dryrun`); a run that would not fit the disk
    fails as the real run would, after the report's lines (with ``--json``: the error's
    document alone, one document as for every error)."""
    refusal = report.refusal()
    if refusal is None or not as_json:
        emit(report.to_json(), as_json, report.lines(human_bytes))
    if refusal is not None:
        raise refusal
    return 0


def _cmd_plan(a: argparse.Namespace) -> int:
    # per command, after ONE_THREAD (module docstring)
    from zckpt.plan.ranklist import rank_arrays_for_transform_maps
    from zckpt.sources.strategies import load_strategy

    if a.file_suffix and not a.src:
        raise CommandLineError("--file-suffix applies to --src SRC_DIR, which is not given")
    opts = parse_storage_options(a.storage_option) or None
    src = load_strategy(a.src_strategy, opts)
    dst = load_strategy(a.dst_strategy, opts)
    n = dst.device_num() if dst is not None else 1
    ranks = a.rank if a.rank else list(range(n))
    if a.svg:
        from zckpt.jobs.draw import plan_picture  # --svg's modules: only when asked

        if not a.param:
            raise CommandLineError("--svg needs --param NAME")
        if len(ranks) > 1 and a.rank:
            raise CommandLineError("--svg emphasises one destination rank: give --rank once")
        shape = _shape_arg(a.shape) if a.shape else None
        _write_svg(a.svg, plan_picture(src, dst, a.param, shape, a.rank[0] if a.rank else None))
    table = rank_arrays_for_transform_maps(ranks, src, dst)
    reads = _plan_reads(a, src, dst, a.rank) if a.src else None
    if a.json:  # the arrays are in MindSpore's descending order
        doc: dict[str, Any] = {"ranks": {str(r): v[::-1].tolist() for r, v in table.items()}}
        emit({**doc, **(reads.to_json() if reads is not None else {})}, True, [])
        return 0
    if reads is not None:
        emit({}, False, reads.lines(human_bytes))
        return 0
    shown: dict[bytes, str] = {}  # ranks of one replica group share their list
    lines = []
    for r, v in table.items():
        key = v.tobytes()
        if key not in shown:
            shown[key] = f"{rank_ranges(v[::-1])} ({len(v)})"
        lines.append(f"destination rank {r}: source ranks {shown[key]}")
    emit({}, False, lines)
    return 0


def _plan_reads(a: argparse.Namespace, src: StrategyMap | None, dst: StrategyMap | None,
                ranks: Sequence[int] | None) -> PlanReads:
    """``plan --src``: what each destination rank reads from the source files (:mod:`zckpt.jobs.reads`)."""
    # per command, after ONE_THREAD (module docstring)
    from zckpt.jobs.reads import plan_reads
    from zckpt.jobs.transform import plan_transform

    plan = plan_transform(a.src, src, dst, ranks, verify_crc=False, file_suffix=a.file_suffix)
    return plan_reads(plan, memory_budget(parse_size("1GiB"), None, None).block_bytes)


def _cmd_info(a: argparse.Namespace) -> int:
    # per command, after ONE_THREAD (module docstring)
    from zckpt.jobs.info import describe, store_svg

    opts = parse_storage_options(a.storage_option) or None
    if a.svg:
        if not a.param:
            raise CommandLineError("--svg needs --param NAME")
        _write_svg(a.svg, store_svg(a.path, a.param, a.dst_strategy, a.rank, opts))
    elif a.param or a.dst_strategy or a.rank is not None:
        raise CommandLineError("--param, --dst-strategy and --rank go with --svg")
    doc, lines = describe(a.path, opts)
    emit(doc, a.json, lines)
    return 0


def _shape_arg(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise CommandLineError(f"--shape {text!r} is not a comma-separated list of sizes") from None
    if any(d < 1 for d in shape):
        raise CommandLineError(f"--shape {text!r} must hold positive sizes")
    return shape


def _write_svg(path: str, text: str) -> None:
    # per command, after ONE_THREAD (module docstring)
    from zckpt.io.fileio import write_atomic

    target = Path(path)
    if target.suffix.lower() != ".svg":
        raise CommandLineError("the picture's file name must end with .svg", path=target)
    write_atomic(target, text.encode("utf-8"))
    print(f"wrote {target}", file=sys.stderr)


def _cmd_merge_strategies(a: argparse.Namespace) -> int:
    # per command, after ONE_THREAD (module docstring)
    from zckpt.plan.merge import merge_strategies

    if a.out and a.out_file:
        raise CommandLineError("give the merged file once: --out FILE")
    out = a.out or a.out_file
    if not out:
        raise CommandLineError("the following arguments are required: --out")
    if Path(out).exists() and not a.overwrite:
        raise OutputError("output file already exists (use --overwrite to replace it)", path=out)
    r = merge_strategies(a.src_strategy_dir, out)
    emit(
        {"out_file": r.out_file, "format": r.format, "files": list(r.files), "layouts": r.layouts,
         "stage_files": {str(s): f for s, f in r.stage_files.items()}, "duplicates": dict(r.duplicates)},
        a.json,
        [f"merged {len(r.files)} {r.format} strategy file(s) ({len(r.stage_files)} distinct) of "
         f"{len(r.stages)} pipeline stage(s), {r.layouts} layouts -> {r.out_file}"],
    )
    return 0


def _cmd_load(a: argparse.Namespace) -> int:
    # per command, after ONE_THREAD (module docstring)
    from zckpt.jobs.segmented import describe_slice, read_slice, save_npy

    s = read_slice(a.store, a.rank, a.strategy, a.param)
    doc, lines = describe_slice(s)
    if a.out:
        doc["out"] = str(save_npy(a.out, s.array))
        lines.append(f"  saved to {doc['out']}")
    emit(doc, a.json, lines)
    return 0


def _cmd_consolidate(a: argparse.Namespace) -> int:
    # per command, after ONE_THREAD (module docstring)
    from zckpt.store.consolidate import consolidate

    r = consolidate(a.store, parse_storage_options(a.storage_option) or None)
    emit({"store": r.store, "nodes": r.nodes, "root_bytes": r.root_bytes, "seconds": r.seconds}, a.json,
          [f"consolidated the metadata of {r.nodes} nodes into {r.store}/zarr.json "
           f"({human_bytes(r.root_bytes)}) in {r.seconds:.2f} s"])
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
    # per command, after ONE_THREAD (module docstring)
    from zckpt.jobs.verify import verify
    from zckpt.jobs.verify_report import summary_lines

    if a.sources and a.src_dir and a.sources != a.src_dir:
        raise CommandLineError("SRC_DIR given twice (positional and --sources) with different values")
    a.src_dir = a.src_dir or a.sources
    if a.strategy and not a.src_dir:
        raise CommandLineError("--src-strategy is the strategy of SRC_DIR, which is not given")
    if (a.file_suffix or a.specify_prefix or a.filter_prefix) and not a.src_dir:
        raise CommandLineError("--file-suffix, --specify-prefix and --filter-prefix apply to SRC_DIR, which is not "
                               "given")
    if a.dst_strategy and not a.against:
        raise CommandLineError("--dst-strategy is the strategy of --against DST_DIR, which is not given")
    r = verify(a.store, a.src_dir, a.strategy, against=a.against, dst_strategy=a.dst_strategy, prefix=a.prefix,
               any_order=a.any_order, block_bytes=a.block_bytes,
               storage_options=parse_storage_options(a.storage_option) or None,
               file_suffix=a.file_suffix, choice_func=_choice_func(a))
    emit(r.to_json(), a.json, summary_lines(r))
    return 0 if r.ok else 1


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "ingest": _cmd_ingest, "export": _cmd_export, "transform": _cmd_transform, "plan": _cmd_plan, "info": _cmd_info,
    "merge-strategies": _cmd_merge_strategies, "load": _cmd_load, "consolidate": _cmd_consolidate,
    "verify": _cmd_verify,
}
"""Each subcommand's handler, by the name the parser gives it."""
