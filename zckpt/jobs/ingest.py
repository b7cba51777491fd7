"""Ingest: stream MindSpore source shards into a global-coordinate Zarr store.

Each source rank's file is mapped and its boxes are written chunk run by chunk run (whole
chunks only, so nothing is ever read back and rewritten): in a local store each run is one
byte range of a chunk or shard file, copied file to file when the source holds it in one
piece; tensor data in flight is bounded by ``block_bytes`` whatever the model size.
Replicated copies are written once; unlisted tensors held by several ranks are compared
byte for byte, because a difference means the strategy hides a sharded tensor.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import DiskFullError, SourceError, StoreError, UsageError, ZckptError
from zckpt.core.layout import Box, c_order_pieces, tiles
from zckpt.formats.entries import EntryInfo
from zckpt.formats.rank_files import RankFileChoice
from zckpt.formats.shard_reader import ShardReader
from zckpt.formats.strategy import StrategyMap
from zckpt.io import fileio, locks, remote, safe_paths
from zckpt.io.checksums import BLOCK_BYTES, BlockSummer, block_sums, crc32c, file_sums
from zckpt.io.fileio import SharedFiles, WriteBehind, as_disk_full, copy_range_at, write_at
from zckpt.plan.ingest_plan import build_ingest_plan
from zckpt.plan.values import IngestPlan, ReplicaCheck, TensorSpec, Write
from zckpt.run.collect import fewer_collections
from zckpt.run.engines import Engine, dask_client, run_all, wants_overlap
from zckpt.run.helper import Helper, hand_over, overlap_beside
from zckpt.run.helper import start as start_helper_process
from zckpt.run.progress import Report, Ticker
from zckpt.sources.discovery import SourceFile, SourceSet, check_rank_map, discover_sources, open_source
from zckpt.sources.layouts import implied_strategy
from zckpt.sources.partial_inputs import left_behind, partial_record, refuse_stageless
from zckpt.sources.replicas import CheckJob, compare_replicas, replica_jobs, sample_boxes, spot_checks
from zckpt.sources.strategies import StrategyArg, load_strategy
from zckpt.sources.unsharded import SameModel, check_same_model
from zckpt.store import integrity, packed, rerun
from zckpt.store.records import GROUP_VERSION, regroup_local

if TYPE_CHECKING:  # imported where used: the direct path plans with this module and never needs Zarr
    from zckpt.store.geometry import ChunkInfo, Run
    from zckpt.store.manifest import EntryRecord
    from zckpt.store.store import Store

MiB = 1024 * 1024


@dataclass(frozen=True)
class IngestOptions:
    """Knobs of an ingest run; defaults suit a laptop and a 24 GiB host alike."""

    chunk_bytes: int = 64 * MiB
    shard_bytes: int = 256 * MiB
    """Local stores: chunks are grouped into shard files of about this size (at least one
    row of chunks each); 0 keeps one file per chunk (format 3's layout). Remote stores keep
    one object per chunk (docs/store-format.md)."""
    block_bytes: int = 128 * MiB
    verify_replicas: bool = False
    overwrite: bool = False
    require_complete: bool = True
    verify_crc: bool = True
    workers: int = 1
    processes: bool = False
    """Local workers (``workers`` > 1) as processes instead of threads of this process."""
    scheduler: str | None = None
    progress: bool | str = False
    """Progress on stderr: ``"bars"`` (or ``True``), ``"json"`` (one JSON object per line),
    ``"off"`` (or ``False``); per task (rank) and parameter, wherever the tasks run."""
    storage_options: Mapping[str, Any] | None = None
    """fsspec filesystem options for every URL involved (``endpoint_url``, ``key``, ...)."""
    pack_bytes: int = packed.PACK_BYTES
    """Local stores: tensors up to this size that one source rank holds whole are packed
    into one array per data type (:mod:`zckpt.store.packed`); 0 gives each its own array."""
    pack_count: int = packed.PACK_COUNT
    """Small tensors are packed only when there are at least this many."""
    checksum_block_bytes: int = BLOCK_BYTES
    """Each chunk's CRC-32C is recorded per block of this size (zckpt.io.checksums)."""
    file_suffix: str | None = None
    """MindSpore's ``file_suffix``: in each ``rank_<r>`` directory only the checkpoint file
    ending in ``<file_suffix>.ckpt`` (or ``.safetensors``) counts (see
    :func:`zckpt.formats.rank_files.choose_rank_file`)."""
    choice_func: Callable[[str], bool] | None = None
    """MindSpore's ``choice_func``: called with each entry name, ``False`` leaves the entry out
    of the store (it is never read)."""
    helper: bool | None = None
    """Copy part of the ranks in a second process (:mod:`zckpt.run.helper`) while this one copies
    the others, both on this machine. ``None`` (auto): for a local job of at least
    :data:`zckpt.run.helper.HELPER_BYTES` with a core to spare and no Dask cluster."""
    overlap: bool | None = None
    """Each task copies chunk files on two threads, so that one chunk is read while another
    is written. ``None`` (auto): only when every host runs fewer tasks at once than it has
    cores (:func:`zckpt.run.engines.overlap_for`)."""


@dataclass
class _RankSums:
    """Per-block CRC-32C of the chunks one source rank writes, gathered while it writes
    them (``{entry: {chunk key: [sum per block]}}``), and of the runs it writes into shard
    files (``{entry: {shard key: [(offset, length, [sum per block]), ...]}}``)."""

    block_bytes: int
    chunks: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    runs: dict[str, dict[str, list[tuple[int, int, list[int]]]]] = field(default_factory=dict)

    def of(self, name: str) -> dict[str, list[int]]:
        return self.chunks.setdefault(name, {})

    def add(self, done: _Written, sharded: bool) -> None:
        name, key, offset, length, sums = done
        if sharded:
            self.runs.setdefault(name, {}).setdefault(key, []).append((offset, length, sums))
        else:
            self.of(name)[key] = sums


@dataclass(frozen=True)
class IngestReport:
    store: str
    ranks_read: tuple[int, ...]
    tensors: int
    bytes_written: int
    bytes_compared: int
    seconds: float
    complete: bool
    uncovered: Mapping[str, tuple[tuple[Box, tuple[int, ...]], ...]]
    ignored_ranks: tuple[int, ...] = ()
    resumed: bool = False
    rank_files: Mapping[int, str] = field(default_factory=dict)
    """The source file read for each rank."""
    file_choices: Mapping[int, RankFileChoice] = field(default_factory=dict)
    """Ranks whose directory held several checkpoint files: which was chosen, among which, and why."""
    same_as_rank0: tuple[int, ...] = ()
    """Without a source strategy: the other rank files, found byte-identical to rank 0's."""
    left_behind: Mapping[str, Any] = field(default_factory=dict)
    """Pipeline stages, ranks and parameters of rank files outside the strategy's stages (not ingested)."""
    redone: Mapping[int, str] = field(default_factory=dict)
    """Source ranks ingested before whose file changed since, or whose progress record was
    missing or damaged (``{rank: why}``): their writes were done again."""
    already_complete: bool = False
    """The store already held this whole ingest: nothing was read or written."""
    store_ranks: tuple[int, ...] = ()
    """The source ranks the store was ingested from (those read, unless already complete)."""


def resolve_sources(
    src: str | Path | Mapping[int, str | Path], storage_options: remote.StorageOptions = None,
    file_suffix: str | None = None,
) -> SourceSet:
    if isinstance(src, Mapping):
        if file_suffix is not None:
            raise UsageError("file_suffix chooses files in rank directories; it does not apply to a {rank: file} map")
        return SourceSet(check_rank_map(src, storage_options))
    return discover_sources(src, storage_options, file_suffix)


def entry_filter(choice_func: Callable[[str], bool] | None) -> Callable[[str], bool] | None:
    """MindSpore's ``choice_func`` as a predicate that insists on a bool (a str would rename the
    entry in MindSpore's ``unified_safetensors``, which ingest does not do)."""
    if choice_func is None:
        return None
    if not callable(choice_func):
        raise TypeError(f"The choice_func should be callable, but got {type(choice_func).__name__}.")

    def keep(name: str) -> bool:
        out = choice_func(name)
        if not isinstance(out, bool):
            raise UsageError(f"choice_func must return a bool, got {type(out).__name__} (renaming entries is not "
                             "supported at ingest)", param=name)
        return out

    return keep


def read_indexes(
    files: Mapping[int, SourceFile], *, verify_crc: bool, storage_options: remote.StorageOptions = None,
    while_reading: Callable[[], object] | None = None,
    before_reading: Callable[[Mapping[int, SourceFile]], object] | None = None,
) -> dict[int, dict[str, EntryInfo]]:
    """Every source file's index. ``while_reading`` runs once the kernel was asked to read the
    files (:func:`zckpt.io.fileio.read_soon`), before they are walked: work that can wait for
    the disk at the same time (ingest imports Zarr there). Files too large to be read ahead
    whole are walked sparsely: only the pages of their headers come from the disk.
    ``before_reading`` is given the files first (ingest starts its helper process there)."""
    out: dict[int, dict[str, EntryInfo]] = {}
    if before_reading is not None:
        before_reading(files)
    local = [p for p in files.values() if isinstance(p, Path)]
    sparse = bool(local) and not fileio.read_soon(local)  # headers lie between payloads
    if while_reading is not None:
        while_reading()
    for rank, path in files.items():
        with open_source(path, storage_options, verify_crc=verify_crc, sparse=sparse) as r:
            out[rank] = dict(r.entries)
    return out


def relevant_ranks(files: Mapping[int, SourceFile], smap: StrategyMap | None) -> dict[int, SourceFile]:
    """The source files the strategy describes: rank 0 alone without a strategy (the full
    model), else the ranks of the pipeline stages the strategy lists (a single stage's
    strategy file converts that stage only, as in MindSpore's per-stage conversion)."""
    if smap is None:
        return {r: p for r, p in files.items() if r == 0}
    stage_dev = smap.stage_device_num()
    stages = set(smap.stages)
    return {r: p for r, p in files.items() if r // stage_dev in stages}


def _refuse_foreign_strategy(
    smap: StrategyMap,
    found: Mapping[int, SourceFile],
    files: Mapping[int, SourceFile],
    indexes: Mapping[int, Mapping[str, object]],
    storage_options: remote.StorageOptions = None,
) -> None:
    """Refuse a strategy that describes fewer devices than the job that wrote the files.

    Rank files beyond the strategy's stages are normally another pipeline stage's (other
    parameters). When the first of them holds every parameter the strategy lists, they are
    more ranks of the same stage: reading only the described ranks as the whole job would
    make every global shape wrong.
    """
    ignored = sorted(set(found) - set(files))
    if not ignored or not files:
        return
    listed = set(smap.layouts) & set(indexes[min(files)])
    if not listed:
        return
    with open_source(found[ignored[0]], storage_options, verify_crc=False) as r:
        held = set(r.entries)
    if listed <= held:
        raise SourceError(
            f"the strategy describes {smap.device_num()} device(s), but rank file(s) {ignored} beyond them hold "
            f"the same {len(listed)} parameter(s): the strategy belongs to a smaller job than these shards",
            path=", ".join(smap.sources) or None,
        )


@dataclass(frozen=True)
class PreparedIngest:
    """A plan with what was decided about the sources on the way, for the report."""

    plan: IngestPlan
    strategy: StrategyMap | None
    sources: SourceSet
    same_model: SameModel
    indexes: Mapping[int, Mapping[str, EntryInfo]] = field(default_factory=dict)
    """The index of every source file planned from (where each entry's payload lies), so
    that readers of the shards need not parse them again."""


def plan_ingest(
    src: str | Path | Mapping[int, str | Path],
    strategy: StrategyArg,
    *,
    require_complete: bool = True,
    verify_crc: bool = True,
    storage_options: remote.StorageOptions = None,
    file_suffix: str | None = None,
    choice_func: Callable[[str], bool] | None = None,
) -> tuple[IngestPlan, StrategyMap | None]:
    p = prepare_ingest(src, strategy, require_complete=require_complete, verify_crc=verify_crc,
                       storage_options=storage_options, file_suffix=file_suffix, choice_func=choice_func)
    return p.plan, p.strategy


def prepare_ingest(
    src: str | Path | Mapping[int, str | Path],
    strategy: StrategyArg,
    *,
    require_complete: bool = True,
    verify_crc: bool = True,
    storage_options: remote.StorageOptions = None,
    file_suffix: str | None = None,
    choice_func: Callable[[str], bool] | None = None,
    block_bytes: int = 64 * MiB,
    while_reading: Callable[[], object] | None = None,
    before_reading: Callable[[Mapping[int, SourceFile]], object] | None = None,
) -> PreparedIngest:
    """Find the sources and plan the ingest. Without a strategy, rank files besides rank 0's
    must be the same model byte for byte (:mod:`zckpt.sources.unsharded`), else this refuses."""
    smap = load_strategy(strategy, storage_options)
    if smap is None:
        smap = implied_strategy(src)  # a MindFormers iteration records its own
    sources = resolve_sources(src, storage_options, file_suffix)
    found = sources.files
    keep = entry_filter(choice_func)
    same = SameModel((), 0)
    if smap is None:
        same = check_same_model(found, storage_options, block_bytes=block_bytes, keep=keep)
    files = relevant_ranks(found, smap)
    if smap is not None:
        refuse_stageless(smap, found, files, require_complete=require_complete)
    indexes = read_indexes(files, verify_crc=verify_crc, storage_options=storage_options, while_reading=while_reading,
                           before_reading=before_reading)
    left_out: set[str] = set()
    if keep is not None:
        left_out = {n for idx in indexes.values() for n in idx if not keep(n)}
        indexes = {r: {n: e for n, e in idx.items() if n not in left_out} for r, idx in indexes.items()}
    if smap is not None:
        _refuse_foreign_strategy(smap, found, files, indexes, storage_options)
    plan = build_ingest_plan(
        indexes, {r: str(p) for r, p in files.items()}, smap, require_complete=require_complete
    )
    behind = (left_behind(smap, found, files, [*(t.name for t in plan.tensors), *left_out], storage_options)
              if smap is not None else None)
    plan = replace(plan, ignored_ranks=tuple(sorted(set(found) - set(files) - set(same.ranks))),
                   left_behind=behind.to_json() if behind is not None else {}, left_out=tuple(sorted(left_out)))
    return PreparedIngest(plan, smap, sources, same, indexes)


@fewer_collections()
def ingest(
    src: str | Path | Mapping[int, str | Path],
    store_path: str | Path,
    strategy: StrategyArg = None,
    options: IngestOptions = IngestOptions(),
) -> IngestReport:
    """Build a complete store from source shards.

    Rerunning the same ingest after a crash resumes it: source ranks already written
    (a progress record, :mod:`zckpt.store.records`) are skipped, the others are rewritten, and the result is the
    store an uninterrupted run makes, byte for byte (only the ranks sharing a record file may
    differ). A store holding a different ingest is
    refused unless ``overwrite``. When the input turns out to be bad (a zckpt error), the
    incomplete store is removed; after an interruption it is kept, marked incomplete.
    """
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:  # ends the helper process, if one was started
        return _ingest(src, store_path, strategy, options, stack, t0)


def _ingest(
    src: str | Path | Mapping[int, str | Path], store_path: str | Path, strategy: StrategyArg, options: IngestOptions,
    stack: contextlib.ExitStack, t0: float,
) -> IngestReport:
    is_remote = isinstance(store_path, str) and remote.is_remote(store_path)
    helper: list[Helper] = []  # the helper process, once started

    def start_helper(files: Mapping[int, SourceFile]) -> None:
        wanted = _wants_helper(files, options, is_remote)
        started = start_helper_process(["zckpt.jobs.ingest", "zckpt.store.store"]) if wanted else None
        if started is not None:
            helper.append(stack.enter_context(started))

    prepared = prepare_ingest(
        src, strategy, require_complete=options.require_complete, verify_crc=options.verify_crc,
        storage_options=options.storage_options, file_suffix=options.file_suffix, choice_func=options.choice_func,
        block_bytes=options.block_bytes,
        # with a cold cache Zarr's import reads its own files from the disk: while the shards are read, not after
        while_reading=lambda: importlib.import_module("zckpt.store.store"),
        before_reading=start_helper,
    )
    plan, smap = prepared.plan, prepared.strategy
    options = replace(options, choice_func=None)  # applied in the plan; tasks need not carry (pickle) it
    layout = store_layout(plan, smap, options, sharded=not is_remote)
    if not is_remote:
        layout = _resumable_layout(remote.local_path(store_path), layout, plan, smap, options)
    required = set(plan.ranks_to_read(verify_replicas=False))
    found = None if is_remote or options.overwrite else \
        rerun.complete_already(remote.local_path(store_path), layout.fingerprint(), required, plan.rank_files)
    if found is not None:  # nothing to write: checked under the readers' lock, the writer's never taken
        return _report(found, prepared, (0, 0, ()), "complete", {}, t0)
    if isinstance(store_path, str) and is_remote:
        lock: contextlib.AbstractContextManager[None] = remote_store_lock(store_path, options.storage_options)
        target: str | Path = store_path
    else:
        lock, target = store_lock(remote.local_path(store_path)), remote.local_path(store_path)
    with lock:
        store, state = open_for_ingest(target, layout.fingerprint(), options.overwrite, options.storage_options)
        redone: dict[int, str] = {}
        if state != "new":
            redone = rerun.to_redo(store, required, plan.rank_files)
            if redone or (state == "complete" and rerun.unsealed(store)):
                store.unseal()
                store.forget_ranks(redone)
                state = "resume"
        try:
            if state == "new":
                store.define(layout.tensors, layout.writers, layout.chunks, layout.strings, layout.source,
                             fingerprint=layout.fingerprint(), shards=layout.shards, packing=layout.packing)
            running = helper[0] if helper else None
            done = ((0, 0, ()) if state == "complete"
                    else _run(plan, layout, store, options, prepared.indexes, running))
            if not plan.uncovered and state != "complete":
                store.mark_complete()
        except DiskFullError:
            _drop_temporaries(target)
            raise
        except ZckptError:
            store.remove()
            raise
        except OSError as err:
            full = as_disk_full(err, target)
            if full is None:
                raise
            _drop_temporaries(target)
            raise full from None
    return _report(store, prepared, done, state, redone, t0)


def _report(store: Store, prepared: PreparedIngest, done: tuple[int, int, tuple[int, ...]], state: str,
            redone: dict[int, str], t0: float) -> IngestReport:
    plan = prepared.plan
    written, compared, ranks = done
    return IngestReport(
        store=store.url,
        ranks_read=ranks,
        tensors=len(plan.tensors),
        bytes_written=written,
        bytes_compared=compared,
        seconds=time.perf_counter() - t0,
        complete=not plan.uncovered,
        uncovered=plan.uncovered,
        ignored_ranks=plan.ignored_ranks,
        resumed=state == "resume",
        rank_files={r: str(p) for r, p in prepared.sources.files.items()},
        file_choices=prepared.sources.several(),
        same_as_rank0=prepared.same_model.ranks,
        left_behind=plan.left_behind,
        redone=redone,
        already_complete=state == "complete",
        store_ranks=tuple(sorted(store.ingested_ranks())) if state == "complete" else ranks,
    )


def store_lock(path: Path) -> contextlib.AbstractContextManager[None]:
    """Hold ``<store>.lock`` exclusively (:mod:`zckpt.io.locks`): a second ingest, or an ingest
    while an export, verify or load reads the store, is refused rather than interleaved."""
    return locks.store_writing(path)


LOCK_SUFFIX = ".lock"


def remote_store_lock_of(url: str, storage_options: remote.StorageOptions) -> remote.Location:
    """Where an ingest's lock object on object storage lives: ``<store>.lock`` beside it."""
    return remote.locate(url, storage_options, StoreError).sibling(url.rstrip("/").rsplit("/", 1)[-1] + LOCK_SUFFIX)


def remote_lock_held(loc: remote.Location) -> StoreError:
    """The refusal of an ingest whose store's lock object exists, naming its holder."""
    try:
        who = remote.read_bytes(loc, StoreError).decode("utf-8", "replace")
    except StoreError:
        who = "?"
    return StoreError(f"another zckpt ingest is writing this store (lock object held by {who}); if no ingest "
                      "is running (one was killed), delete the lock object and rerun to resume", path=loc.url)


@contextmanager
def remote_store_lock(url: str, storage_options: remote.StorageOptions) -> Iterator[None]:
    """Hold ``<store>.lock`` on object storage: an object created only if absent (S3's
    conditional ``If-None-Match: *`` put, which AWS S3 and compatible servers honour; other
    fsspec filesystems check then write, which is not atomic). A lock left by a killed
    ingest is not taken over: the error says which object to delete once no ingest runs."""
    loc = remote_store_lock_of(url, storage_options)
    holder = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}).encode()
    if not remote.create_exclusive(loc, holder, StoreError):
        raise remote_lock_held(loc)
    try:
        yield
    finally:
        with contextlib.suppress(StoreError):
            remote.remove(loc, StoreError)


