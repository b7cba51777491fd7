"""Command line: ``zckpt ingest | export | transform | plan | info | merge-strategies | load | consolidate``.

Every refusal (a path that is not there, a file that is wrong, an output zckpt will not
replace) is printed as one line naming the file and parameter, with exit code 1 (with
``--json`` also as a JSON object on stdout); a command line that cannot be read exits with 2
(argparse's errors and :class:`~zckpt.core.errors.CommandLineError`, found before any file is
read); a closed stdout (``| head``) ends quietly with 141, Ctrl-C with 130 after the writers
removed their temporary files. Bare ``zckpt`` prints the help.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zckpt.cli.args import (
    SIZE_RULE,
    Parser,
    VersionAction,
    check_values,
    old_positional,
    old_spelling,
    positive_int,
    size_type,
)
from zckpt.cli.args import parse_size as parse_size
from zckpt.cli.args import parse_storage_options as parse_storage_options
from zckpt.core.errors import CommandLineError, OutputError, UsageError, ZckptError
from zckpt.run.engines import Budget, memory_budget

if TYPE_CHECKING:
    import numpy as np

    from zckpt.formats.strategy import StrategyMap
    from zckpt.jobs.dryrun import DryRunReport
    from zckpt.jobs.reads import PlanReads

MiB = 1024 * 1024

ONE_THREAD = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
"""The BLAS libraries behind numpy (pip's OpenBLAS, conda's MKL) start a thread per core when
numpy is imported, 0.1 s of every command's start on 2 cores; zckpt does no linear algebra.
Set by :func:`run`, the program's entry, before numpy's import (this module imports it
only where a command needs it); never by ``import zckpt``, which leaves its caller's
process as it was."""


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="zckpt", description="Reshard MindSpore distributed checkpoints.",
               epilog=f"{SIZE_RULE}. 'zckpt COMMAND --help' describes a command.")
    p.add_argument("--version", action=VersionAction)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    ing = sub.add_parser("ingest", help="stream source shards into a global-coordinate Zarr store")
    ing.add_argument("src_dir", help="directory (or URL: s3://..., memory://...) with rank_<r>/*.ckpt or "
                                      "rank_<r>/*.safetensors")
    old_spelling(ing, "--strategy", like=ing.add_argument(
        "--src-strategy", dest="strategy",
        help="source strategy file or per-rank strategy directory (omit: rank_0 is the full model)"))
    ing.add_argument("--store", required=True, help="Zarr store to create (a directory or a URL)")
    _source_args(ing)
    ing.add_argument("--verify-replicas", action="store_true", help="also check that replicated copies are equal")
    ing.add_argument("--overwrite", action="store_true", help="replace an existing store")
    old_spelling(ing, "--chunk-mb", like=ing.add_argument(
        "--chunk-size", dest="chunk_bytes", type=size_type(), metavar="SIZE",
        help="largest chunk, e.g. 64MiB (a plain number is MiB; default min(64MiB, max-mem/16))"))
    old_spelling(ing, "--block-mb", like=ing.add_argument(
        "--block-size", dest="block_bytes", type=size_type(), metavar="SIZE",
        help="tensor data written per step, e.g. 256MiB (a plain number is MiB; default max-mem/4)"))
    ing.add_argument("--pack-size", dest="pack_bytes", type=size_type(zero=True), metavar="SIZE",
                     help="local stores: tensors up to this size that one source rank holds whole share one packed "
                          "array per data type, e.g. 64KiB (the default; a plain number is MiB; 0 gives every "
                          "tensor its own array)")
    ing.add_argument("--pack-count", type=positive_int, metavar="N",
                     help="pack small tensors only when there are at least this many (default 1024)")
    ing.add_argument("--json", action="store_true",
                     help="print the report as JSON, and progress as JSON lines on stderr (unless --quiet)")
    _helper_arg(ing, "copy part of the source ranks")
    _dry_run_arg(ing)
    _engine_args(ing)
    _storage_args(ing)

    exp = sub.add_parser("export", help="write destination rank files from a store")
    exp.add_argument("store", help="zckpt store (a directory or a URL)")
    old_spelling(exp, "--strategy", like=exp.add_argument(
        "--dst-strategy", dest="strategy",
        help="destination strategy file or directory, local or URL (omit: one rank with full tensors)"))
    _output_args(exp, "output directory or URL (rank_<r>/<prefix><r>.ckpt)")
    exp.add_argument("--reader", choices=["zarr", "dask"], default="zarr",
                     help="materialise slices with concurrent Zarr reads (default) or as lazy dask.array views")
    _engine_args(exp)
    _helper_arg(exp, ".ckpt output: write part of the destination files")
    _dry_run_arg(exp)
    _no_verify_arg(exp, "do not check chunks against the CRC-32C recorded at ingest")
    _format_args(exp, "one <prefix><r>_part<s>.ckpt per source pipeline stage s (MindSpore's per-stage parts)")
    _storage_args(exp)

    tr = sub.add_parser("transform", help="write destination rank files straight from source shards (no store)")
    tr.add_argument("src_dir", help="local directory with rank_<r>/*.ckpt or rank_<r>/*.safetensors")
    _source_args(tr)
    tr.add_argument("--src-strategy", help="source strategy file or per-rank strategy directory (omit: rank_0 is "
                                           "the full model)")
    tr.add_argument("--dst-strategy", help="destination strategy file or directory (omit: one rank with full "
                                           "tensors)")
    _output_args(tr, "local output directory (rank_<r>/<prefix><r>.ckpt)")
    tr.add_argument("--verify-replicas", action="store_true", help="also check that replicated copies are equal")
    old_spelling(tr, "--no-verify-crc", like=_no_verify_arg(tr, "do not check the sources' crc_num (the "
                                                                 "checksum MindSpore's crc_check writes)"))
    _format_args(tr, "one <prefix><r>_part<s>.ckpt per source pipeline stage s (on by itself when the source "
                     "strategy is one stage of the destination's, as in MindSpore)")
    _engine_args(tr)
    _helper_arg(tr, "write part of the destination files")
    _dry_run_arg(tr)

    pl = sub.add_parser("plan", help="which source ranks each destination rank needs")
    pl.add_argument("--src-strategy", required=True, help="source strategy file or directory (local or URL)")
    pl.add_argument("--dst-strategy", help="destination strategy file or directory (local or URL; omit: one rank)")
    pl.add_argument("--rank", type=int, action="append", metavar="K",
                    help="only this destination rank (repeatable)")
    pl.add_argument("--json", action="store_true", help="print the source rank lists as JSON")
    pl.add_argument("--svg", metavar="FILE", help="draw --param's source and destination boxes (with --rank: that "
                                                  "rank's box and the source boxes it reads) to an SVG file")
    pl.add_argument("--param", help="parameter to draw with --svg")
    pl.add_argument("--shape", help="its global shape for --svg, e.g. 4096,1024 (strategy files hold no shapes)")
    pl.add_argument("--src", metavar="SRC_DIR",
                    help="the source job (rank_<r>/*.ckpt or *.safetensors, local): also print, per destination rank, "
                         "the source files it reads and the bytes from each, and the read amplification (their "
                         "shapes come from the files)")
    pl.add_argument("--file-suffix", help="with --src: MindSpore's file_suffix (which checkpoint of each rank_<r>)")
    _storage_args(pl)

    inf = sub.add_parser("info", help="describe a .ckpt or .safetensors file, a strategy file or a store")
    inf.add_argument("path", help="file or store (a local path or a URL: s3://..., memory://...)")
    inf.add_argument("--json", action="store_true", help="print the description as JSON")
    inf.add_argument("--svg", metavar="FILE", help="store only: draw --param's source boxes and chunk grid, and the "
                                                   "boxes of --dst-strategy's ranks, to an SVG file")
    inf.add_argument("--param", help="parameter to draw with --svg")
    inf.add_argument("--dst-strategy", help="destination strategy drawn with --svg (omit: one rank, whole tensors)")
    inf.add_argument("--rank", type=int, metavar="K",
                     help="with --svg: emphasise this destination rank and what it reads")
    _storage_args(inf)

    mrg = sub.add_parser("merge-strategies", help="merge per-rank pipeline strategy files into one (as MindSpore)")
    mrg.add_argument("src_strategy_dir", help="directory with every rank's strategy file (*.ckpt or *.json)")
    old_positional(mrg, "out_file", like=mrg.add_argument(
        "--out", metavar="FILE", help="merged strategy file to write (.json for JSON inputs)"))
    mrg.add_argument("--json", action="store_true", help="print the report as JSON")
    mrg.add_argument("--overwrite", action="store_true", help="replace FILE if it exists")

    ld = sub.add_parser("load", help="read one destination rank's slice of one parameter from a store")
    ld.add_argument("store", help="zckpt store (a directory or a URL)")
    ld.add_argument("--rank", type=int, default=0, metavar="K", help="destination rank (default: 0)")
    old_spelling(ld, "--strategy", like=ld.add_argument(
        "--dst-strategy", dest="strategy", help="destination strategy file or directory (omit: one rank, whole "
                                                "tensors)"))
    ld.add_argument("--param", required=True, help="parameter (entry) name")
    ld.add_argument("--out", metavar="FILE", help="save the slice to this .npy file (bf16 as uint16 bits)")
    ld.add_argument("--json", action="store_true", help="print the summary as JSON")

    con = sub.add_parser("consolidate", help="add zarr's consolidated metadata to a complete store (for other "
                                             "Zarr readers; zckpt does not need it)")
    con.add_argument("store", help="complete zckpt store (a directory or a URL)")
    con.add_argument("--json", action="store_true", help="print the report as JSON")
    _storage_args(con)
    _verify_args(sub)
    return p


def _output_args(p: argparse.ArgumentParser, out_help: str) -> None:
    """Where and how destination rank files are named: shared by ``export`` and ``transform``."""
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--rank", type=int, action="append", metavar="K", help="only this destination rank (repeatable)")
    p.add_argument("--prefix", default="checkpoint_", help="file name prefix (default: checkpoint_)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--crc", action="store_true", help="append MindSpore's crc_num trailer")
    old_spelling(p, "--block-mb", like=p.add_argument(
        "--block-size", dest="block_bytes", type=size_type(), metavar="SIZE",
        help="tensor data materialised per step, e.g. 256MiB (a plain number is MiB; default max-mem/4)"))


def _format_args(p: argparse.ArgumentParser, per_stage_help: str) -> None:
    """The destination files' format options: shared by ``export`` and ``transform``."""
    p.add_argument("--per-stage", action="store_true", help=per_stage_help)
    p.add_argument("--format", choices=["ckpt", "safetensors"], default="ckpt",
                   help="output format (default: ckpt); safetensors writes rank_<r>/<prefix><r>.safetensors")
    old_spelling(p, "--max-file-mb", like=p.add_argument(
        "--max-file-size", dest="max_file_bytes", type=size_type(zero=True), default=0, metavar="SIZE",
        help="safetensors: split a rank larger than this into HF-style parts plus "
             "<prefix><r>.safetensors.index.json, e.g. 4GiB (a plain number is MiB; default 0: never split)"))
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON, and progress as JSON lines on stderr (unless --quiet)")


