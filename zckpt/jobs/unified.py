"""``unified_safetensors``: a sharded job merged into MindSpore's unified safetensors directory.

The layout is MindSpore's (see :mod:`zckpt.formats.unified`): ``part<i>.safetensors`` holding
whole parameters, ``hyper_param.safetensors`` holding the entries the strategy does not
shard (``global_step``, ``learning_rate``, ``momentum``...), and ``param_name_map.json``;
which entry goes to which part is :mod:`zckpt.jobs.unified_parts`. ``split_dst_file=(k, n)``
writes only machine ``k``'s share of the parts (machine 1 also writes the map and the
hyper-parameters).

The parts are written straight from the source shards, as ``transform`` writes its files
(:mod:`zckpt.jobs.transform`): the sources are planned once (their indexes read; a remote
shard's by byte range), each part is one destination "rank" of whole tensors, read by a
:class:`~zckpt.sources.reader.SourceReader` and written by the safetensors writer through
:func:`~zckpt.write.destinations.output_file`, ``max_process_num`` parts at a time. Every
needed source byte is read once and the model written once; a URL (``s3://...``) for the
sources, the strategy or ``dst_dir`` is read by range and uploaded as it is written, nothing
of the model on local disk. :func:`unify_store` writes the same directory from a zckpt store.

``param_name_map.json`` is written last, once every part of this machine is complete (an
earlier run's map is removed first: it would name a mix of old and new parts); a failed run
removes the files it published, so that nothing it leaves looks complete.

``hyper_param.safetensors`` is MindSpore's (``_save_hyper_param``): every entry of rank 0's
file that no part holds, as rank 0 saved it, under its own name (``choice_func`` neither
renames nor drops it). That includes rank 0's *shard* of ``accu_grads.*`` (never merged into
a part) and of the parameters ``choice_func`` drops. From a store (:func:`unify_store`
without ``rank0_file``) there is no rank 0 file: the hyper-parameters are then the store's
whole entries that are not parameters, and ``accu_grads.*`` are left out.

Differences from MindSpore, deliberate: optimizer states the strategy omits are merged like
their parameter into the parts (MindSpore copies rank 0's shard of those into
``hyper_param.safetensors``); string entries go to ``hyper_param.safetensors``'s metadata
(zckpt's convention).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from zckpt.core.errors import SourceError, UsageError, ZckptError
from zckpt.core.layout import Box
from zckpt.formats.rank_files import choose_by_suffix, latest_by_numbers
from zckpt.formats.strategy import StrategyMap
from zckpt.formats.unified import HYPER_FILE, MAP_FILE
from zckpt.io import remote
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.transform import TransformOptions, TransformPlan
from zckpt.jobs.unified_parts import PART_BYTES, ChoiceFunc, Names, UnifiedPlan, check_split, plan_unified
from zckpt.plan.values import ExportPlan, RankExport, Slice
from zckpt.run.collect import fewer_collections
from zckpt.sources.discovery import SourceFile, open_source
from zckpt.sources.prepare import prepare_ingest
from zckpt.sources.reader import SourceReader
from zckpt.sources.replicas import compare_replicas, merged, replica_jobs
from zckpt.sources.strategies import load_strategy
from zckpt.store.reader import StoreReader, reading
from zckpt.store.store import Store
from zckpt.write.box_adapters import Renamed, ShardBoxes
from zckpt.write.boxes import BoxReader, RankResult, WriterSettings
from zckpt.write.destinations import OutputDir, destination, output_dir, output_file, publish_bytes
from zckpt.write.safetensors_file import no_safetensors_form
from zckpt.write.writers import file_writer

__all__ = ["PART_BYTES", "collect_rank_files", "copy_hyper", "unified_safetensors", "unify_store"]

ReaderOf = Callable[[RankExport], contextlib.AbstractContextManager[BoxReader]]
"""The reader of one file's whole entries (named as the source names them)."""


