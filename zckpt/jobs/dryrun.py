"""``--dry-run``: what ingest, export and transform would read and write, before a long job.

Each dry run makes the checks and refusals its real run makes before writing (source
discovery and indexes, the plans, partial inputs, replica comparisons as the real run makes
them, the output directory or store it would write into) and raises the same error where
the real run would stop, but writes nothing: no store, no output folder, no lock file. What
it returns says, per destination file (or store), the bytes to write and the source files
and bytes it reads; then the totals and the free space of the filesystem that receives them.

The bytes counted are those the real run's counters count: the data bytes of each
destination file read from each source file (``read_bytes``), the bytes read from the files
for them (whole source rows where a slice takes part of a row, ``read_bytes +
checked_bytes`` of the direct path), the bytes compared between replicas, and an ingest's
``bytes_written``. What a destination file reads is :func:`zckpt.jobs.reads.source_reads`, which
``zckpt plan --src`` prints too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import DiskFullError, OutputError, StoreError, UsageError
from zckpt.formats.ckpt_encoding import CRC_MAGIC, map_header, string_value, tensor_values
from zckpt.formats.safetensors import _FILLER, MS_METADATA, TensorHeader, header_bytes
from zckpt.formats.shard_reader import INDEX_SUFFIX
from zckpt.io import remote
from zckpt.io.locks import probe_store
from zckpt.jobs.export import safetensors_fingerprint
from zckpt.jobs.export_job import ExportOptions, export_fingerprint, output_jobs, plan_export, stage_jobs
from zckpt.jobs.ingest import IngestOptions, served_by
from zckpt.jobs.reads import SourceRead, band_bytes_of, source_reads
from zckpt.jobs.transform import (
    TransformOptions,
    _fingerprint,
    check_jobs,
    is_single_stage_conversion,
    plan_transform,
    refuse_remote_iteration,
    refuse_source_unsupplied,
    source_major_groups,
)
from zckpt.plan.values import RankExport, Slice
from zckpt.run.choose import planned_tasks, takes_helper
from zckpt.sources.discovery import open_source
from zckpt.sources.prepare import prepare_ingest, store_source
from zckpt.sources.replicas import compare_replicas, merged, replica_jobs
from zckpt.store import packed
from zckpt.store.geometry import ChunkInfo
from zckpt.store.layout_choice import StoreLayout, resumable_layout, store_layout
from zckpt.store.locking import remote_lock_held, remote_store_lock_of
from zckpt.store.reader import StoreReader, check_coverage
from zckpt.store.rerun import to_redo, unsealed
from zckpt.store.store import Store
from zckpt.write.destinations import OutputDir, free_space, output_dir, refuse_present
from zckpt.write.group_writer import regions
from zckpt.write.safetensors_file import no_safetensors_form, string_metadata
from zckpt.write.safetensors_rank import part_name, split_parts, stem
from zckpt.write.writers import OUTPUTS, source_major

if TYPE_CHECKING:
    from zckpt.jobs.transform import TransformPlan
    from zckpt.sources.strategies import StrategyArg


@dataclass(frozen=True)
class PlannedFile:
    """One file the run would write (or keep: already complete from an interrupted run)."""

    rank: int
    path: str
    bytes: int
    """Its size once written."""
    data: int
    """Tensor bytes it holds."""
    tensors: int
    sources: tuple[SourceRead, ...] = ()
    kept: bool = False
    read_data: int | None = None
    """Data bytes read for it, where that is not its own data: written source-major, a group's
    reads go with its first file (:func:`grouped_files`)."""
    group: int | None = None
    """The source-major group it is written in (a task of the run: the groups are cut for the
    tasks the run runs at once); ``None``: written on its own."""

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank if self.rank >= 0 else None, "path": self.path, "bytes": self.bytes,
                "data_bytes": self.data,
                "tensors": self.tensors, "kept": self.kept, "group": self.group,
                "sources": [{"rank": s.rank, "path": s.path, "bytes": s.bytes, "read": s.read} for s in self.sources]}


@dataclass(frozen=True)
class DryRunReport:
    """What a run would do: its files (or store), the bytes it reads and writes, whether
    the filesystem has room."""

    command: str
    target: str
    """The output directory or the store."""
    files: tuple[PlannedFile, ...]
    bytes_to_write: int
    """Bytes of the files written (ingest: tensor data written into the store)."""
    bytes_to_read: int
    """Data bytes read (ingest: read from the sources; export: from the store)."""
    bytes_read: int
    """Bytes read from the files for them (whole rows where a slice takes part of a row)."""
    bytes_compared: int
    """Source bytes compared between replicas (as the real run counts them)."""
    space_needed: int
    free_bytes: int | None
    """Free space of the filesystem that would receive the files (None: unknown, a URL)."""
    state: str = "new"
    """``new``; ``resume`` (an interrupted run of the same job: only what is missing is
    written); ``complete`` (nothing to do)."""
    notes: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.free_bytes is None or self.space_needed <= self.free_bytes

    def to_json(self) -> dict[str, Any]:
        return {"dry_run": True, "command": self.command, "target": self.target, "state": self.state,
                "files": [f.to_json() for f in self.files], "bytes_to_write": self.bytes_to_write,
                "bytes_to_read": self.bytes_to_read, "bytes_read": self.bytes_read,
                "bytes_compared": self.bytes_compared, "space_needed": self.space_needed,
                "free_bytes": self.free_bytes, "fits": self.fits, "notes": list(self.notes)}

    def lines(self, size: Callable[[float], str]) -> list[str]:
        out = [f"dry run of {self.command} into {self.target} ({self.state}): nothing written"]
        for f in self.files:
            what = "kept (complete)" if f.kept else f"{size(f.bytes)} to write"
            who = "store" if f.rank < 0 else f"rank {f.rank}"
            group = "" if f.group is None else f", source-major group {f.group}"
            out.append(f"  {who}: {f.path}: {what}, {f.tensors} tensors{group}")
            for s in f.sources:
                more = f" ({size(s.read)} read)" if s.read != s.bytes else ""
                out.append(f"    reads {size(s.bytes)}{more} from rank {s.rank}: {s.path}")
        if self.state == "complete":
            out.append("already complete: nothing to do")
        read = f" ({size(self.bytes_read)} read)" if self.bytes_read != self.bytes_to_read else ""
        compare = f", {size(self.bytes_compared)} to compare with replicas" if self.command != "export" else ""
        out.append(f"total: {size(self.bytes_to_write)} to write, {size(self.bytes_to_read)} of data to read{read}"
                   f"{compare}")
        free = "unknown (a URL)" if self.free_bytes is None else size(self.free_bytes)
        out.append(f"space needed: {size(self.space_needed)}, free: {free}: "
                   + ("enough" if self.fits else "NOT ENOUGH"))
        out.extend(self.notes)
        return out

    def refusal(self) -> DiskFullError | None:
        """The error of a run that would fill the disk (the real run fails with a full disk)."""
        if self.fits:
            return None
        return DiskFullError(f"not enough free space: the run writes {self.space_needed} bytes, the filesystem has "
                             f"{self.free_bytes} free", path=self.target)


# --- file sizes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Entries:
    """What a destination file's size depends on besides the slices: each entry's kind and
    type, string values, MapParameter body lengths."""

    kinds: Mapping[str, str]
    ms_types: Mapping[str, str]
    strings: Mapping[str, str]
    map_lengths: Mapping[str, int]


def ckpt_bytes(rank: RankExport, entries: Entries, crc: bool) -> int:
    """Size of the ``.ckpt`` file :class:`zckpt.write.ckpt_rank.CkptRankWriter` writes for ``rank``."""
    total = 0
    for s in rank.slices:
        kind = entries.kinds[s.name]
        if kind == "str":
            total += len(string_value(s.name, entries.strings[s.name]))
        elif kind == "map":
            total += len(map_header(s.name, entries.map_lengths[s.name])) + entries.map_lengths[s.name]
        else:
            total += sum(len(h) + n for h, n in tensor_values(s.name, entries.ms_types[s.name], s.box.shape))
    return total + (len(CRC_MAGIC) + 10 if crc else 0)


def safetensors_files(rank: RankExport, target: Path, entries: Entries, options: ExportOptions) -> list[tuple[Path,
                                                                                                            int]]:
    """The files :class:`zckpt.write.safetensors_rank.SafetensorsRankWriter` writes for ``rank``, with their
    sizes: one file, or its parts and their index."""

    tensors = [TensorHeader(s.name, entries.ms_types[s.name], s.box.shape) for s in rank.slices
               if entries.kinds[s.name] == "tensor"]
    meta = string_metadata({s.name: entries.strings[s.name] for s in rank.slices if entries.kinds[s.name] == "str"})
    parts = split_parts(tensors, options.max_file_bytes)
    out: list[tuple[Path, int]] = []
    for i, part in enumerate(parts):
        part_meta = dict(meta if i == 0 else MS_METADATA)
        if options.crc:
            part_meta["crc_num"] = _FILLER
        path = target if len(parts) == 1 else target.with_name(part_name(stem(target), i, len(parts)))
        out.append((path, len(header_bytes(part, part_meta)[0]) + sum(t.nbytes for t in part)))
    if len(parts) > 1:
        doc = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
               "weight_map": {t.name: p.name for (p, _), part in zip(out, parts, strict=True) for t in part}}
        text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
        out.append((target.with_name(stem(target) + INDEX_SUFFIX), len(text.encode("utf-8"))))
    return out


def _data_bytes(rank: RankExport, entries: Entries) -> int:
    return sum(s.box.size * ms_dtype(entries.ms_types[s.name]).storage.itemsize for s in rank.slices
               if entries.kinds[s.name] == "tensor")


def planned_files(jobs: Sequence[tuple[RankExport, Path]], todo: Sequence[tuple[RankExport, Path]], entries: Entries,
                  options: ExportOptions, reads: Callable[[RankExport], tuple[SourceRead, ...]]) -> list[PlannedFile]:
    """Every destination file of ``jobs``: those of ``todo`` to write, the others kept."""
    pending = {p for _, p in todo}
    out = []
    for r, p in jobs:
        tensors = sum(1 for s in r.slices if entries.kinds[s.name] == "tensor")
        kept = p not in pending  # complete files of this same plan: the size it gives
        got = () if kept else reads(r)
        files = safetensors_files(r, p, entries, options) if options.format == "safetensors" else \
            [(p, ckpt_bytes(r, entries, options.crc))]
        for i, (path, n) in enumerate(files):  # the data and what it reads go with the first file
            out.append(PlannedFile(r.rank, str(path), n, _data_bytes(r, entries) if i == 0 else 0,
                                   tensors if i == 0 else 0, got if i == 0 else (), kept=kept))
    return out


# --- output directories -------------------------------------------------------------------


def _safetensors_jobs(jobs: list[tuple[RankExport, Path]], maps: Sequence[str], advice: str, overwrite: bool,
                      dest: OutputDir, fingerprint: Callable[[list[tuple[RankExport, Path]]], str]
                      ) -> tuple[list[tuple[RankExport, Path]], list[tuple[RankExport, Path]]]:
    """The ``.safetensors`` files an export or a transform would write for ``jobs``, and those
    of them it would write now, decided as the run decides: a MapParameter entry (``maps``)
    has no safetensors form; files already there are kept when they are this same run's,
    finished (``fingerprint`` of the jobs, :meth:`OutputDir.finished_as_recorded`), else
    refused without ``overwrite``; rank folders must be folders."""
    if maps:
        raise no_safetensors_form(maps[0], advice)
    named = [(r, p.with_suffix(OUTPUTS["safetensors"].suffix)) for r, p in jobs]
    if not overwrite:
        clash = dest.present(named)
        if clash and dest.finished_as_recorded(fingerprint(named)):
            return named, []
        refuse_present(clash)
    dest.check_folders(p for _, p in named)
    return named, named


# --- the three commands -------------------------------------------------------------------


def _refuse_iteration(format: str) -> None:
    if format == "mindformers":
        raise UsageError("--dry-run does not describe a MindFormers iteration yet: run without it (a failed run "
                         "leaves no iteration behind)")


def dry_run_transform(
    src: str | Path, out_dir: str | Path, src_strategy: StrategyArg = None, dst_strategy: StrategyArg = None, *,
    ranks: Iterable[int] | None = None, options: TransformOptions | None = None,
) -> DryRunReport:
    """:func:`zckpt.jobs.transform.transform` up to its first write."""

    options = options if options is not None else TransformOptions()
    _refuse_iteration(options.format)
    if options.format not in ("ckpt", "safetensors"):
        raise UsageError(f"unknown output format {options.format!r} (ckpt or safetensors)")
    dest = output_dir(out_dir, options.storage_options)
    refuse_remote_iteration(options.format, dest)
    plan = plan_transform(src, src_strategy, dst_strategy, ranks, verify_crc=options.verify_crc,
                          file_suffix=options.file_suffix, choice_func=options.choice_func,
                          storage_options=options.storage_options)
    options = replace(options, choice_func=None)
    per_stage = options.per_stage or is_single_stage_conversion(plan.src_strategy, plan.dst_strategy)
    options = replace(options, per_stage=per_stage)
    if not per_stage:
        refuse_source_unsupplied(plan, src)
    dest.probe()
    jobs = stage_jobs({t.name: t.stages for t in plan.source.tensors}, plan.export, dest.path, options)
    if options.format == "safetensors":
        maps = [t.name for t in plan.source.tensors if t.kind == "map"]
        base = _fingerprint(plan, jobs, options)  # the run's: over the .ckpt names
        jobs, todo = _safetensors_jobs(jobs, maps, "write .ckpt", options.overwrite, dest,
                                       lambda _: safetensors_fingerprint(base, options))
    else:
        todo = dest.would_write(jobs, _fingerprint(plan, jobs, options), options.overwrite)
    checks = check_jobs(plan, {n for r, _ in todo for n in r.names}, options.verify_replicas)
    if options.scheduler is None and options.workers == 1 and not options.verify_replicas:
        checks = merged(checks)
    compared = sum(compare_replicas(j, options) for j in checks)
    band = band_bytes_of(options.block_bytes, options.overlap, options)
    entries = _source_entries(plan, {n for r, _ in jobs for n in r.names}, options.storage_options)
    files = planned_files(jobs, todo, entries, options, lambda r: source_reads(plan, r, band))
    local = dest.local and not any(remote.is_remote(str(p)) for p in plan.source.rank_files.values())
    helper = takes_helper(options, helper_possible=local and len(todo) > 1,
                          ranks=max(len(plan.source.rank_files), len(todo)),
                          nbytes=sum(f.data for f in files if not f.kept))
    cut = source_major_groups(plan, [r for r, _ in todo], options, planned_tasks(options, helper=helper)) \
        if local else None  # as the run: source-major groups write local files in place

    def group_reads(ranks: list[RankExport]) -> tuple[int, tuple[SourceRead, ...]]:
        regs = regions(ranks, dict(entries.kinds))
        got = source_reads(plan, RankExport(-1, tuple(Slice(g.name, g.box) for g in regs)), band)
        return sum(s.bytes for s in got), got

    files = [replace(f, path=dest.target(f.path)) for f in grouped_files(files, todo, cut, group_reads)]
    return _report("transform", dest.url, files, compared, dest.free_space())


def _source_entries(plan: TransformPlan, names: set[str], storage_options: remote.StorageOptions) -> Entries:
    """The entries' kinds and types, and the string values and map lengths the files hold
    (read from the source files that hold them)."""

    specs = {t.name: t for t in plan.source.tensors}
    strings: dict[str, str] = {}
    maps: dict[str, int] = {}
    for w in plan.source.writes:
        kind = specs[w.name].kind
        if w.name in names and kind in ("str", "map") and w.name not in strings and w.name not in maps:
            with open_source(plan.source.rank_files[w.rank], storage_options, verify_crc=False) as r:
                if kind == "str":
                    strings[w.name] = r.string(w.name)
                else:
                    maps[w.name] = len(r.map_bytes(w.name))
    return Entries({n: t.kind for n, t in specs.items()}, {n: t.ms_type for n, t in specs.items()}, strings, maps)


def _report(command: str, target: str, files: list[PlannedFile], compared: int, free: int | None,
            state: str = "new", notes: tuple[str, ...] = ()) -> DryRunReport:
    """The totals of ``files`` (those kept aside): a file whose sources are not listed (an
    export's, read from the store) reads its data."""
    todo = [f for f in files if not f.kept]
    written = sum(f.bytes for f in todo)
    data = [f.data if f.read_data is None else f.read_data for f in todo]
    read = sum(sum(s.read for s in f.sources) if f.sources else d for f, d in zip(todo, data, strict=True))
    return DryRunReport(command, target, tuple(files), written, sum(data), read, compared, written,
                        free, state, notes)


def grouped_files(files: list[PlannedFile], todo: Sequence[tuple[RankExport, Path]], cut: list[list[int]] | None,
                  reads: Callable[[list[RankExport]], tuple[int, tuple[SourceRead, ...]]]) -> list[PlannedFile]:
    """``files`` as written source-major in the groups ``cut`` (positions in ``todo``), as the
    real run would: each file says its group, whose data bytes and source reads (``reads``) go
    with its first file."""
    if cut is None:
        return files
    where = {f.path: i for i, f in enumerate(files)}
    out = list(files)
    for n, g in enumerate(cut):
        data, sources = reads([todo[i][0] for i in g])
        for k, i in enumerate(g):
            at = where[str(todo[i][1])]
            out[at] = replace(out[at], sources=sources if k == 0 else (), read_data=data if k == 0 else 0, group=n)
    return out


def dry_run_export(
    store_path: str | Path, out_dir: str | Path, strategy: StrategyArg = None, *,
    ranks: Iterable[int] | None = None, options: ExportOptions | None = None,
) -> DryRunReport:
    """:func:`zckpt.jobs.export.export` up to its first write (the store is read, not locked)."""

    options = options if options is not None else ExportOptions()
    _refuse_iteration(options.format)
    if options.format not in ("ckpt", "safetensors"):
        raise OutputError(f"unknown output format {options.format!r} (ckpt or safetensors)")
    so = options.storage_options
    if not (isinstance(store_path, str) and remote.is_remote(store_path)):
        where = remote.local_path(store_path)
        probe_store(where, shared=True)
    store = Store.open(store_path, storage_options=so)
    store.check_integrity()
    plan = plan_export(store, strategy, ranks, so, require_supplied=not options.per_stage)
    check_coverage(store, plan)
    dest = output_dir(out_dir, so)
    dest.probe()
    jobs = output_jobs(store, plan, dest.path, options)
    entries = _store_entries(store)
    if options.format == "safetensors":
        maps = [s.name for r in plan.ranks for s in r.slices if entries.kinds[s.name] == "map"]
        jobs, todo = _safetensors_jobs(
            jobs, maps, "export this store as .ckpt", options.overwrite, dest,
            lambda named: safetensors_fingerprint(export_fingerprint(store, named, options), options))
    else:
        todo = dest.would_write(jobs, export_fingerprint(store, jobs, options), options.overwrite)
        if options.reader not in ("zarr", "dask"):
            raise OutputError(f"unknown reader {options.reader!r} (zarr or dask)")
    files = planned_files(jobs, todo, entries, options, lambda r: ())
    local = store.location is None and dest.local
    nbytes = sum(f.data for f in files if not f.kept)
    sources = len((store.manifest.get("source") or {}).get("rank_files") or {})
    helper = options.format == "ckpt" and takes_helper(options, helper_possible=local and len(todo) > 1,
                                                       nbytes=nbytes, ranks=sources)
    cut = source_major(StoreReader(store, options), [r for r, _ in todo], options,
                       planned_tasks(options, helper=helper)) if local else None

    def group_reads(ranks: list[RankExport]) -> tuple[int, tuple[SourceRead, ...]]:
        regs = regions(ranks, dict(entries.kinds))
        return sum(g.box.size * ms_dtype(entries.ms_types[g.name]).storage.itemsize for g in regs), ()

    files = [replace(f, path=dest.target(f.path)) for f in grouped_files(files, todo, cut, group_reads)]
    return _report("export", dest.url, files, 0, dest.free_space(),
                   notes=(f"reads from store {store.url}; checksum checks read up to one checksum block more at "
                          "each end of a range",))


def _store_entries(store: Store) -> Entries:
    kinds, types, strings, maps = {}, {}, {}, {}
    for e in store.entries():
        kinds[e.name], types[e.name] = e.kind, e.ms_type
        if e.kind == "str":
            strings[e.name] = e.value or ""
        elif e.kind == "map":
            maps[e.name] = int(math.prod(e.shape))
    return Entries(kinds, types, strings, maps)


@dataclass(frozen=True)
class _IngestState:
    state: str
    done: frozenset[int] = field(default_factory=frozenset)


def _ingest_state(target: str | Path, fingerprint: str, overwrite: bool, required: Set[int],
                  rank_files: Mapping[int, str], storage_options: remote.StorageOptions) -> _IngestState:
    """What :func:`zckpt.store.locking.open_for_ingest` would find, refusing what it refuses,
    opening the store read-only."""

    if isinstance(target, str):  # a URL
        children = remote.listdir(remote.locate(target, storage_options, StoreError), StoreError)
        present, is_store = bool(children), ("zarr.json", False) in children
        empty_dir = False
    else:
        present, is_store = target.exists(), (target / "zarr.json").is_file()
        empty_dir = target.is_dir() and not any(target.iterdir())
    if present and not overwrite:
        try:
            existing = Store.open(target, storage_options=storage_options)
        except StoreError:
            if empty_dir:
                return _IngestState("new")
            raise StoreError("exists and is not a zckpt store (--overwrite replaces it)", path=target) from None
        found = existing.manifest.get("fingerprint")
        if found == fingerprint:
            redone = to_redo(existing, required, rank_files)
            if existing.complete and not redone and not unsealed(existing):
                return _IngestState("complete")
            return _IngestState("resume", frozenset(set(existing.ingested_ranks()) - set(redone)))
        if found is None and not existing.complete:
            return _IngestState("new")
        raise StoreError("store already exists and holds a different ingest (--overwrite replaces it)", path=target)
    if present and overwrite and not (is_store or empty_dir):
        what = "a location" if isinstance(target, str) else "a directory"
        raise StoreError(f"refusing to overwrite {what} that is not a zarr store", path=target)
    return _IngestState("new")


def _probe_store_lock(target: str | Path, storage_options: remote.StorageOptions, shared: bool) -> None:
    """The ingest's lock on the store: held by another run, the run would stop there."""

    if isinstance(target, Path):
        probe_store(target, shared=shared)
        return
    lock = remote_store_lock_of(target, storage_options)
    if remote.isfile(lock, StoreError):
        raise remote_lock_held(lock)


def store_file_bytes(layout: StoreLayout) -> int:
    """Bytes of the chunk, shard and packed files a store of ``layout`` holds (its JSON
    metadata and progress records aside)."""

    slots = layout.packing.slots if layout.packing is not None else {}
    total = 0
    for t in layout.tensors:
        if t.kind == "str" or t.name in slots:
            continue
        itemsize = 1 if t.kind == "map" else ms_dtype(t.ms_type).storage.itemsize
        info = ChunkInfo(t.shape, layout.chunks[t.name], True, ".", None, layout.shards.get(t.name), itemsize)
        if info.per_shard is None:
            total += math.prod(info.grid_counts()) * info.inner_bytes
            continue
        for shard in np.ndindex(*info.shard_count()):
            data, index = info.shard_layout(shard)
            total += data + len(index)
    for pack in layout.packing.arrays if layout.packing is not None else ():
        total += sum(n for _, n in packed.chunk_files(pack))
    return total


def dry_run_ingest(src: str | Path | Mapping[int, str | Path], store_path: str | Path, strategy: StrategyArg = None,
                   options: IngestOptions | None = None) -> DryRunReport:
    """:func:`zckpt.jobs.ingest.ingest` up to its first write: the store is opened read-only."""

    options = options if options is not None else IngestOptions()
    so = options.storage_options
    prepared = prepare_ingest(
        src, strategy, require_complete=options.require_complete, verify_crc=options.verify_crc,
        storage_options=so, file_suffix=options.file_suffix, choice_func=options.choice_func,
        block_bytes=options.block_bytes)
    plan, smap = prepared.plan, prepared.strategy
    options = replace(options, choice_func=None)
    target: str | Path = store_path if isinstance(store_path, str) and remote.is_remote(store_path) else \
        remote.local_path(store_path)
    values = store_source(plan, smap, so)
    layout = store_layout(plan, options, values.strings, values.map_sizes, values.record,
                          sharded=isinstance(target, Path), served=served_by(plan, options))
    if isinstance(target, Path):
        layout = resumable_layout(target, layout, options.overwrite)
    required = set(plan.ranks_to_read(verify_replicas=False))
    found = _ingest_state(target, layout.fingerprint(), options.overwrite, required, plan.rank_files, so)
    _probe_store_lock(target, so, shared=found.state == "complete")  # a no-op rerun only reads
    specs = {t.name: t for t in layout.tensors}
    reads: list[SourceRead] = []
    compared = 0
    notes: list[str] = []
    if found.state != "complete":
        for rank in plan.ranks_to_read(verify_replicas=options.verify_replicas):
            if rank in found.done:
                continue
            n = sum(w.box.size * ms_dtype(specs[w.name].ms_type).storage.itemsize if specs[w.name].kind == "tensor"
                    else math.prod(specs[w.name].shape) for w in plan.writes_of(rank) if specs[w.name].kind != "str")
            if n:
                reads.append(SourceRead(rank, str(plan.rank_files[rank]), n, n))
        if all(isinstance(f, Path) or not remote.is_remote(f) for f in plan.rank_files.values()):
            jobs = replica_jobs(plan, prepared.indexes, None, options.verify_replicas)
            compared = sum(compare_replicas(j, options) for j in jobs)
        else:
            notes.append("sources at URLs: their replicas are compared with the store once written, not here")
    written = sum(s.bytes for s in reads)
    files = [PlannedFile(-1, str(target), written, written, len(plan.tensors), tuple(reads))]
    space = store_file_bytes(layout) if found.state == "new" else written
    notes.append(f"store files: {store_file_bytes(layout)} bytes of chunks (and JSON metadata)")
    if plan.ignored_ranks:
        notes.append(f"ignored rank file(s) outside the strategy's stages: {list(plan.ignored_ranks)}")
    free = free_space(target) if isinstance(target, Path) else None
    report = _report("ingest", str(target), files, compared, free, found.state, tuple(notes))
    return replace(report, space_needed=space)