def _no_verify_arg(p: argparse.ArgumentParser, what: str) -> argparse.Action:
    """The one name of "do not check" in every command that can skip its checks."""
    return p.add_argument("--no-verify-checksums", action="store_true", help=what)


def _budget(a: argparse.Namespace) -> Budget:
    """``--max-mem`` and the step sizes given beside it, all in bytes."""
    b = memory_budget(a.max_mem)
    return replace(b, block_bytes=getattr(a, "block_bytes", None) or b.block_bytes,
                   chunk_bytes=getattr(a, "chunk_bytes", None) or b.chunk_bytes)


def _helper_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--helper", action=argparse.BooleanOptionalAction, default=None,
                   help=f"{what} in a second process on this machine; the negative form works in this process "
                        "alone (default: for local jobs of 256 MiB or more, with a core to spare and no Dask cluster)")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=positive_int, default=1, metavar="N",
                   help="run on a Dask LocalCluster of this many workers (default: in this process); they are "
                        "threads of this process unless --processes")
    p.add_argument("--processes", action="store_true",
                   help="LocalCluster workers as separate processes (slower to start; isolates the workers)")
    p.add_argument("--scheduler", metavar="ADDRESS", help="run on an existing Dask cluster (scheduler address, e.g. tcp://host:8786)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="a second thread per task reads and checks while the task writes; the negative form keeps "
                        "one thread per task (default: a second thread when every host runs fewer tasks at once "
                        "than it has cores)")
    p.add_argument("--max-mem", default="1GiB", type=size_type(minimum=16 * MiB), metavar="SIZE",
                   help="bound on tensor data in flight per process/worker, e.g. 512MiB, 2GiB (a plain number is "
                        "MiB; at least 16MiB; default 1GiB)")
    p.add_argument("--quiet", action="store_true",
                   help="print nothing on success: no progress and no summary (errors still print; --json still "
                        "prints its report)")