def open_for_ingest(
    path: str | Path, fingerprint: str, overwrite: bool, storage_options: remote.StorageOptions = None
) -> tuple[Store, str]:
    """The store to ingest into and what to do: ``"new"``, ``"resume"`` or ``"complete"``."""
    from zckpt.store.store import Store

    if isinstance(path, str):
        return _open_remote_for_ingest(path, fingerprint, overwrite, storage_options)
    if path.exists() and not overwrite:
        try:
            existing = Store.open(path, mode="r+")
        except StoreError:
            if path.is_dir() and not any(path.iterdir()):
                return Store.create(path, overwrite=True), "new"
            raise StoreError("exists and is not a zckpt store (--overwrite replaces it)", path=path) from None
        found = existing.manifest.get("fingerprint")
        if found == fingerprint:
            if existing.complete:
                return existing, "complete"
            remove_partial_files(path)
            return existing, "resume"
        if found is None and not existing.complete:
            return Store.create(path, overwrite=True), "new"  # interrupted before it held anything
        raise StoreError("store already exists and holds a different ingest (--overwrite replaces it)",
                         path=path)
    return Store.create(path, overwrite=overwrite), "new"


def _open_remote_for_ingest(
    url: str, fingerprint: str, overwrite: bool, storage_options: remote.StorageOptions
) -> tuple[Store, str]:
    """:func:`open_for_ingest` for a store at a URL (zarr's fsspec store leaves no partial
    files: every object is written whole)."""
    from zckpt.store.store import Store

    loc = remote.locate(url, storage_options, StoreError)
    present = remote.listdir(loc, StoreError)
    if present and not overwrite:
        try:
            existing = Store.open(url, mode="r+", storage_options=storage_options)
        except StoreError:
            raise StoreError("exists and is not a zckpt store (--overwrite replaces it)", path=url) from None
        found = existing.manifest.get("fingerprint")
        if found == fingerprint:
            return existing, "complete" if existing.complete else "resume"
        if found is None and not existing.complete:
            return Store.create(url, overwrite=True, storage_options=storage_options), "new"
        raise StoreError("store already exists and holds a different ingest (--overwrite replaces it)",
                         path=url)
    return Store.create(url, overwrite=overwrite, storage_options=storage_options), "new"