def _rank_dirs(src: str | Path, storage_options: remote.StorageOptions
               ) -> list[tuple[str, SourceFile, list[tuple[str, bool]]]]:
    """``(name, directory, [(child, is a file)])`` of each ``rank_<digits>`` directory of ``src``
    (local or a URL), in name order."""
    if isinstance(src, str) and remote.is_remote(src):
        root = remote.locate(src, storage_options, SourceError)
        names = [n for n, d in remote.listdir(root, SourceError) if d and n.startswith("rank_") and n[5:].isdigit()]
        return [(n, root.child(n).url, [(c, not d) for c, d in remote.listdir(root.child(n), SourceError)])
                for n in names]
    dirs = [d for d in sorted(Path(src).glob("rank_[0-9]*")) if d.name[5:].isdigit() and d.is_dir()]
    return [(d.name, d, [(f.name, f.is_file()) for f in d.iterdir()]) for d in dirs]


def _child(folder: SourceFile, name: str) -> SourceFile:
    return folder / name if isinstance(folder, Path) else f"{folder.rstrip('/')}/{name}"


def collect_rank_files(src_dir: str | Path, file_suffix: str | None,
                       storage_options: remote.StorageOptions = None) -> dict[int, SourceFile]:
    """MindSpore's ``_collect_safetensor_files``: ``rank_<r>/*<file_suffix>.safetensors``, several
    narrowed by :func:`~zckpt.formats.rank_files.choose_by_suffix` (its ``_find_most_matching_file``);
    a local path for a local ``src_dir``, a URL for a URL."""
    return _collect(_rank_dirs(src_dir, storage_options), file_suffix)


def _collect(rank_dirs: list[tuple[str, SourceFile, list[tuple[str, bool]]]],
             file_suffix: str | None) -> dict[int, SourceFile]:
    out: dict[int, SourceFile] = {}
    tail = f"{file_suffix}.safetensors" if file_suffix is not None else ".safetensors"
    for name, d, children in rank_dirs:
        rank = int(name[5:])
        files = sorted(n for n, is_file in children if n.endswith(tail) and is_file)
        if len(files) > 1 and file_suffix is not None:
            out[rank] = _child(d, choose_by_suffix(files, "safetensors", str(d), file_suffix).name)
        elif len(files) > 1:  # a tie on the numbers goes to the last name (MindSpore: the listing's order)
            out[rank] = _child(d, max(latest_by_numbers(files)[0]))
        elif files:
            out[rank] = _child(d, files[0])
        elif file_suffix is not None:
            raise SourceError(f"no safetensors file ending with {file_suffix!r}", path=str(d))
    return out


def unified_sources(src_dir: str | Path, file_suffix: str | None,
                    storage_options: remote.StorageOptions = None) -> dict[int, SourceFile] | str:
    """What the job reads, as MindSpore finds it: each rank's safetensors file
    (:func:`collect_rank_files`), else the directory (its ``.ckpt`` files, found as ingest finds them)."""
    text = os.fspath(src_dir)
    if remote.is_remote(text):
        is_file = remote.isfile(remote.locate(text, storage_options, SourceError), SourceError)
    else:
        is_file = Path(text).is_file()
    if is_file:
        raise UsageError("For 'unified_safetensors', the 'src_dir' can not be a file.", path=text)
    rank_dirs = _rank_dirs(src_dir, storage_options)
    st_files = _collect(rank_dirs, file_suffix)
    if st_files and any(n.endswith(".ckpt") for _, _, children in rank_dirs for n, _ in children):
        raise SourceError("For 'unified_safetensors', the 'src_dir' cannot contain both ckpt file and safetensors "
                          "file simultaneously", path=text)
    return st_files if st_files else text


def write_whole(target: str, reader: BoxReader, names: Names, shapes: Mapping[str, tuple[int, ...]],
                options: ExportOptions, index: int = 0) -> RankResult:
    """The file ``target`` (a path or URL) holding the whole entries ``(source name, file name)``."""
    rank = RankExport(index, tuple(Slice(out, Box.full(shapes[src])) for src, out in names))
    renamed = Renamed(reader, {out: src for src, out in names})
    writer = file_writer("safetensors", WriterSettings.of(options))
    return output_file(target, options.storage_options).publish(
        lambda path, pub, files: writer.write(renamed, rank, path, None, pub, files))