def _source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file-suffix", metavar="SUFFIX",
                   help="MindSpore's file_suffix: in each rank_<r> directory use the checkpoint file ending in "
                        "<SUFFIX>.ckpt (or .safetensors), e.g. 10_100 for net-10_100.ckpt (default: the only file, "
                        "or MindSpore's choice when it is unambiguous)")
    p.add_argument("--specify-prefix", action="append", metavar="PREFIX",
                   help="only the entries whose name starts with PREFIX (repeatable; MindSpore's specify_prefix, the "
                        "command-line form of choice_func)")
    p.add_argument("--filter-prefix", action="append", metavar="PREFIX",
                   help="leave out the entries whose name starts with PREFIX (repeatable; MindSpore's filter_prefix)")


def _choice_func(a: argparse.Namespace) -> Callable[[str], bool] | None:
    """``--specify-prefix`` / ``--filter-prefix`` as MindSpore's ``choice_func`` (None: every entry)."""
    if not a.specify_prefix and not a.filter_prefix:
        return None
    from zckpt.jobs.segmented import check_prefix, name_filter

    try:
        spec = check_prefix(a.specify_prefix, "--specify-prefix") if a.specify_prefix else None
        filt = check_prefix(a.filter_prefix, "--filter-prefix") if a.filter_prefix else None
    except UsageError as err:
        raise CommandLineError(err.message) from None
    return name_filter(spec, filt, None)