def _drop_temporaries(target: str | Path) -> None:
    """After a full disk: the store stays, never marked complete (a rerun resumes once space
    is freed); only the temporary files of the writes that failed are removed."""
    if isinstance(target, Path):
        remove_partial_files(target)


def remove_partial_files(root: Path) -> None:
    """Temporary files an interrupted writer left (zarr's ``*.partial``, zckpt's own
    ``*.tmp-zckpt`` of the manifest and the progress records)."""
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith((".partial", ".tmp-zckpt")):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))


@dataclass(frozen=True)
class StoreLayout:
    """Everything the store's structure depends on: arrays, writers, chunks, provenance."""

    tensors: tuple[TensorSpec, ...]
    writers: Mapping[str, tuple[tuple[int, Box], ...]]
    chunks: Mapping[str, tuple[int, ...]]
    strings: Mapping[str, str]
    source: Mapping[str, Any]
    shards: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Inner chunks per shard of every sharded array (format 4, local stores)."""
    packing: packed.PackPlan | None = None
    """Small tensors packed into one array per data type (format 5, local stores)."""
    _fingerprint: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def fingerprint(self) -> str:
        """Identity of an ingest: two runs with the same fingerprint write the same store
        (an unsharded layout keeps the fingerprint format 3 gave it, so that an ingest
        interrupted before format 4 resumes as it began). Computed once per layout."""
        if not self._fingerprint:
            self._fingerprint.append(self._digest())
        return self._fingerprint[0]

    def _digest(self) -> str:
        doc: dict[str, Any] = {
            "tensors": [[t.name, t.kind, t.ms_type, list(t.shape), list(t.stages)] for t in self.tensors],
            "writers": {n: [[r, b.to_json()] for r, b in ws] for n, ws in sorted(self.writers.items())},
            "chunks": {n: list(c) for n, c in sorted(self.chunks.items())},
            "strings": dict(sorted(self.strings.items())),
            "source": self.source,
        }
        if self.shards:
            doc["shards"] = {n: list(k) for n, k in sorted(self.shards.items())}
        if self.packing is not None and self.packing.slots:
            doc["packing"] = self.packing.to_json()
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _resumable_layout(
    path: Path, layout: StoreLayout, plan: IngestPlan, smap: StrategyMap | None, options: IngestOptions
) -> StoreLayout:
    """The layout to ingest with: the unpacked (or also unsharded) one when ``path`` holds
    this same ingest, interrupted, begun without packing (by a zckpt of format 4) or without
    shards (format 3), so that resuming finishes it as it began."""
    from zckpt.store.store import Store

    if not (layout.shards or layout.packing) or options.overwrite or not (path / "zarr.json").is_file():
        return layout
    try:
        found = Store.open(path).manifest.get("fingerprint")
    except ZckptError:
        return layout
    if found == layout.fingerprint():
        return layout
    unpacked = replace(layout, packing=None)  # a packed tensor is never sharded: shards stay
    for older in (unpacked, replace(unpacked, shards={})):
        if found == older.fingerprint():
            return older
    return layout


def store_layout(
    plan: IngestPlan, smap: StrategyMap | None, options: IngestOptions, *, sharded: bool = False
) -> StoreLayout:
    from zckpt.store.geometry import chunk_shape, shard_grid

    writers: dict[str, list[tuple[int, Box]]] = {}
    for w in plan.writes:
        writers.setdefault(w.name, []).append((w.rank, w.box))
    chunks = {}
    strings: dict[str, str] = {}
    for t in plan.tensors:
        ws = writers.get(t.name, [])
        itemsize = 1 if t.kind == "map" else max(1, t.nbytes // max(1, _count(t.shape)))
        if (len(ws) == 1 and t.shape and all(t.shape) and ws[0][1].stop == t.shape and not any(ws[0][1].start)
                and math.prod(t.shape) * itemsize <= options.chunk_bytes):
            chunks[t.name] = t.shape  # one whole box that fits a chunk (a tiny tensor): what the rule below gives
            continue
        boxes = [b for _, b in ws]
        grid = _common_grid(boxes) if boxes and t.shape else t.shape
        chunks[t.name] = chunk_shape(grid, itemsize, options.chunk_bytes)
    so = options.storage_options
    for w in [x for x in plan.writes if _kind(plan, x.name) == "str"]:
        with open_source(plan.rank_files[w.rank], so, verify_crc=False) as r:
            strings[w.name] = r.string(w.name)
    map_shapes: dict[str, int] = {}
    for mw in plan.writes:
        if _kind(plan, mw.name) == "map":
            with open_source(plan.rank_files[mw.rank], so, verify_crc=False) as r:
                map_shapes[mw.name] = len(r.map_bytes(mw.name))
    tensors = [
        t if t.kind != "map" else replace(t, shape=(map_shapes[t.name],))
        for t in plan.tensors
    ]
    for t in tensors:
        if t.kind == "map":
            chunks[t.name] = (max(1, t.shape[0]),)
            writers[t.name] = [(writers[t.name][0][0], Box.full(t.shape))]
    packing = None
    if sharded and options.pack_bytes > 0:
        packing = packed.plan_packing(tensors, writers, options.pack_bytes, options.chunk_bytes,
                                      options.pack_count)
    slots = packing.slots if packing is not None else {}
    shards: dict[str, tuple[int, ...]] = {}
    for t in tensors:
        if sharded and options.shard_bytes > 0 and t.kind == "tensor" and t.name not in slots:
            itemsize = max(1, t.nbytes // max(1, _count(t.shape)))
            per = shard_grid(t.shape, chunks[t.name], itemsize, options.shard_bytes)
            if per is not None:
                shards[t.name] = per
    return StoreLayout(
        tensors=tuple(tensors),
        writers={n: tuple(ws) for n, ws in writers.items()},
        chunks=chunks,
        strings=strings,
        source=_source_record(plan, smap, options.storage_options),
        shards=shards,
        packing=packing,
    )


@dataclass(frozen=True)
class RankJob:
    """One source rank's share of an ingest: a unit of work for any Dask worker."""

    rank: int
    path: str
    writes: tuple[Write, ...]
    checks: tuple[ReplicaCheck, ...]
    chunks: Mapping[str, tuple[int, ...]]
    nbytes: int
    check_bytes: int = 0
    """Bytes of the replicas this rank's file is compared on (the size of its verify task)."""
    shards: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Inner chunks per shard of the sharded arrays among ``chunks``."""
    target: StoreTarget | None = None
    """A local store: what the task writes into, known at plan time (it need not open the store)."""
    index: Mapping[str, EntryInfo] | None = None
    """The source file's entries as planning parsed them (local sources: not parsed again)."""
    sampled: frozenset[ReplicaCheck] = frozenset()
    """Checks of ``checks`` only spot-checked (:func:`zckpt.sources.replicas.sample_boxes`)."""


