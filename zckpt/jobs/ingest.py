"""Ingest: stream MindSpore source shards into a global-coordinate Zarr store.

The composition of an ingest: the sources found and planned (:mod:`zckpt.sources.prepare`),
where the work runs (:mod:`zckpt.run.choose`), the store taken and laid out
(:mod:`zckpt.store.locking`, :mod:`zckpt.store.layout_choice`), one task per source rank
writing its boxes through the chunk writer (:mod:`zckpt.store.chunk_writer`), then the
replica checks. Replicated copies are written once; unlisted tensors held by several ranks
are compared byte for byte, because a difference means the strategy hides a sharded tensor.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zckpt.core.errors import DiskFullError, SourceError, ZckptError
from zckpt.core.layout import Box
from zckpt.formats.entries import EntryInfo
from zckpt.formats.rank_files import RankFileChoice
from zckpt.io import fileio, remote
from zckpt.io.checksums import BLOCK_BYTES
from zckpt.io.fileio import as_disk_full
from zckpt.jobs.store_checks import check_rank
from zckpt.plan.export_plan import served_boxes
from zckpt.plan.values import IngestPlan, ReplicaCheck, Write
from zckpt.run.choose import Placement, placement
from zckpt.run.collect import fewer_collections
from zckpt.run.engines import travelling, wants_overlap
from zckpt.run.progress import Report, Ticker
from zckpt.sources.discovery import SourceFile, open_source
from zckpt.sources.prepare import PreparedIngest, Settle, find_sources, plan_sources_early, store_source
from zckpt.sources.replicas import CheckJob, compare_replicas, merged, replica_jobs, spot_checks
from zckpt.sources.strategies import StrategyArg, load_strategy
from zckpt.store import integrity, packed, rerun
from zckpt.store.chunk_writer import (
    ChunkCopier,
    RankSums,
    WriteBatch,
    source_checksums,
    whole_chunk_copies,
    write_box,
    write_packed,
    written_checksums,
)
from zckpt.store.layout_choice import StoreLayout, resumable_layout, store_layout
from zckpt.store.locking import drop_temporaries, open_for_ingest, remote_store_lock, store_lock
from zckpt.store.records import GROUP_VERSION, encode_runs, regroup_local
from zckpt.store.task_files import RECORD_FILES, InProcess, shard_files, task_files

if TYPE_CHECKING:  # the store's modules: loaded while the sources are read (ingest below)
    from zckpt.store.geometry import ChunkInfo
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
    serve: tuple[StrategyArg, ...] = ()
    """Destination strategies the store will serve: chunk borders also fall on their ranks'
    borders, so that loading or exporting one of their ranks reads whole chunks only."""
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
    src, store_path = travelling(src, options.scheduler), travelling(store_path, options.scheduler)
    is_remote = isinstance(store_path, str) and remote.is_remote(store_path)
    found = find_sources(src, strategy, require_complete=options.require_complete,
                         storage_options=options.storage_options, file_suffix=options.file_suffix,
                         choice_func=options.choice_func, block_bytes=options.block_bytes)
    # the helper process, if any, starts here: its imports overlap the reading of the indexes
    possible = _helper_possible(found.files, options, is_remote)
    with placement(options, helper_possible=possible, nbytes=_source_bytes(found.files, options.helper) if possible
                   else 0, ranks=len(found.files),
                   modules=("zckpt.jobs.ingest", "zckpt.store.store")) as place:
        early = not is_remote and not os.path.lexists(remote.local_path(store_path))
        prepared, settle = plan_sources_early(
            found, verify_crc=options.verify_crc, order="files",
            # with a cold cache the store's import reads its own files from the disk: while the shards are read
            while_reading=lambda: importlib.import_module("zckpt.store.store"))
        if not early:
            prepared, settle = settle() or prepared, _settled
        try:
            return _ingest(prepared, settle, store_path, is_remote, options, place, t0)
        except _Replanned as again:  # the store made from the guess was removed
            return _ingest(again.prepared, _settled, store_path, is_remote, options, place, t0)


class _Replanned(ZckptError):
    """A new store was defined from a plan made while the source files were read
    (:func:`zckpt.sources.prepare.plan_sources_early`), and a file turned out laid out otherwise:
    the store is removed (as on any zckpt error) and made again from :attr:`prepared`."""

    def __init__(self, prepared: PreparedIngest) -> None:
        super().__init__("the source files are not laid out as their first ones: planned again")
        self.prepared = prepared


def _settled() -> PreparedIngest | None:
    return None


def served_by(plan: IngestPlan, options: IngestOptions) -> dict[str, list[Box]]:
    """The destination boxes of ``options.serve``'s strategies (:attr:`IngestOptions.serve`)."""
    if not options.serve:
        return {}
    return served_boxes(plan.tensors, [load_strategy(s, options.storage_options) for s in options.serve])