def copy_hyper(rank0_file: SourceFile, in_parts: frozenset[str] | set[str], target: str,
               options: ExportOptions) -> str | None:
    """MindSpore's ``_save_hyper_param``: the entries of rank 0's file no part holds, streamed
    as saved into ``target``; ``None`` when there are none. A remote file is read by range."""
    with open_source(rank0_file, options.storage_options, verify_crc=False) as r:
        rest = {n: e for n, e in r.entries.items() if n not in in_parts}
        if not rest:
            return None
        for n, e in rest.items():
            if e.kind == "map":
                raise no_safetensors_form(n, error=UsageError, path=str(rank0_file))
        shapes = {n: e.shape for n, e in rest.items()}
        write_whole(target, ShardBoxes(r, options.block_bytes), tuple((n, n) for n in rest), shapes, options)
    return target


def _source_rank(names: Names, shapes: Mapping[str, tuple[int, ...]], index: int) -> RankExport:
    return RankExport(index, tuple(Slice(src, Box.full(shapes[src])) for src, _ in names))


def write_unified(plan: UnifiedPlan, dest: OutputDir, shapes: Mapping[str, tuple[int, ...]], reader_of: ReaderOf,
                  options: ExportOptions, max_process_num: int, rank0_file: SourceFile | None) -> list[str]:
    """Write ``plan`` into ``dest`` (parts ``max_process_num`` at a time, then the
    hyper-parameters and the map); the files written, parts first. A failure removes
    what this run published."""
    files = [p.file for p in plan.parts] + ([HYPER_FILE, MAP_FILE] if plan.first_machine else [])
    dest.make_folders(dest.path / f for f in files)  # (remote: a killed run's uploads of these aborted)
    target = {f: dest.target(dest.path / f) for f in files}
    if plan.first_machine:
        output_file(target[MAP_FILE], options.storage_options).remove()  # it would name a mix of old and new parts
    written: list[str] = []

    def part(index: int) -> str:
        names, file = plan.parts[index].names, target[plan.parts[index].file]
        with reader_of(_source_rank(names, shapes, index)) as reader:
            write_whole(file, reader, names, shapes, options, index)
        written.append(file)
        return file

    try:
        out = _at_most(part, range(len(plan.parts)), max_process_num)
        if plan.first_machine:
            hyper = _write_hyper(plan, target[HYPER_FILE], shapes, reader_of, options, rank0_file)
            written += [hyper] if hyper is not None else []
            publish_bytes(output_file(target[MAP_FILE], options.storage_options), plan.name_map(), options.fsync)
            out += [*([hyper] if hyper is not None else []), target[MAP_FILE]]
        return out
    except BaseException:
        for t in written:
            with contextlib.suppress(ZckptError, OSError):  # the server may be what failed
                output_file(t, options.storage_options).remove()
        raise


def _write_hyper(plan: UnifiedPlan, target: str, shapes: Mapping[str, tuple[int, ...]], reader_of: ReaderOf,
                 options: ExportOptions, rank0_file: SourceFile | None) -> str | None:
    """``hyper_param.safetensors``: rank 0's entries no part holds, else the plan's whole
    entries that are not parameters; ``None`` when there are none."""
    if rank0_file is not None:
        return copy_hyper(rank0_file, plan.in_parts, target, options)
    if not plan.hyper and not plan.strings:
        return None
    names = plan.hyper + plan.strings
    with reader_of(_source_rank(names, shapes, -1)) as reader:
        write_whole(target, reader, names, shapes, options, -1)
    return target


