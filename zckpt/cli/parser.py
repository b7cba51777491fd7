"""The ``zckpt`` argument parser: every subcommand, its options, their help and their older spellings.

Building the parser is all this module does: what a command does with the values is
:mod:`zckpt.cli.commands`, how the program starts and exits is :mod:`zckpt.cli.main`, and
the shared vocabulary (sizes, older spellings, suggestions) is :mod:`zckpt.cli.args`.
``docs/cli.md`` is rendered from :func:`build_parser` (:mod:`zckpt.cli.doc`), so a help
text changed here changes the page.
"""

from __future__ import annotations

import argparse
from typing import Any

from zckpt.cli.args import (
    SIZE_RULE,
    MiB,
    Parser,
    VersionAction,
    old_positional,
    old_spelling,
    positive_int,
    size_type,
)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, built anew at each call (argparse parsers keep state)."""
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
    ing.add_argument("--serve", action="append", metavar="DST_STRATEGY", default=[],
                     help="a destination strategy the store will serve (repeatable): chunks also split on its "
                          "ranks' borders, so loading or exporting one of its ranks reads only that rank's bytes")
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
    tr.add_argument("src_dir", help="directory (or URL) with rank_<r>/*.ckpt or rank_<r>/*.safetensors")
    _source_args(tr)
    tr.add_argument("--src-strategy", help="source strategy file or per-rank strategy directory (omit: rank_0 is "
                                           "the full model)")
    tr.add_argument("--dst-strategy", help="destination strategy file or directory (omit: one rank with full "
                                           "tensors)")
    _output_args(tr, "output directory or URL (rank_<r>/<prefix><r>.ckpt)")
    tr.add_argument("--verify-replicas", action="store_true", help="also check that replicated copies are equal")
    old_spelling(tr, "--no-verify-crc", like=_no_verify_arg(tr, "do not check the sources' crc_num (the "
                                                                 "checksum MindSpore's crc_check writes)"))
    _format_args(tr, "one <prefix><r>_part<s>.ckpt per source pipeline stage s (on by itself when the source "
                     "strategy is one stage of the destination's, as in MindSpore)")
    _engine_args(tr)
    _helper_arg(tr, "write part of the destination files")
    _dry_run_arg(tr)
    _storage_args(tr)

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

    inf = sub.add_parser("info", help="describe a .ckpt or .safetensors file, a strategy file, a store or a "
                                      "MindFormers checkpoint directory")
    inf.add_argument("path", help="file, directory or store (a local path or a URL: s3://..., memory://...)")
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
    p.add_argument("--prefix", help="file name prefix (default: checkpoint_; --format mindformers: none)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--crc", action="store_true", help="append MindSpore's crc_num trailer")
    old_spelling(p, "--block-mb", like=p.add_argument(
        "--block-size", dest="block_bytes", type=size_type(), metavar="SIZE",
        help="tensor data materialised per step, e.g. 256MiB (a plain number is MiB; default max-mem/4)"))


def _format_args(p: argparse.ArgumentParser, per_stage_help: str) -> None:
    """The destination files' format options: shared by ``export`` and ``transform``."""
    p.add_argument("--per-stage", action="store_true", help=per_stage_help)
    p.add_argument("--format", choices=["ckpt", "safetensors", "mindformers"], default="ckpt",
                   help="output format (default: ckpt); safetensors writes rank_<r>/<prefix><r>.safetensors; "
                        "mindformers writes a MindFormers Checkpoint 2.0 iteration: iteration_XXXXXXXX/ "
                        "([prefix-]model-/opt-RRRRRRR-NNNNNNN.safetensors, metadata.json, common.json) and "
                        "latest_checkpointed_iteration.txt (--prefix: none unless given)")
    p.add_argument("--iteration", type=int, metavar="N",
                   help="mindformers: the iteration to write (default: the source's iteration directory, else its "
                        "global_step, else 0)")
    p.add_argument("--remove-redundancy", action="store_true",
                   help="mindformers: save each piece once, by the rank MindFormers' balancing picks "
                        "(as its save_remove_redundancy)")
    old_spelling(p, "--max-file-mb", like=p.add_argument(
        "--max-file-size", dest="max_file_bytes", type=size_type(zero=True), default=0, metavar="SIZE",
        help="safetensors: split a rank larger than this into HF-style parts plus "
             "<prefix><r>.safetensors.index.json, e.g. 4GiB (a plain number is MiB; default 0: never split)"))
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON, and progress as JSON lines on stderr (unless --quiet)")


def _no_verify_arg(p: argparse.ArgumentParser, what: str) -> argparse.Action:
    """The one name of "do not check" in every command that can skip its checks."""
    return p.add_argument("--no-verify-checksums", action="store_true", help=what)


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


def _storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec option for s3://, gs://, ... URLs (repeatable; e.g. endpoint_url=http://host:9000; "
                        "VALUE is parsed as JSON when it can be, else kept as text)")


def _dry_run_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="make every check and refusal of the run, write nothing, and print the files and bytes it "
                        "would write and read and whether the disk has room (exit 1 where the run would stop); with "
                        "--scheduler, export and transform ask the scheduler for its worker threads, to plan the same "
                        "groups of files as the run")


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