def source_lines(rank_files: dict[int, str], choices: dict[int, Any], same_as_rank0: Sequence[int],
                 limit: int = 8) -> list[str]:
    """What was read from SRC_DIR, where it was a choice: the file picked in each rank
    directory that held several (the first ``limit``; all are in the JSON report)."""
    lines = []
    for r, c in list(choices.items())[:limit]:
        lines.append(f"rank {r}: chose {rank_files[r]} among {len(c.candidates)} files ({c.rule})")
    if len(choices) > limit:
        lines.append(f"... and {len(choices) - limit} more rank directories with several files (see --json)")
    if same_as_rank0:
        lines.append(f"no source strategy: rank file(s) {list(same_as_rank0)} hold the same entries and bytes as "
                     "rank_0, which is read as the full model")
    return lines


def choices_json(choices: dict[int, Any]) -> dict[str, Any]:
    return {str(r): {"file": c.name, "candidates": list(c.candidates), "rule": c.rule} for r, c in choices.items()}


def _storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec option for s3://, gs://, ... URLs (repeatable; e.g. endpoint_url=http://host:9000; "
                        "VALUE is parsed as JSON when it can be, else kept as text)")


def _progress(a: argparse.Namespace) -> str:
    """Progress on stderr: JSON lines with --json (machine-readable), bars on a terminal,
    nothing with --quiet."""
    if a.quiet:
        return "off"
    if a.json:
        return "json"
    return "bars" if sys.stderr.isatty() else "off"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': sizes people can read at a glance."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _rate(n: int, seconds: float) -> str:
    return f"{human_bytes(n / seconds)}/s" if seconds > 0 else "-"


