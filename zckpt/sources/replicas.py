"""Replica checks read straight from the source shards: a source rank's copy of an entry
against the copy of the rank whose bytes are used instead.

Ingest and the direct path both refuse a job whose replicas differ where the layouts say
they are equal (an unlisted tensor that is really sharded, a tied parameter whose pipeline
stages disagree). Replicas inside one stage are compared in full only when asked
(``verify_replicas``); otherwise, for every entry and every device axis its layout calls
replicated, one replica one step along that axis is spot-checked (its first and last bytes,
:data:`SAMPLE_BYTES` each): a strategy that calls different shards
replicas (a damaged or foreign ``tensor_map``, a missing optimizer split) would else make
one rank's shard the whole tensor, and those shards differ everywhere. Comparing the two
source files with ``pread`` at their index offsets needs no store: at 512 ranks, comparing
three unlisted scalars through zarr per rank was a third of an ingest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import SourceError
from zckpt.core.layout import Box, c_order_pieces
from zckpt.formats.entries import EntryInfo
from zckpt.plan.values import IngestPlan, ReplicaCheck, Write
from zckpt.run.progress import Report, Ticker
from zckpt.sources.reader import ShardFiles


class HasBlockBytes(Protocol):
    """Options of ingest or transform: the comparison's block size and the sources' filesystem options."""

    @property
    def block_bytes(self) -> int: ...
    @property
    def storage_options(self) -> Mapping[str, Any] | None: ...


@dataclass(frozen=True)
class CheckJob:
    """One source rank's replicas to compare with the copies that will be written."""

    rank: int
    checks: tuple[ReplicaCheck, ...]
    writes: tuple[Write, ...]
    files: Mapping[int, str]
    entries: Mapping[int, Mapping[str, EntryInfo]]
    nbytes: int
    sampled: frozenset[ReplicaCheck] = frozenset()
    """The ``checks`` only spot-checked (:func:`sample_boxes`), not compared in full."""


def replica_jobs(source: IngestPlan, indexes: Mapping[int, Mapping[str, EntryInfo]], names: set[str] | None,
                 verify_replicas: bool) -> list[CheckJob]:
    """The replica comparisons per source rank: the required ones (unlisted tensors,
    parameters shared by pipeline stages; others with ``verify_replicas``), of ``names``
    (``None``: every entry)."""
    by_rank: dict[int, list[ReplicaCheck]] = {}
    sampled: dict[int, set[ReplicaCheck]] = {}
    spot = set() if verify_replicas else spot_checks(source)
    for c in source.checks:
        if (names is None or c.name in names) and (c.required or verify_replicas or c in spot):
            by_rank.setdefault(c.rank, []).append(c)
            if c in spot:
                sampled.setdefault(c.rank, set()).add(c)
    itemsizes = {t.name: ms_dtype(t.ms_type).storage.itemsize for t in source.tensors if t.kind == "tensor"}
    writes_of: dict[tuple[str, int], Write] = {(w.name, w.rank): w for w in source.writes}
    jobs = []
    for rank, checks in sorted(by_rank.items()):
        pairs = {(c.name, r) for c in checks for r in c.same_as}
        writes = tuple(writes_of[p] for p in sorted(pairs) if p in writes_of)
        files = {r: str(source.rank_files[r]) for r in {rank} | {r for _, r in pairs}}
        entries: dict[int, dict[str, EntryInfo]] = {r: {} for r in files}
        for c in checks:
            entries[rank][c.name] = indexes[rank][c.name]
        for w in writes:
            entries[w.rank][w.name] = indexes[w.rank][w.name]
        jobs.append(CheckJob(rank, tuple(checks), writes, files, entries,
                             sum(c.box.size * itemsizes.get(c.name, 1) for c in checks),
                             frozenset(sampled.get(rank, ()))))
    return jobs


