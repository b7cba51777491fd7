"""Replica checks read straight from the source shards: a source rank's copy of an entry
against the copy of the rank whose bytes are used instead.

Ingest and the direct path both refuse a job whose replicas differ where the layouts say
they are equal (an unlisted tensor that is really sharded, a tied parameter whose pipeline
stages disagree). Comparing the two source files with ``pread`` at their index offsets
needs no store: at 512 ranks, comparing three unlisted scalars through zarr per rank was a
third of an ingest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from zckpt.dtypes import ms_dtype
from zckpt.errors import SourceError
from zckpt.formats.ckpt import EntryInfo
from zckpt.layout import c_order_pieces
from zckpt.plan import IngestPlan, ReplicaCheck, Write
from zckpt.progress import Report, Ticker
from zckpt.source_reader import ShardFiles


class HasBlockBytes(Protocol):
    """Options of ingest or transform: only the comparison's block size is used."""

    @property
    def block_bytes(self) -> int: ...


@dataclass(frozen=True)
class CheckJob:
    """One source rank's replicas to compare with the copies that will be written."""

    rank: int
    checks: tuple[ReplicaCheck, ...]
    writes: tuple[Write, ...]
    files: Mapping[int, str]
    entries: Mapping[int, Mapping[str, EntryInfo]]
    nbytes: int


def replica_jobs(source: IngestPlan, indexes: Mapping[int, Mapping[str, EntryInfo]], names: set[str] | None,
                 verify_replicas: bool) -> list[CheckJob]:
    """The replica comparisons per source rank: the required ones (unlisted tensors,
    parameters shared by pipeline stages; others with ``verify_replicas``), of ``names``
    (``None``: every entry)."""
    by_rank: dict[int, list[ReplicaCheck]] = {}
    for c in source.checks:
        if (names is None or c.name in names) and (c.required or verify_replicas):
            by_rank.setdefault(c.rank, []).append(c)
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
                             sum(c.box.size * itemsizes.get(c.name, 1) for c in checks)))
    return jobs


def compare_replicas(job: CheckJob, options: HasBlockBytes, report: Report | None = None) -> int:
    """Compare one source rank's replicas with the copies of the ranks that will be read
    instead (a Dask task); returns the bytes compared."""
    ticker = Ticker(report)
    compared = 0
    shards = ShardFiles(job.files, job.entries)
    try:
        for c in job.checks:
            n = _compare(c, shards, job, options.block_bytes)
            compared += n
            ticker.add(c.name, n)
    finally:
        shards.close()
    ticker.close()
    return compared


def _compare(c: ReplicaCheck, shards: ShardFiles, job: CheckJob, block_bytes: int) -> int:
    entry = job.entries[c.rank].get(c.name)
    who = ", ".join(f"rank {r} ({job.files.get(r)})" for r in c.same_as)
    if entry is None or entry.shape != c.box.shape:
        held = "nothing" if entry is None else f"shape {list(entry.shape)}"
        raise SourceError(f"holds {held}, which differs from the copy of {who}", path=job.files[c.rank],
                          param=c.name)
    itemsize = int(ms_dtype(entry.ms_type).storage.itemsize)
    for w in job.writes:
        if w.name != c.name or w.rank not in c.same_as:
            continue
        common = w.box.intersect(c.box) if c.box.ndim else w.box
        if common is None:
            continue
        for piece in c_order_pieces(common, max(1, block_bytes // 4 // itemsize)) if c.box.ndim else [common]:
            if not _same_bytes(shards.rows(c.rank, c.name, c.box, piece), shards.rows(w.rank, c.name, w.box, piece)):
                _differ(c, who, job.files[c.rank])
    return entry.nbytes


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
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