def _emit(doc: dict[str, Any], as_json: bool, lines: Sequence[str], *, quiet: bool = False) -> None:
    """The report: JSON with ``--json``, else its lines, none with ``--quiet``."""
    if as_json:
        print(json.dumps(doc, indent=1))
    elif not quiet:
        for line in lines:
            print(line)


def files_line(r: Any, tail: str = "") -> str:
    """How many rank files an export or transform kept (complete from an earlier run of the
    same job) and wrote, and what writing them took."""
    counts = f"rank files: {r.kept} kept, {len(r.ranks)} written"
    if not r.ranks:
        return counts + (": already complete, nothing to do" if r.kept else "")
    return (f"{counts}, {human_bytes(r.bytes_written)} in {r.seconds:.2f} s "
            f"({_rate(r.bytes_written, r.seconds)}){tail}")


def _files_doc(r: Any) -> dict[str, Any]:
    return {"out_dir": r.out_dir, "seconds": r.seconds, "kept": r.kept, "written": len(r.ranks),
            "ranks": [{"rank": x.rank, "path": x.path, "tensors": x.tensors, "bytes": x.bytes} for x in r.ranks]}


def _cmd_ingest(a: argparse.Namespace) -> int:
    from zckpt.jobs.ingest import IngestOptions, ingest
    from zckpt.sources.partial_inputs import partial_line

    budget = _budget(a)
    opts = IngestOptions(
        chunk_bytes=budget.chunk_bytes, block_bytes=budget.block_bytes, verify_replicas=a.verify_replicas,
        overwrite=a.overwrite, workers=a.workers, processes=a.processes, scheduler=a.scheduler,
        overlap=a.overlap, progress=_progress(a),
        storage_options=parse_storage_options(a.storage_option) or None, file_suffix=a.file_suffix,
        choice_func=_choice_func(a), helper=a.helper,
    )
    if a.pack_bytes is not None:
        opts = replace(opts, pack_bytes=a.pack_bytes)
    if a.pack_count is not None:
        opts = replace(opts, pack_count=a.pack_count)
    if a.dry_run:
        from zckpt.jobs.dryrun import dry_run_ingest

        return _dry_run(dry_run_ingest(a.src_dir, a.store, a.strategy, opts), a.json)
    r = ingest(a.src_dir, a.store, a.strategy, opts)
    choices = dict(r.file_choices)
    _emit(
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
            f"{r.seconds:.2f} s ({_rate(r.bytes_written, r.seconds)}), complete: {r.complete}"])
        + ([f"ignored rank file(s) outside the strategy's stages: {list(r.ignored_ranks)}"] if r.ignored_ranks else [])
        + ([partial_line(r.left_behind)] if r.left_behind else []),
        quiet=a.quiet,
    )
    return 0


def _cmd_export(a: argparse.Namespace) -> int:
    from zckpt.jobs.export import export
    from zckpt.jobs.export_job import ExportOptions

    budget = _budget(a)
    opts = ExportOptions(prefix=a.prefix, overwrite=a.overwrite, crc=a.crc, block_bytes=budget.block_bytes,
                         reader=a.reader, workers=a.workers, processes=a.processes, scheduler=a.scheduler,
                         overlap=a.overlap, per_stage=a.per_stage, helper=a.helper,
                         progress=_progress(a), verify_checksums=not a.no_verify_checksums)
    opts = replace(opts, format=a.format, max_file_bytes=a.max_file_bytes,
                   storage_options=parse_storage_options(a.storage_option) or None)
    if a.dry_run:
        from zckpt.jobs.dryrun import dry_run_export

        return _dry_run(dry_run_export(a.store, a.out, a.strategy, ranks=a.rank, options=opts), a.json)
    r = export(a.store, a.out, a.strategy, ranks=a.rank, options=opts)
    lines = [f"  rank {x.rank}: {x.path} ({x.tensors} tensors, {human_bytes(x.bytes)})" for x in r.ranks]
    lines.append(files_line(r))
    _emit(_files_doc(r), a.json, lines, quiet=a.quiet)
    return 0