def merged(jobs: list[CheckJob], tasks: int = 1) -> list[CheckJob]:
    """The replica comparisons as ``tasks`` tasks (one per task that runs at once): each source
    file is then opened once per task, not once per rank comparing with it (at 512 ranks, 511
    tasks of three scalars each opened the file of rank 0 again; on a cluster of two one-thread
    workers those 511 tasks took 2.5-3.8 s, two took 0.1-0.3 s)."""
    if len(jobs) <= 1:
        return jobs
    if tasks > 1:
        size = -(-len(jobs) // tasks)
        return [m for a in range(0, len(jobs), size) for m in merged(jobs[a:a + size])]
    entries: dict[int, dict[str, EntryInfo]] = {}
    for j in jobs:
        for r, per in j.entries.items():
            entries.setdefault(r, {}).update(per)
    writes = tuple(dict.fromkeys(w for j in jobs for w in j.writes))
    return [CheckJob(jobs[0].rank, tuple(c for j in jobs for c in j.checks), writes,
                     {r: f for j in jobs for r, f in j.files.items()}, entries, sum(j.nbytes for j in jobs),
                     frozenset(c for j in jobs for c in j.sampled))]


def spot_checks(source: IngestPlan) -> set[ReplicaCheck]:
    """Per entry, stage and device axis the layout calls replicated, one replica: the first
    one step from its writer along that axis. A layout that calls a true split replicated
    does so for every box of the entry, so one box per axis shows it, at a cost that grows
    neither with the replica count nor with the boxes."""
    specs = {t.name: t for t in source.tensors}
    stage_dev = max(1, source.stage_device_num)
    chosen: dict[tuple[str, int, int], ReplicaCheck] = {}
    for c in source.checks:
        if c.reason != "replica" or len(c.same_as) != 1:
            continue
        stage = c.rank // stage_dev
        lay = specs[c.name].layouts.get(stage) if c.name in specs else None
        dev = lay.dev_matrix if lay is not None else ()
        if math.prod(dev) != stage_dev:  # no coordinates to reason with: one check per rank
            chosen[(c.name, stage, -1 - c.rank)] = c
            continue
        mine, theirs = _coords(c.rank % stage_dev, dev), _coords(c.same_as[0] % stage_dev, dev)
        steps = [(i, a - b) for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b]
        if len(steps) == 1 and steps[0][1] == 1:
            key = (c.name, stage, steps[0][0])
            if key not in chosen or c.rank < chosen[key].rank:
                chosen[key] = c
    return set(chosen.values())


def _coords(rank: int, dev: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(dev):
        rank, c = divmod(rank, n)
        out.append(c)
    return tuple(reversed(out))


SAMPLE_BYTES = 4096
"""Bytes compared at each end of a spot-checked replica."""


def sample_boxes(box: Box, itemsize: int) -> list[Box]:
    """The first and the last C-order corner of ``box`` holding at most about
    :data:`SAMPLE_BYTES` (its first/last row, narrowed dimension by dimension)."""
    out = []
    for last in (False, True):
        start, stop = list(box.start), list(box.stop)
        for d in range(box.ndim):
            inner = math.prod(stop[k] - start[k] for k in range(d + 1, box.ndim))
            keep = max(1, SAMPLE_BYTES // max(1, inner * itemsize))
            if stop[d] - start[d] > keep:
                if last:
                    start[d] = stop[d] - keep
                else:
                    stop[d] = start[d] + keep
        out.append(Box(tuple(start), tuple(stop)))
    return out if out[0] != out[1] else out[:1]


def compare_replicas(job: CheckJob, options: HasBlockBytes, report: Report | None = None) -> int:
    """Compare one source rank's replicas with the copies of the ranks that will be read
    instead (a Dask task); returns the bytes compared."""
    ticker = Ticker(report)
    compared = 0
    shards = ShardFiles(job.files, job.entries, options.storage_options)
    writes: dict[str, list[Write]] = {}
    for w in job.writes:
        writes.setdefault(w.name, []).append(w)
    try:
        for c in job.checks:
            n = _compare(c, shards, job, options.block_bytes, writes.get(c.name, []))
            compared += n
            ticker.add(c.name, n)
    finally:
        shards.close()
    ticker.close()
    return compared


def _compare(c: ReplicaCheck, shards: ShardFiles, job: CheckJob, block_bytes: int, writes: list[Write]) -> int:
    entry = job.entries[c.rank].get(c.name)
    who = ", ".join(f"rank {r} ({job.files.get(r)})" for r in c.same_as)
    if entry is None or entry.shape != c.box.shape:
        held = "nothing" if entry is None else f"shape {list(entry.shape)}"
        raise SourceError(f"holds {held}, which differs from the copy of {who}", path=job.files[c.rank],
                          param=c.name)
    itemsize = int(ms_dtype(entry.ms_type).storage.itemsize)
    for w in writes:  # the writes of c.name (scanning every write per check was quadratic)
        if w.rank not in c.same_as:
            continue
        common = w.box.intersect(c.box) if c.box.ndim else w.box
        if common is None:
            continue
        if not c.box.ndim:
            pieces = [common]
        elif c in job.sampled:
            pieces = sample_boxes(common, itemsize)
        else:
            pieces = c_order_pieces(common, max(1, block_bytes // 4 // itemsize))
        for piece in pieces:
            if not same_bytes(shards.rows(c.rank, c.name, c.box, piece), shards.rows(w.rank, c.name, w.box, piece)):
                _differ(c, who, job.files[c.rank])
    return entry.nbytes


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    return a.shape == b.shape and bool(np.array_equal(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                                                      np.ascontiguousarray(b).reshape(-1).view(np.uint8)))


def _differ(c: ReplicaCheck, who: str, path: str) -> None:
    if c.reason == "unlisted":
        raise SourceError(
            f"not listed in the source strategy, yet rank {c.rank} and {who} hold different values: it is sharded "
            "with a layout the strategy does not give; zckpt will not guess (save the strategy with "
            "only_trainable_params=False)", path=path, param=c.name)
    raise SourceError(
        f"copy of region {c.box.to_json()} differs from the one held by {who}, although the layouts say they hold "
        + ("the same values (a replica)" if c.reason == "replica"
           else "the same values (a parameter shared by several pipeline stages, such as a tied embedding)"),
        path=path, param=c.name)