def _ingest(prepared: PreparedIngest, settle: Settle, store_path: str | Path, is_remote: bool,
            options: IngestOptions, place: Placement, t0: float) -> IngestReport:
    """The ingest of a plan; ``settle`` (:func:`zckpt.sources.prepare.plan_sources_early`) is called
    once the store is defined (a new store: defined while the source files are read), before
    anything of a store found there is changed."""
    plan, smap = prepared.plan, prepared.strategy
    options = replace(options, choice_func=None)  # applied in the plan; tasks need not carry (pickle) it
    values = store_source(plan, smap, options.storage_options)
    layout = store_layout(plan, options, values.strings, values.map_sizes, values.record, sharded=not is_remote,
                          served=served_by(plan, options))
    if not is_remote:
        layout = resumable_layout(remote.local_path(store_path), layout, options.overwrite)
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
            _settle(settle)
            redone = rerun.to_redo(store, required, plan.rank_files)
            if redone or (state == "complete" and rerun.unsealed(store)):
                store.unseal()
                store.forget_ranks(redone)
                state = "resume"
        try:
            if state == "new":
                store.define(layout.tensors, layout.writers, layout.chunks, layout.strings, layout.source,
                             fingerprint=layout.fingerprint(), shards=layout.shards, packing=layout.packing)
                _settle(settle)
            done = ((0, 0, ()) if state == "complete"
                    else _run(plan, layout, store, options, place, prepared.indexes))
            if not plan.uncovered and state != "complete":
                drop_temporaries(target)  # a task killed on a Dask worker, run again elsewhere, left its own
                store.mark_complete()
        except DiskFullError:
            drop_temporaries(target)
            raise
        except ZckptError:
            store.remove()
            raise
        except OSError as err:
            full = as_disk_full(err, target)
            if full is None:
                raise
            drop_temporaries(target)
            raise full from None
    return _report(store, prepared, done, state, redone, t0)


def _settle(settle: Settle) -> None:
    again = settle()
    if again is not None:
        raise _Replanned(again)


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


def _helper_possible(files: Mapping[int, SourceFile], options: IngestOptions, is_remote: bool) -> bool:
    """Whether this ingest may copy in two processes (:data:`IngestOptions.helper`): never for
    a remote store or a single source file, and by itself only for local source files."""
    if is_remote or len(files) < 2:
        return False
    return options.helper is not None or all(isinstance(p, Path) for p in files.values())


def _source_bytes(files: Mapping[int, SourceFile], helper: bool | None) -> int:
    """The size of the source files, which the automatic choice of a helper weighs (0 when the
    choice is given: nothing is measured)."""
    total = 0
    if helper is None:
        for p in files.values():
            with contextlib.suppress(OSError):
                total += os.stat(p).st_size
    return total


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


def ingest_ranks(jobs: list[RankJob], store_path: str, options: IngestOptions, ranks: int) -> list[int]:
    """:func:`ingest_rank` of several ranks with their own shard files, write-behind and
    record thread (the helper's share; ``ranks``: how many the whole run writes, which sets
    the record groups)."""
    with shard_files(True, ranks) as shared:
        return [ingest_rank(j, store_path, options, shared) for j in jobs]