def _cmd_transform(a: argparse.Namespace) -> int:
    from zckpt.jobs.transform import TransformOptions, transform

    budget = _budget(a)
    opts = TransformOptions(prefix=a.prefix, overwrite=a.overwrite, crc=a.crc, block_bytes=budget.block_bytes,
                            workers=a.workers, processes=a.processes, scheduler=a.scheduler, overlap=a.overlap,
                            per_stage=a.per_stage, progress=_progress(a), format=a.format,
                            max_file_bytes=a.max_file_bytes, verify_crc=not a.no_verify_checksums,
                            verify_replicas=a.verify_replicas, file_suffix=a.file_suffix,
                            choice_func=_choice_func(a), helper=a.helper)
    if a.dry_run:
        from zckpt.jobs.dryrun import dry_run_transform

        return _dry_run(dry_run_transform(a.src_dir, a.out, a.src_strategy, a.dst_strategy, ranks=a.rank,
                                          options=opts), a.json)
    r = transform(a.src_dir, a.out, a.src_strategy, a.dst_strategy, ranks=a.rank, options=opts)
    lines = [f"  rank {x.rank}: {x.path} ({x.tensors} tensors, {human_bytes(x.bytes)})" for x in r.ranks]
    lines.append(files_line(r, " straight from the source shards; "
                               f"{human_bytes(r.bytes_compared)} compared with replicas"))
    _emit({**_files_doc(r), "bytes_written": r.bytes_written, "bytes_read": r.bytes_read,
           "bytes_compared": r.bytes_compared}, a.json, lines, quiet=a.quiet)
    return 0


def _dry_run(report: DryRunReport, as_json: bool) -> int:
    """Print a dry run's report (:mod:`zckpt.jobs.dryrun`); a run that would not fit the disk
    fails as the real run would, after the report's lines (with ``--json``: the error's
    document alone, one document as for every error)."""
    refusal = report.refusal()
    if refusal is None or not as_json:
        _emit(report.to_json(), as_json, report.lines(human_bytes))
    if refusal is not None:
        raise refusal
    return 0


def _dry_run_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="make every check and refusal of the run, write nothing, and print the files and bytes it "
                        "would write and read and whether the disk has room (exit 1 where the run would stop)")


def _cmd_plan(a: argparse.Namespace) -> int:
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
        from zckpt.jobs.draw import plan_picture

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
        _emit({**doc, **(reads.to_json() if reads is not None else {})}, True, [])
        return 0
    if reads is not None:
        _emit({}, False, reads.lines(human_bytes))
        return 0
    shown: dict[bytes, str] = {}  # ranks of one replica group share their list
    lines = []
    for r, v in table.items():
        key = v.tobytes()
        if key not in shown:
            shown[key] = f"{rank_ranges(v[::-1])} ({len(v)})"
        lines.append(f"destination rank {r}: source ranks {shown[key]}")
    _emit({}, False, lines)
    return 0


def _plan_reads(a: argparse.Namespace, src: StrategyMap | None, dst: StrategyMap | None,
                ranks: Sequence[int] | None) -> PlanReads:
    """``plan --src``: what each destination rank reads from the source files (:mod:`zckpt.jobs.reads`)."""
    from zckpt.jobs.reads import plan_reads
    from zckpt.jobs.transform import plan_transform

    plan = plan_transform(a.src, src, dst, ranks, verify_crc=False, file_suffix=a.file_suffix)
    return plan_reads(plan, memory_budget(parse_size("1GiB"), None, None).block_bytes)


def rank_ranges(ranks: Sequence[int] | np.ndarray) -> str:
    """``[0, 1, 2, 3, 8, 10, 11]`` -> ``"0-3, 8, 10-11"``: a 4 096-rank list stays one short line."""
    import numpy as np

    a = np.asarray(ranks, dtype=np.int64)
    if a.size == 0:
        return "none"
    cut = np.flatnonzero(np.diff(a) != 1) + 1
    starts, ends = a[np.concatenate(([0], cut))], a[np.concatenate((cut - 1, [a.size - 1]))]
    return ", ".join(str(s) if s == e else f"{s}-{e}" for s, e in zip(starts.tolist(), ends.tolist(), strict=True))