@dataclass(frozen=True)
class StoreTarget:
    """What an ingest task needs of a local store, computed once by the client: its format
    version, the entries the task writes and their chunk layouts (:meth:`Store.attach`)."""

    version: int
    entries: tuple[EntryRecord, ...]
    infos: Mapping[str, ChunkInfo]


def _wants_helper(files: Mapping[int, SourceFile], options: IngestOptions, is_remote: bool) -> bool:
    """Whether this ingest copies in two processes (:data:`IngestOptions.helper`): never for
    a remote store or a single source file."""
    from zckpt.run import helper

    if is_remote or len(files) < 2:
        return False
    if options.helper is None and not all(isinstance(p, Path) for p in files.values()):
        return False
    total = 0
    if options.helper is None:
        for p in files.values():
            with contextlib.suppress(OSError):
                total += os.stat(p).st_size
    return helper.wanted(options.helper, options.workers, options.scheduler, total, len(files))


def ingest_ranks(jobs: list[RankJob], store_path: str, options: IngestOptions, ranks: int) -> list[int]:
    """:func:`ingest_rank` of several ranks with their own shard files, write-behind and
    record thread (the helper's share; ``ranks``: how many the whole run writes, which sets
    the record groups)."""
    with _shard_files(True, ranks) as shared:
        return [ingest_rank(j, store_path, options, shared) for j in jobs]