def _run(
    plan: IngestPlan, layout: StoreLayout, store: Store, options: IngestOptions, place: Placement,
    indexes: Mapping[int, Mapping[str, EntryInfo]] | None = None,
) -> tuple[int, int, tuple[int, ...]]:
    tensors = list(layout.tensors)
    chunks = layout.chunks
    done = store.ingested_ranks()
    ranks = plan.ranks_to_read(verify_replicas=options.verify_replicas)
    itemsizes = {t.name: t.nbytes // max(1, math.prod(t.shape)) for t in tensors}
    jobs = []
    local = not store.is_remote
    for rank in ranks:
        ws = tuple(x for x in plan.writes_of(rank) if plan.kind_of(x.name) != "str")
        if rank in done:
            ws = ()
        cs = plan.checks_of(rank, verify_replicas=options.verify_replicas)
        names = {x.name for x in ws} | {c.name for c in cs}
        nbytes = sum(x.box.size * itemsizes[x.name] for x in ws)
        check_bytes = sum(c.box.size * itemsizes.get(c.name, 1) for c in cs)
        target = _target(store, layout, {x.name for x in ws}) if local else None
        far = remote.is_remote(plan.rank_files[rank])  # walked once, in planning: only its framing was fetched
        index = indexes.get(rank) if indexes and (far or local) else None
        jobs.append(RankJob(rank, plan.rank_files[rank], ws, cs, {n: chunks[n] for n in names}, nbytes, check_bytes,
                            {n: layout.shards[n] for n in names if n in layout.shards}, target, index))
    options = replace(options, block_bytes=place.share(options.block_bytes))
    with place.running() as client:
        options = replace(options, overlap=place.overlap())
        todo = [j for j in jobs if j.rank not in done]
        with shard_files(local and client is None, len(todo)) as shared:  # every record written when it ends
            aside = (place.hand_over(todo, [j.nbytes for j in todo], ingest_ranks, store.url, options, len(todo),
                                     step=shared.group) if shared is not None else None)
            try:
                written = place.run(ingest_rank, todo, store.url, options, shared, label="ingest",
                                    size=lambda j: j.nbytes, name=_rank_name, progress=options.progress, aside=aside)
            except BaseException:
                if place.helper is not None:
                    place.helper.close()  # no more writes once this fails: the store may be removed next
                raise
        if shared is None and local and store.version >= GROUP_VERSION:  # the files one process writes
            regroup_local(store.path, [j.rank for j in todo], max(1, -(-len(todo) // RECORD_FILES)))
        if indexes and not any(isinstance(f, str) and remote.is_remote(f) for f in plan.rank_files.values()):
            checks = replica_jobs(plan, indexes, None, options.verify_replicas)  # source against source
            if not options.verify_replicas and client is not None:  # one task per worker thread, not per rank
                checks = merged(checks, place.tasks())
            compared = place.run(compare_replicas, checks, options, label="verify", size=lambda j: j.nbytes,
                                 name=_rank_name, progress=options.progress)
        else:
            compared = place.run(check_rank, _with_spot_checks(plan, jobs, options.verify_replicas), store.url,
                                 options, dict(plan.rank_files), label="verify", size=lambda j: j.check_bytes,
                                 name=_rank_name, progress=options.progress)
    store._ingested = None
    return sum(written), sum(compared), ranks


def _target(store: Store, layout: StoreLayout, names: set[str]) -> StoreTarget:
    """The :class:`StoreTarget` of a task writing ``names`` (layouts as the plan made them,
    or read from the store once here when it is of an older format)."""
    slots = layout.packing.slots if layout.packing is not None else {}
    for n in names:
        if n not in slots:
            store.assume_layout(n, layout.chunks[n], layout.shards.get(n))
    ordered = sorted(names)
    return StoreTarget(store.version, tuple(store.entry(n) for n in ordered),
                       {n: store.chunk_info(n) for n in ordered if n not in slots})  # packed: write_packed


def _rank_name(job: RankJob | CheckJob) -> str:
    return f"rank {job.rank}"


def ingest_rank(job: RankJob, store_path: str, options: IngestOptions, shared: InProcess | None = None,
                report: Report | None = None) -> int:
    """Write one source rank's boxes into the store and mark the rank done (a Dask task;
    ``shared``: what the tasks run in the ingest's own process share)."""
    from zckpt.store.store import Store  # the store's modules: loaded while the sources are read (jobs.ingest)

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
    known = RankSums(options.checksum_block_bytes)
    with open_source(job.path, options.storage_options, verify_crc=False, index=job.index) as reader, \
            task_files(shared) as files, \
            ChunkCopier(reader, 2 if wants_overlap(options.overlap) else 1, files) as copier:
        source = integrity.source_identity(job.path, _descriptor(reader, job.path))  # before any byte is copied
        batch = WriteBatch(store, options.block_bytes, reader, copier)
        ticker = Ticker(report)
        packed_runs: dict[str, dict[str, list[tuple[int, int, list[int]]]]] = {}
        for key, chunk, offset, length, sums in write_packed(store, reader, tiny, known.block_bytes):
            packed_runs.setdefault(key, {}).setdefault(chunk, []).append((offset, length, sums))
            written += length
            ticker.add(key, length)
        whole, writes_left = whole_chunk_copies(store, reader, writes, min(fileio.BLOCK, known.block_bytes))
        written += copier.copy_whole(whole, ticker)
        for w in writes_left:
            n = write_box(batch, reader, w, job.chunks[w.name], options.block_bytes, known)
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
            source_checksums(store, reader, job.writes, known)
    chunk_sums = written_checksums(store, writes, known)

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