def _cmd_info(a: argparse.Namespace) -> int:
    from zckpt.jobs.info import describe

    opts = parse_storage_options(a.storage_option) or None
    if a.svg:
        from zckpt.jobs.info import store_svg

        if not a.param:
            raise CommandLineError("--svg needs --param NAME")
        _write_svg(a.svg, store_svg(a.path, a.param, a.dst_strategy, a.rank, opts))
    elif a.param or a.dst_strategy or a.rank is not None:
        raise CommandLineError("--param, --dst-strategy and --rank go with --svg")
    doc, lines = describe(a.path, opts)
    _emit(doc, a.json, lines)
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
    from zckpt.io.fileio import write_atomic

    target = Path(path)
    if target.suffix.lower() != ".svg":
        raise CommandLineError("the picture's file name must end with .svg", path=target)
    write_atomic(target, text.encode("utf-8"))
    print(f"wrote {target}", file=sys.stderr)


def _cmd_merge_strategies(a: argparse.Namespace) -> int:
    from zckpt.plan.merge import merge_strategies

    if a.out and a.out_file:
        raise CommandLineError("give the merged file once: --out FILE")
    out = a.out or a.out_file
    if not out:
        raise CommandLineError("the following arguments are required: --out")
    if Path(out).exists() and not a.overwrite:
        raise OutputError("output file already exists (use --overwrite to replace it)", path=out)
    r = merge_strategies(a.src_strategy_dir, out)
    _emit(
        {"out_file": r.out_file, "format": r.format, "files": list(r.files), "layouts": r.layouts,
         "stage_files": {str(s): f for s, f in r.stage_files.items()}, "duplicates": dict(r.duplicates)},
        a.json,
        [f"merged {len(r.files)} {r.format} strategy file(s) ({len(r.stage_files)} distinct) of "
         f"{len(r.stages)} pipeline stage(s), {r.layouts} layouts -> {r.out_file}"],
    )
    return 0


def _cmd_load(a: argparse.Namespace) -> int:
    from zckpt.jobs.segmented import describe_slice, read_slice, save_npy

    s = read_slice(a.store, a.rank, a.strategy, a.param)
    doc, lines = describe_slice(s)
    if a.out:
        doc["out"] = str(save_npy(a.out, s.array))
        lines.append(f"  saved to {doc['out']}")
    _emit(doc, a.json, lines)
    return 0


def _cmd_consolidate(a: argparse.Namespace) -> int:
    from zckpt.store.consolidate import consolidate

    r = consolidate(a.store, parse_storage_options(a.storage_option) or None)
    _emit({"store": r.store, "nodes": r.nodes, "root_bytes": r.root_bytes, "seconds": r.seconds}, a.json,
          [f"consolidated the metadata of {r.nodes} nodes into {r.store}/zarr.json "
           f"({human_bytes(r.root_bytes)}) in {r.seconds:.2f} s"])
    return 0


def _verify_args(sub: Any) -> None:
    ver = sub.add_parser("verify", help="re-read a store (and its sources / an export) and report every mismatch")
    ver.add_argument("store", help="zckpt store (a directory or a URL)")
    ver.add_argument("src_dir", nargs="?", help="also compare these local source shards (rank_<r>/*.ckpt) with "
                                                "the store (same as --sources)")
    ver.add_argument("--sources", metavar="SRC_DIR", dest="sources",
                     help="compare the store with the source shards it was ingested from, byte for byte: the check "
                          "that finds a store edited with its digests recomputed")
    old_spelling(ver, "--strategy", like=ver.add_argument(
        "--src-strategy", dest="strategy", help="source strategy of SRC_DIR (omit: rank_0 is the full model)"))
    _source_args(ver)
    ver.add_argument("--against", metavar="DST_DIR",
                     help="also compare a local export's rank files with the store")
    ver.add_argument("--dst-strategy", help="destination strategy of DST_DIR (omit: one rank, whole tensors)")
    ver.add_argument("--prefix", default="checkpoint_", help="file name prefix of DST_DIR (default: checkpoint_)")
    ver.add_argument("--any-order", action="store_true",
                     help="accept DST_DIR's .ckpt entries in any order (e.g. written by MindSpore); values are "
                          "still compared (safetensors files have no entry order)")
    old_spelling(ver, "--block-mb", like=ver.add_argument(
        "--block-size", dest="block_bytes", type=size_type(), default=64 * MiB, metavar="SIZE",
        help="tensor data compared per step (a plain number is MiB; default 64MiB)"))
    ver.add_argument("--json", action="store_true", help="print the report as JSON")
    _storage_args(ver)