def _at_most(task: Callable[[int], str], items: Sequence[int], workers: int) -> list[str]:
    """``task`` of each item, ``workers`` at a time; on the first failure the items not
    started are dropped, those running finish, and the failure is raised."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(len(items), workers)), thread_name_prefix="zckpt-unified") as pool:
        futures = [pool.submit(task, i) for i in items]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def unify_store(
    store_path: str | os.PathLike[str],
    dst_dir: str | os.PathLike[str],
    strategy: StrategyMap | None = None,
    *,
    choice_func: ChoiceFunc | None = None,
    split_dst_file: tuple[int, int] | tuple[()] = (),
    max_process_num: int = 64,
    part_bytes: int = PART_BYTES,
    rank0_file: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Write a store's whole tensors as a unified directory; the files written, parts first.

    The parts hold the entries ``strategy`` (the source's) lists, with optimizer states of a
    listed parameter, except ``accu_grads.*``. ``hyper_param.safetensors`` holds, with
    ``rank0_file`` (the source's rank 0 file), every entry of that file no part holds, copied
    as saved (MindSpore's rule); without it, the store's other entries but ``accu_grads.*``.
    Without a strategy, the parameters are the entries of more than one element.
    """
    with reading(store_path):
        store = Store.open(store_path)
        store.check_integrity()
        plan = plan_unified(store.specs(), strategy, choice_func=choice_func, split_dst_file=split_dst_file,
                            part_bytes=part_bytes)
        shapes = {e.name: e.shape for e in store.entries()}
        options = ExportOptions(format="safetensors", overlap=False)

        @contextlib.contextmanager
        def reader_of(rank: RankExport) -> Iterator[BoxReader]:
            yield StoreReader(Store.open(store.url), options)  # a store per thread

        dest = destination(Path(dst_dir), None)
        rank0 = None if rank0_file is None else Path(rank0_file)
        return [Path(p) for p in write_unified(plan, dest, shapes, reader_of, options, max_process_num, rank0)]


@fewer_collections()
def unified_safetensors(
    src_dir: str,
    src_strategy_file: str,
    dst_dir: str,
    merge_with_redundancy: bool = True,
    file_suffix: str | None = None,
    max_process_num: int = 64,
    choice_func: ChoiceFunc | None = None,
    split_dst_file: tuple[int, int] | tuple[()] = (),
    *,
    storage_options: remote.StorageOptions = None,
) -> None:
    """Merge a sharded job (``src_dir/rank_<r>/*.safetensors`` or ``.ckpt``) into MindSpore's
    unified safetensors directory ``dst_dir`` (see the module). Beyond MindSpore, each path
    may be an fsspec URL (``s3://...``), with the filesystem's options in ``storage_options``.

    ``merge_with_redundancy`` is accepted for MindSpore's signature: zckpt takes each region
    from whichever rank holds it and refuses a job where no rank does, deduplicated or not.
    """
    if src_strategy_file is not None and not isinstance(src_strategy_file, (str, os.PathLike)):
        raise TypeError(f"The src_strategy_file should be a str, but got {type(src_strategy_file).__name__}.")
    if not isinstance(merge_with_redundancy, bool):
        raise TypeError(f"merge_with_redundancy should be a bool, but got {type(merge_with_redundancy).__name__}.")
    if not isinstance(max_process_num, int) or isinstance(max_process_num, bool) or max_process_num < 1:
        raise UsageError(f"max_process_num must be a positive int, got {max_process_num!r}")
    if choice_func is not None and not callable(choice_func):
        raise TypeError(f"The choice_func should be callable, but got {type(choice_func).__name__}.")
    split = check_split(split_dst_file)
    dest = output_dir(os.fspath(dst_dir), storage_options)
    dest.create()
    sources = unified_sources(src_dir, file_suffix, storage_options)
    smap = load_strategy(src_strategy_file, storage_options)
    options = TransformOptions(format="safetensors", overlap=False, storage_options=storage_options)
    prepared = prepare_ingest(sources, smap, storage_options=storage_options)
    source = prepared.plan
    for job in merged(replica_jobs(source, prepared.indexes, None, verify_replicas=False)):
        compare_replicas(job, options)  # ingest's refusals, before any file is written
    plan = plan_unified(source.tensors, smap, choice_func=choice_func, split_dst_file=split, part_bytes=PART_BYTES)
    direct = TransformPlan(source, ExportPlan((), 0), smap, None, prepared.indexes)

    def reader_of(rank: RankExport) -> SourceReader:
        return SourceReader(direct.boxes(rank), options.block_bytes, storage_options=storage_options)

    shapes = {t.name: t.shape for t in source.tensors}
    rank0 = prepared.sources.files.get(0)  # the job's rank 0, also where the strategy names another stage
    write_unified(plan, dest, shapes, reader_of, options, max_process_num, rank0)