def _run(
    plan: IngestPlan, layout: StoreLayout, store: Store, options: IngestOptions,
    indexes: Mapping[int, Mapping[str, EntryInfo]] | None = None, helper: Helper | None = None,
) -> tuple[int, int, tuple[int, ...]]:
    tensors = list(layout.tensors)
    chunks = layout.chunks
    done = store.ingested_ranks()
    ranks = plan.ranks_to_read(verify_replicas=options.verify_replicas)
    itemsizes = {t.name: t.nbytes // max(1, math.prod(t.shape)) for t in tensors}
    jobs = []
    local = not store.is_remote
    for rank in ranks:
        ws = tuple(x for x in plan.writes_of(rank) if _kind(plan, x.name) != "str")
        if rank in done:
            ws = ()
        cs = plan.checks_of(rank, verify_replicas=options.verify_replicas)
        names = {x.name for x in ws} | {c.name for c in cs}
        nbytes = sum(x.box.size * itemsizes[x.name] for x in ws)
        check_bytes = sum(c.box.size * itemsizes.get(c.name, 1) for c in cs)
        target = _target(store, layout, {x.name for x in ws}) if local else None
        index = indexes.get(rank) if indexes and local and not remote.is_remote(plan.rank_files[rank]) else None
        jobs.append(RankJob(rank, plan.rank_files[rank], ws, cs, {n: chunks[n] for n in names}, nbytes, check_bytes,
                            {n: layout.shards[n] for n in names if n in layout.shards}, target, index))
    engine = Engine.of(options)
    options = replace(options, block_bytes=engine.share(options.block_bytes))
    with dask_client(engine) as client:
        if client is not None:
            helper = None
        options = replace(options, overlap=overlap_beside(options.overlap, client, helper))
        todo = [j for j in jobs if j.rank not in done]
        with _shard_files(local and client is None, len(todo)) as shared:  # every record written when it ends
            aside = hand_over(helper if shared is not None else None, todo, [j.nbytes for j in todo], ingest_ranks,
                              store.url, options, len(todo), step=shared.group if shared is not None else 1)
            try:
                written = run_all(ingest_rank, todo, store.url, options, shared,
                                  client=client, label="ingest", size=lambda j: j.nbytes, name=_rank_name,
                                  progress=options.progress, aside=aside)
            except BaseException:
                if helper is not None:
                    helper.close()  # no more writes once this fails: the store may be removed next
                raise
        if shared is None and local and store.version >= GROUP_VERSION:  # the files one process writes
            regroup_local(store.path, [j.rank for j in todo], max(1, -(-len(todo) // RECORD_FILES)))
        if indexes and not any(isinstance(f, str) and remote.is_remote(f) for f in plan.rank_files.values()):
            checks = replica_jobs(plan, indexes, None, options.verify_replicas)  # source against source
            compared = run_all(compare_replicas, checks, options, client=client, label="verify",
                               size=lambda j: j.nbytes, name=_rank_name, progress=options.progress)
        else:
            compared = run_all(check_rank, _with_spot_checks(plan, jobs, options.verify_replicas), store.url, options,
                               dict(plan.rank_files), client=client, label="verify", size=lambda j: j.check_bytes,
                               name=_rank_name, progress=options.progress)
    store._ingested = None
    return sum(written), sum(compared), ranks


RECORD_FILES = 32
"""Progress record files an ingest run in one process aims at (format 7): each holds the
records of ``ceil(ranks / RECORD_FILES)`` ranks in a row, written once all of them are done
(a crash redoes at most that many ranks); jobs of up to 32 ranks keep one file per rank."""


@dataclass
class _InProcess:
    """What the tasks of an ingest that run in this process share: the store's shard files
    (opened once), the thread that starts writing back what they wrote, and the thread that
    writes their progress records (each group of ``group`` ranks in one file, after their
    bytes, while the next ranks are copied: creating and renaming 512 record files cost
    0.5-0.75 s of CPU at 512 ranks)."""

    files: SharedFiles
    behind: WriteBehind
    group: int = 1
    records: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "zckpt-records"))
    pending: list[Future[None]] = field(default_factory=list)
    done: list[tuple[Store, int, Callable[[], dict[str, Any]]]] = field(default_factory=list)

    def record(self, store: Store, rank: int, info: Callable[[], dict[str, Any]]) -> None:
        """Record ``rank`` done (its record is ``info()``, computed on the record thread) once
        ``group`` ranks are."""
        self.done.append((store, rank, info))
        if len(self.done) >= self.group:
            self._flush()

    def _flush(self) -> None:
        batch, self.done = self.done, []
        if batch:
            self.pending.append(self.records.submit(
                lambda: batch[-1][0].mark_ingested_many({rank: info() for _, rank, info in batch})))

    def wait_records(self) -> None:
        """Write the records of the ranks done and wait until every record is written;
        raise the first failure."""
        self._flush()
        self.records.shutdown(wait=True)
        for f in self.pending:
            f.result()


def _shard_file_limit() -> int:
    """Shard files kept open at once: a quarter of this process's descriptor limit, at most 1 024."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 64
    return 1024 if soft == resource.RLIM_INFINITY else max(16, min(1024, soft // 4))


@contextmanager
def _shard_files(in_process: bool, ranks: int = 1) -> Iterator[_InProcess | None]:
    """The store's shard files opened once for every task run in this process while the
    ingest runs, with a thread that starts writing back what the tasks wrote
    (:class:`~zckpt.io.fileio.WriteBehind`), closed after; ``False``: tasks run on a cluster and
    open their own (:func:`_task_files`)."""
    if not in_process:
        yield None
        return
    with SharedFiles(lambda p: _open_chunk_file(p, False), _shard_file_limit()) as files, \
            WriteBehind(files) as behind:
        shared = _InProcess(files, behind, max(1, -(-ranks // RECORD_FILES)))
        try:
            yield shared
        except BaseException:
            with contextlib.suppress(Exception):  # the records of ranks done still count on resume
                shared.wait_records()
            raise
        else:
            shared.wait_records()


@contextmanager
def _task_files(shared: _InProcess | None) -> Iterator[SharedFiles]:
    """The shard files a task writes through: the ingest's own in this process, else the
    task's (closed when it ends)."""
    if shared is not None:
        yield shared.files
        return
    with SharedFiles(lambda p: _open_chunk_file(p, False), _shard_file_limit()) as own:
        yield own


def _target(store: Store, layout: StoreLayout, names: set[str]) -> StoreTarget:
    """The :class:`StoreTarget` of a task writing ``names`` (layouts as the plan made them,
    or read from the store once here when it is of an older format)."""
    slots = layout.packing.slots if layout.packing is not None else {}
    for n in names:
        if n not in slots:
            store.assume_layout(n, layout.chunks[n], layout.shards.get(n))
    ordered = sorted(names)
    return StoreTarget(store.version, tuple(store.entry(n) for n in ordered),
                       {n: store.chunk_info(n) for n in ordered if n not in slots})  # packed: _write_packed


def _common_grid(boxes: list[Box]) -> tuple[int, ...]:
    """Per dimension, the gcd of every writer box's borders: chunks that divide it never
    straddle two writers, even when a dimension is split unevenly."""
    out = []
    for d in range(boxes[0].ndim):
        g = 0
        for b in boxes:
            g = math.gcd(g, math.gcd(b.start[d], b.stop[d]))
        out.append(max(1, g))
    return tuple(out)


def _rank_name(job: RankJob | CheckJob) -> str:
    return f"rank {job.rank}"


def ingest_rank(job: RankJob, store_path: str, options: IngestOptions, shared: _InProcess | None = None,
                report: Report | None = None) -> int:
    """Write one source rank's boxes into the store and mark the rank done (a Dask task;
    ``shared``: what the tasks run in the ingest's own process share)."""
    from zckpt.store.records import encode_runs
    from zckpt.store.store import Store

    if job.target is not None:
        t = job.target
        store = Store.attach(Path(store_path), t.entries, t.infos, t.version)
    else:
        store = Store.open(store_path, mode="r+", storage_options=options.storage_options)
    tiny = tuple(w for w in job.writes if store.entry(w.name).offset is not None)
    writes = tuple(w for w in job.writes if store.entry(w.name).offset is None) if tiny else job.writes
    if job.target is None:
        store.prefetch(w.name for w in writes)
        for w in writes:
            store.assume_layout(w.name, job.chunks[w.name], job.shards.get(w.name))
    written = 0
    known = _RankSums(options.checksum_block_bytes)
    with open_source(job.path, options.storage_options, verify_crc=False, index=job.index) as reader, \
            _task_files(shared) as files, \
            _ChunkCopier(reader, 2 if wants_overlap(options.overlap) else 1, files) as copier:
        source = integrity.source_identity(job.path, _descriptor(reader, job.path))  # before any byte is copied
        batch = _WriteBatch(store, options.block_bytes, reader, copier)
        ticker = Ticker(report)
        packed_runs: dict[str, dict[str, list[tuple[int, int, list[int]]]]] = {}
        for key, chunk, offset, length, sums in _write_packed(store, reader, tiny, known.block_bytes):
            packed_runs.setdefault(key, {}).setdefault(chunk, []).append((offset, length, sums))
            written += length
            ticker.add(key, length)
        whole, writes_left = _whole_chunk_copies(store, reader, writes, min(fileio.BLOCK, known.block_bytes))
        written += copier.copy_whole(whole, ticker)
        for w in writes_left:
            n = _write(batch, reader, w, job.chunks[w.name], options.block_bytes, known)
            written += n
            ticker.add(w.name, n)
        batch.flush()
        ticker.close()
        sharded: dict[str, bool] = {}
        for done in copier.finish():
            is_sharded = sharded.get(done[0])
            if is_sharded is None:
                is_sharded = sharded[done[0]] = store.chunk_info(done[0]).per_shard is not None
            known.add(done, is_sharded)
        if shared is not None:
            shared.behind.add(copier.written)
        if store.is_remote:
            _source_checksums(store, reader, job.writes, known)
    chunk_sums = _written_checksums(store, writes, known)

    def info() -> dict[str, Any]:
        """The rank's record, once its source is found unchanged since it was opened (on the
        record thread when there is one: the ends of 512 files hashed again cost 0.07 s)."""
        if integrity.source_change(source, job.path) is not None:
            raise SourceError("the source file changed while it was being read: rerun the ingest", path=job.path)
        record: dict[str, Any] = {"block_bytes": known.block_bytes, "chunks": chunk_sums}
        if known.runs:
            record["runs"] = {name: {key: encode_runs(sorted(runs)) for key, runs in per.items()}
                              for name, per in known.runs.items()}
        if packed_runs:  # one record per run of packed tensors written together (zckpt.store.packed)
            record["packed"] = {key: {chunk: encode_runs(sorted(runs)) for chunk, runs in per.items()}
                                for key, per in packed_runs.items()}
        return {"bytes": written, "crc32c_blocks": record, **({"source": source} if source is not None else {})}

    if shared is not None:
        shared.record(store, job.rank, info)  # written by the ingest's record thread, before it completes
    else:
        store.mark_ingested(job.rank, **info())
    return written


def _descriptor(reader: object, path: str) -> int | None:
    """The reader's open file, when it reads ``path`` itself: not a local copy of a remote
    shard (whose identity is none), nor a split source (several files)."""
    fileno = getattr(reader, "fileno", None)
    if fileno is None or remote.is_remote(path):
        return None
    try:
        return int(fileno())
    except ZckptError:
        return None


def _write_packed(store: Store, reader: ShardReader, writes: tuple[Write, ...], block_bytes: int) -> list[_Written]:
    """Copy this rank's packed tensors into their byte ranges of the packed arrays."""
    targets = []
    files: dict[tuple[Path, str], Path] = {}
    for w in writes:
        folder, key, at, _ = store.packed_place(store.entry(w.name))
        entry = reader.entries[w.name]
        if entry.shape != w.box.shape:
            raise SourceError(f"holds shape {list(entry.shape)} but the plan expects {list(w.box.shape)}",
                              path=reader.path, param=w.name)
        file = files.get((folder, key))
        if file is None:
            file = files[(folder, key)] = folder / key
        targets.append((w.name, key, file, at, entry.nbytes))
    return packed.write_tensors(reader, targets, block_bytes)


def _written_checksums(
    store: Store, writes: tuple[Write, ...], known: _RankSums
) -> dict[str, dict[str, list[int]]]:
    """Per-block CRC-32C of every chunk this rank wrote, recorded with the rank's progress
    so that export and ``zckpt verify`` can prove the bytes unchanged. Chunks copied file
    to file were summed from the source bytes in the copy; the others are read back (page
    cache)."""
    out: dict[str, dict[str, list[int]]] = {}
    for w in writes:
        if store.entry(w.name).kind != "tensor":
            continue  # MapParameter bytes are passed through as one opaque array
        if store.chunk_info(w.name).per_shard is not None:
            continue  # every run of a shard was summed in its copy (known.runs)
        done = known.chunks.get(w.name, {})
        if store.is_remote:  # summed from the source (_source_checksums): nothing to read back
            out[w.name] = {k: done[k] for k in store.chunk_keys(w.name, w.box) if k in done}
            continue
        for key, path in store.chunk_files(w.name, w.box):
            out.setdefault(w.name, {})[key] = (done[key] if key in done
                                               else file_sums(path, known.block_bytes, buffer=_thread_buffer())[0])
    return out


def _source_checksums(
    store: Store, reader: ShardReader, writes: tuple[Write, ...], known: _RankSums
) -> None:
    """Remote stores: CRC-32C of every raw chunk this rank wrote, summed from the source's
    C-order bytes of the chunk (what the ``bytes`` codec stored) instead of downloading the
    chunks back. Export still verifies them on the bytes it fetches."""
    for w in writes:
        if store.entry(w.name).kind != "tensor" or w.box.size == 0:
            continue
        info = store.chunk_info(w.name)
        if not info.raw:
            continue
        sums = known.of(w.name)
        if w.box.ndim == 0:
            sums.setdefault(info.chunk_key(()), block_sums(np.ascontiguousarray(reader.array(w.name)),
                                                           known.block_bytes))
            continue
        for t in tiles(w.box, info.chunks):
            key = info.chunk_key(tuple(a // c for a, c in zip(t.start, info.chunks, strict=True)))
            if key in sums:
                continue
            local = t.relative_to(w.box)
            view = reader.rows(w.name, local.start[0], local.stop[0])[(slice(None), *local.slices()[1:])]
            sums[key] = block_sums(np.ascontiguousarray(view), known.block_bytes)
        reader.release_pages()


def _with_spot_checks(plan: IngestPlan, jobs: list[RankJob], verify_replicas: bool) -> list[RankJob]:
    """The jobs that compare replicas with the store: the required checks (all with
    ``verify_replicas``), and else the spot checks that local sources get from
    :func:`zckpt.sources.replicas.replica_jobs`, so that sources on object storage are not trusted more."""
    spot: dict[int, list[ReplicaCheck]] = {}
    for c in set() if verify_replicas else spot_checks(plan):
        spot.setdefault(c.rank, []).append(c)
    by_rank = {j.rank: j for j in jobs}
    out = []
    for rank in sorted(set(by_rank) | set(spot)):
        extra = tuple(sorted(spot.get(rank, ()), key=lambda c: c.name))
        job = by_rank.get(rank) or RankJob(rank, str(plan.rank_files[rank]), (), (), {}, 0)
        if job.checks or extra:
            out.append(replace(job, checks=job.checks + extra, sampled=frozenset(extra),
                               check_bytes=job.check_bytes + SAMPLE_CHECK_BYTES * len(extra)))
    return out


SAMPLE_CHECK_BYTES = 8192
"""What a spot check compares at most (its two ends), as the size of its verify task."""


def check_rank(
    job: RankJob, store_path: str, options: IngestOptions, files: Mapping[int, str], report: Report | None = None
) -> int:
    """Compare one source rank's replicas with what the store holds (after every write)."""
    from zckpt.store.store import Store

    store = Store.open(store_path, mode="r", storage_options=options.storage_options)
    store.prefetch(c.name for c in job.checks)
    compared = 0
    with open_source(job.path, options.storage_options, verify_crc=False) as reader:
        ticker = Ticker(report)
        for c in job.checks:
            n = _compare(store, reader, c, options.block_bytes, files, c in job.sampled)
            compared += n
            ticker.add(c.name, n)
        ticker.close()
        reader.release_pages()
    return compared


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _kind(plan: IngestPlan, name: str) -> str:
    return plan.kind_of(name)


def _source_record(
    plan: IngestPlan, smap: StrategyMap | None, storage_options: remote.StorageOptions = None
) -> dict[str, Any]:
    files = {}
    for rank, p in plan.rank_files.items():
        if remote.is_remote(p):
            files[str(rank)] = {"path": p, "size": remote.size(remote.locate(p, storage_options, SourceError),
                                                               SourceError)}
            continue
        path = Path(p)
        files[str(rank)] = {"path": str(path.resolve()), "size": path.stat().st_size}
    return {
        "strategy_files": list(smap.sources) if smap is not None else None,
        "stage_device_num": plan.stage_device_num,
        "stages": list(smap.stages) if smap is not None else [0],
        "rank_files": files,
    } | partial_record(plan)


def _bands(box: Box, chunk0: int, row_bytes: int, block_bytes: int) -> list[tuple[int, int]]:
    """Row ranges of the shard, each a whole number of chunk rows and about block_bytes."""
    rows = box.shape[0]
    per = max(1, block_bytes // max(1, chunk0 * row_bytes)) * chunk0
    return [(r, min(rows, r + per)) for r in range(0, rows, per)]


def _write_runs(batch: _WriteBatch, reader: ShardReader, w: Write, sum_block: int) -> bool:
    """Fill the box's chunks straight from the source file when the store holds raw chunks
    on a local disk: run by run (:func:`zckpt.store.store.write_runs`), each one byte range of a
    chunk or shard file. A run whose rows are one byte range of the source is copied through
    a buffer (:func:`zckpt.io.fileio.copy_range_at`: read once, never through the mapping, so
    resident memory stays flat); the others are cut from the mapped rows chunk by chunk.
    Each run's blocks are summed from the bytes it holds in the same pass. Returns ``False``
    (nothing written) for other stores, which zarr then writes."""
    store = batch.store
    if store.is_remote:
        return False
    info = store.chunk_info(w.name)
    if not info.raw or info.folder is None:
        return False
    whole_rows = tuple(info.chunks[1:]) == w.box.shape[1:]
    create = info.per_shard is None
    if create:
        info.folder.mkdir(parents=True, exist_ok=True)
    folder = str(info.folder) + os.sep
    todo: list[tuple[Run, str, int | None]] = []
    row0 = w.box.start[0]
    for run in batch.write_runs(info, w.box):
        span = (reader.row_bytes_range(w.name, run.tiles[0].start[0] - row0, run.tiles[-1].stop[0] - row0)
                if whole_rows else None)
        todo.append((run, folder + run.key, span[0] if span is not None and span[1] == run.length else None))
    batch.copier.write(w.name, w.box, todo, sum_block, create)
    return True


class _WholeChunk(NamedTuple):
    """A source box that is one inner chunk of a raw shard, held in one byte range of the
    source file: a copy of ``length`` bytes from ``source`` to ``offset`` of the shard file
    ``path`` (key ``key``)."""

    name: str
    key: str
    path: str
    offset: int
    length: int
    source: int


def _whole_chunk_copies(
    store: Store, reader: ShardReader, writes: tuple[Write, ...], limit: int
) -> tuple[list[_WholeChunk], tuple[Write, ...]]:
    """Split a rank's writes into the boxes copied as one whole inner chunk of at most
    ``limit`` bytes (most boxes of a job on hundreds of ranks: 28 800 of 74 KB at 512) and
    the others. Each of the first needs one read, one sum and one write and nothing else,
    so its place is found here in one pass, without run objects (:func:`_write_runs` finds
    the same place through :func:`zckpt.store.store.write_runs`)."""
    if store.is_remote:
        return [], writes
    entries = reader.entries
    whole: list[_WholeChunk] = []
    left: list[Write] = []
    for w in writes:
        info = store.chunk_info(w.name)
        box = w.box
        entry = entries.get(w.name)
        if (info.per_shard is None or not info.raw or info.folder is None or box.shape != info.chunks
                or entry is None or entry.kind != "tensor" or entry.shape != box.shape
                or not 0 < info.inner_bytes <= limit):
            left.append(w)
            continue
        span = reader.row_bytes_range(w.name, 0, box.shape[0])
        if span is None or span[1] != info.inner_bytes:
            left.append(w)
            continue
        key, offset = info.locate([a // c for a, c in zip(box.start, info.chunks, strict=True)])
        whole.append(_WholeChunk(w.name, key, info.prefix + key, offset, span[1], span[0]))
    return whole, tuple(left)


INLINE_BYTES = 1024 * 1024
"""Boxes smaller than this are written on the task's own thread: handing a few KiB to the
copy thread costs more than copying them (a job on hundreds of ranks has 100 000s of them)."""

_THREAD = threading.local()
"""Each copying thread's buffer (:func:`_thread_buffer`)."""


def _thread_buffer() -> bytearray:
    """This thread's copy buffer, one for the life of the thread: a fresh 1 MiB per rank task
    cost 0.3 s at 512 ranks (the copies), and 0.1 s more where the sums were read back."""
    buf: bytearray | None = getattr(_THREAD, "buffer", None)
    if buf is None:
        buf = _THREAD.buffer = bytearray(fileio.BLOCK)
    return buf


_Written = tuple[str, str, int, int, list[int]]
"""``(entry name, file key, offset, length, block sums)`` of a run written."""


class _ChunkCopier:
    """Writes runs of one source file into chunk and shard files, summing each run's blocks
    on the way: on ``threads`` threads (each with its own buffer) so that one run is read
    while another is written, or inline with one. :meth:`finish` waits for every copy and
    returns the sums; leaving the context waits too, so that no copy outlives the source."""

    def __init__(self, reader: ShardReader, threads: int, files: fileio.SharedFiles) -> None:
        self.reader = reader  # its file descriptor is taken on the first copy (split sources have none)
        self._src: int | None = None
        self.files = files
        """Shard files, opened once per ingest in this process (chunk files are created per run)."""
        self.written: list[tuple[str, int, int]] = []
        """``(path, offset, length)`` of the runs written into shard files."""
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="zckpt-copy") if threads > 1 else None
        self.done: list[_Written] = []
        self.futures: list[Future[list[_Written]]] = []

    def __enter__(self) -> _ChunkCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self.futures:
            f.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def write(self, name: str, box: Box, runs: list[tuple[Run, str, int | None]], sum_block: int,
              create: bool) -> None:
        """Write the runs of one source box (one task: runs are often a few KiB): each
        ``(run, file, source offset)`` is copied from the source bytes at that offset (its
        rows, in one piece), or, without an offset, cut chunk by chunk from the mapped rows."""
        if self.pool is None or (runs[0][0].length if len(runs) == 1 else sum(r.length for r, _, _ in runs)) \
                < INLINE_BYTES:
            self.done.extend(self._write(name, box, runs, sum_block, create))
        else:
            self.futures.append(self.pool.submit(self._write, name, box, runs, sum_block, create))

    def _write(self, name: str, box: Box, runs: list[tuple[Run, str, int | None]], sum_block: int,
               create: bool) -> list[_Written]:
        done = []
        for run, path, offset in runs:
            try:  # not a context manager per run: a job on hundreds of ranks writes 10 000s of them
                done.append(self._copy(name, run, path, offset, sum_block, create) if offset is not None
                            else self._cut(name, run, path, box, sum_block, create))
            except fileio.SourceEnded as err:
                raise self._ended(name, str(err)) from None
            except OSError as err:
                full = as_disk_full(err, path)
                if full is None:
                    raise
                raise full from None
        return done

    def copy_whole(self, copies: list[_WholeChunk], ticker: Ticker) -> int:
        """Copy whole inner chunks (:func:`_whole_chunk_copies`) on this thread, each in one
        read, one sum and one write; returns the bytes copied."""
        if not copies:
            return 0
        view = memoryview(_thread_buffer())
        src = self._src
        if src is None:
            src = self._src = self.reader.fileno()
        acquire, release = self.files.acquire, self.files.release
        done, written = self.done, self.written
        total = 0
        for c in copies:
            length = c.length
            block = view[:length]
            fd = acquire(c.path)
            try:
                crc = crc32c(block) if os.preadv(src, [block], c.source) == length else None
                if crc is not None:
                    n = os.pwrite(fd, block, c.offset)
                    if n != length:
                        write_at(fd, block[n:], c.offset + n)
            except OSError as err:
                full = as_disk_full(err, c.path)
                if full is None:
                    raise
                raise full from None
            finally:
                release(c.path)
            if crc is None:
                raise self._ended(c.name, f"ends inside the payload ({length} bytes at {c.source})")
            written.append((c.path, c.offset, length))
            done.append((c.name, c.key, c.offset, length, [crc]))
            total += length
            ticker.add(c.name, length)
        return total

    def _ended(self, name: str, what: str) -> SourceError:
        return SourceError(f"{what}: the file changed after it was indexed; rerun the ingest",
                           path=self.reader.path, param=name)

    def _acquire(self, path: str, create: bool) -> int:
        """A descriptor to write ``path``: a new chunk file (created, closed by :meth:`_give_back`),
        or a shard file (shared, never closed here)."""
        return _open_chunk_file(path, True) if create else self.files.acquire(path)

    def _give_back(self, path: str, fd: int, create: bool) -> None:
        if create:
            os.close(fd)
        else:
            self.files.release(path)

    def _copy(self, name: str, run: Run, path: str, offset: int, sum_block: int, create: bool) -> _Written:
        buf = _thread_buffer()
        src = self._src
        if src is None:
            src = self._src = self.reader.fileno()
        fd = self._acquire(path, create)
        try:
            sums = (_copy_block(src, fd, offset, run.length, run.offset, buf)
                    if 0 < run.length <= min(len(buf), sum_block) else None)
            if sums is None:
                summer = BlockSummer(sum_block, offset)
                copy_range_at(src, fd, offset, run.length, run.offset, buf, summer.feed)
                sums = summer.result()
        finally:
            self._give_back(path, fd, create)
        if not create:
            self.written.append((path, run.offset, run.length))
        return name, run.key, run.offset, run.length, sums

    def _cut(self, name: str, run: Run, path: str, box: Box, sum_block: int, create: bool) -> _Written:
        summer = BlockSummer(sum_block, 0)
        fd = self._acquire(path, create)
        try:
            at = 0
            for t in run.tiles:
                local = t.relative_to(box)
                rows = self.reader.rows(name, local.start[0], local.stop[0])
                data = np.ascontiguousarray(rows[(slice(None), *local.slices()[1:])]).reshape(-1).view(np.uint8)
                summer.feed(at, data)
                write_at(fd, data.data, run.offset + at)
                at += data.size
        finally:
            self._give_back(path, fd, create)
            self.reader.release_pages()
        if at != run.length:
            raise AssertionError(f"run of {name} in {path} wrote {at} of {run.length} bytes")
        if not create:
            self.written.append((path, run.offset, run.length))
        return name, run.key, run.offset, run.length, summer.result()

    def finish(self) -> list[_Written]:
        futures, self.futures = self.futures, []
        done, self.done = self.done + [x for f in futures for x in f.result()], []
        return done


def _copy_block(src: int, dst: int, offset: int, length: int, at: int, buf: bytearray) -> list[int] | None:
    """:func:`zckpt.io.fileio.copy_range_at` of a run that fits one buffer and one checksum block
    (most runs of a many-rank job: 28 800 of 74 KB on average at 512 ranks), in one read, one
    sum and one write, with no summer object: its one block sum, or ``None`` when the source
    ends early (the caller's general copy then says where)."""
    view = memoryview(buf)[:length]
    if os.preadv(src, [view], offset) != length:
        return None
    crc = crc32c(view)
    done = os.pwrite(dst, view, at)
    if done != length:
        write_at(dst, view[done:], at + done)
    return [crc]


def _open_chunk_file(path: str, create: bool) -> int:
    flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if create else 0)
    try:
        return safe_paths.open_write(path, flags, StoreError)  # never through a link planted in the store
    except FileNotFoundError:
        raise StoreError("shard file is missing: the store is damaged", path=path) from None


class _WriteBatch:
    """Collects region writes and sends them to zarr together once ``limit`` bytes are pending.

    The data are views of the mapped source file, so pending writes cost no memory until
    zarr encodes them; the limit bounds what is in flight.
    """

    def __init__(self, store: Store, limit: int, reader: ShardReader, copier: _ChunkCopier) -> None:
        from zckpt.store.geometry import write_runs

        self.write_runs = write_runs
        """:func:`zckpt.store.store.write_runs`, imported once per rank, not per box: an import
        statement run 28 800 times was the largest Python cost of a 512-rank ingest's writes."""
        self.store = store
        self.reader = reader
        self.copier = copier
        self.limit = limit
        self.items: list[tuple[str, tuple[slice, ...], np.ndarray]] = []
        self.pending = 0

    def add(self, name: str, sel: tuple[slice, ...], data: np.ndarray) -> None:
        if self.items and self.pending + data.nbytes > self.limit:
            self.flush()
        self.items.append((name, sel, data))
        self.pending += data.nbytes

    def flush(self) -> None:
        if self.items:
            self.store.write_many(self.items)
            self.reader.release_pages()
        self.items = []
        self.pending = 0


def _write(
    batch: _WriteBatch,
    reader: ShardReader,
    w: Write,
    chunks: tuple[int, ...],
    block_bytes: int,
    known: _RankSums,
) -> int:
    entry = reader.entries[w.name]
    if entry.kind == "map":
        body = reader.map_bytes(w.name)
        batch.add(w.name, (slice(None),), np.frombuffer(body, dtype=np.uint8))
        return len(body)
    if entry.shape != w.box.shape:
        raise SourceError(
            f"holds shape {list(entry.shape)} but the plan expects {list(w.box.shape)}",
            path=reader.path,
            param=w.name,
        )
    if w.box.size == 0:
        return 0
    if w.box.ndim == 0:
        batch.add(w.name, (), reader.array(w.name))
        return entry.nbytes
    if _write_runs(batch, reader, w, known.block_bytes):
        return entry.nbytes
    row_bytes = entry.nbytes // entry.shape[0]
    if chunks[0] * row_bytes <= block_bytes:
        rest = w.box.slices()[1:]
        for r0, r1 in _bands(w.box, chunks[0], row_bytes, block_bytes):
            batch.add(w.name, (slice(w.box.start[0] + r0, w.box.start[0] + r1), *rest), reader.rows(w.name, r0, r1))
        return entry.nbytes
    for tile in tiles(w.box, chunks):  # rows wider than the budget: one chunk at a time
        local = tile.relative_to(w.box)
        view = reader.rows(w.name, local.start[0], local.stop[0])[(slice(None), *local.slices()[1:])]
        batch.add(w.name, tile.slices(), view)
    return entry.nbytes


def _compare(
    store: Store,
    reader: ShardReader,
    c: ReplicaCheck,
    block_bytes: int,
    files: Mapping[int, str],
    sampled: bool = False,
) -> int:
    box = c.box
    arr = store.array(c.name)
    entry = reader.entries[c.name]
    who = ", ".join(f"rank {r} ({files.get(r)})" for r in c.same_as)
    if entry.shape != box.shape:
        raise SourceError(f"shape {list(entry.shape)} differs from the copy of {who}", path=reader.path, param=c.name)
    if box.size == 0:
        return 0
    same = True
    itemsize = entry_itemsize(entry)
    pieces = sample_boxes(box, itemsize) if sampled else c_order_pieces(box, max(1, block_bytes // itemsize))
    for piece in pieces:
        local = piece.relative_to(box)
        if box.ndim == 0:
            mine = reader.array(c.name)
        else:
            mine = reader.rows(c.name, local.start[0], local.stop[0])[(slice(None), *local.slices()[1:])]
        if not _same_bytes(np.asarray(arr[piece.slices()]), mine):
            same = False
            break
    if not same:
        if c.reason == "unlisted":
            raise SourceError(
                f"not listed in the source strategy, yet rank {c.rank} and {who} hold different values: it is "
                "sharded with a layout the strategy does not give; zckpt will not guess (save the strategy with "
                "only_trainable_params=False)",
                path=reader.path,
                param=c.name,
            )
        raise SourceError(
            f"copy of region {box.to_json()} differs from the one written by {who}, although the layouts say they "
            + ("hold the same values (a replica)" if c.reason == "replica"
               else "hold the same values (a parameter shared by several pipeline stages, such as a tied embedding)"),
            path=reader.path,
            param=c.name,
        )
    return entry.nbytes


def entry_itemsize(entry: EntryInfo) -> int:
    return int(ms_dtype(entry.ms_type).storage.itemsize)


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype.itemsize != b.dtype.itemsize:
        return False
    return bool(np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)))