def _cmd_verify(a: argparse.Namespace) -> int:
    from zckpt.jobs.verify import summary_lines, verify

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
    _emit(r.to_json(), a.json, summary_lines(r))
    return 0 if r.ok else 1


_COMMANDS = {"ingest": _cmd_ingest, "export": _cmd_export, "transform": _cmd_transform, "plan": _cmd_plan,
             "info": _cmd_info, "merge-strategies": _cmd_merge_strategies, "load": _cmd_load,
             "consolidate": _cmd_consolidate}
_COMMANDS["verify"] = _cmd_verify


EXIT_ERROR, EXIT_USAGE, EXIT_PIPE, EXIT_INTERRUPT = 1, 2, 141, 130
"""Exit codes: a refusal; bad arguments (argparse's code); stdout closed by the reader
(``zckpt info ... | head``: 128 + SIGPIPE, quietly); interrupted (128 + SIGINT)."""


def error_doc(err: BaseException, command: str) -> dict[str, Any]:
    """An error as the JSON that ``--json`` prints, so scripts read failures as they read reports."""
    doc: dict[str, Any] = {"command": command, "type": type(err).__name__}
    if isinstance(err, ZckptError):
        doc.update(message=err.message, file=err.path, param=err.param)
    else:
        doc["message"] = str(err)
    return {"error": doc}


def _fail(err: BaseException, args: argparse.Namespace, code: int) -> int:
    text = str(err) if isinstance(err, ZckptError) else f"{type(err).__name__}: {err}"
    print(f"zckpt {args.command}: error: {text}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps(error_doc(err, args.command), indent=1))
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    if args.command is None:  # bare ``zckpt``: what it can do, as ``--help`` shows it
        parser.print_help()
        return 0
    if extras:
        _subcommand(parser, args.command).unrecognized(extras)
    try:
        check_values(args)
        code = _COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at exit
        return code
    except CommandLineError as err:
        return _fail(err, args, EXIT_USAGE)
    except ZckptError as err:
        return _fail(err, args, EXIT_ERROR)
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_PIPE
    except KeyboardInterrupt:
        remove_own_temporaries(args)
        print(f"zckpt {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPT
    except (OSError, TypeError, ValueError) as err:
        return _fail(err, args, EXIT_ERROR)


def _subcommand(parser: argparse.ArgumentParser, name: str) -> Parser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices[name]
            assert isinstance(sub, Parser)
            return sub
    raise AssertionError(name)


def remove_own_temporaries(args: argparse.Namespace) -> None:
    """Remove the temporary files this process left in its output directory or store.

    Writers remove their temporary file when they fail, but Ctrl-C may land between the
    file's creation and the ``with`` that would remove it. Temporary names carry the pid
    (:func:`zckpt.io.safe_paths.temp_name`), so this process's own are told apart from a
    concurrent run's."""
    import os
    from pathlib import Path

    mine = f"*.{os.getpid()}.*.tmp-zckpt"
    for where in (getattr(args, "out", None), getattr(args, "store", None)):
        if not where or "://" in str(where) or not Path(where).is_dir():
            continue
        for tmp in Path(where).rglob(mine):
            try:
                if tmp.is_file() and not tmp.is_symlink():
                    tmp.unlink()
            except OSError:
                pass


def _silence_stdout() -> None:
    """The reader of stdout is gone: point stdout at /dev/null so that Python's final flush
    does not raise a second BrokenPipeError at exit."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def run() -> int:
    """The ``zckpt`` program (console script and ``python -m zckpt.cli``): :func:`main` in a
    process whose BLAS stays on one thread (:data:`ONE_THREAD`; a user's own setting wins)."""
    for name in ONE_THREAD:
        os.environ.setdefault(name, "1")
    return main()


if __name__ == "__main__":
    sys.exit(run())
