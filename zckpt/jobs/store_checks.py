"""The replica checks of an ingest whose sources cannot be compared with each other directly
(shards on object storage): each source rank's replicas compared with what the store holds,
once every rank is written.

Needs both a store and the source files, hence a job of its own; comparing two source
files needs no store (:mod:`zckpt.sources.replicas`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import SourceError
from zckpt.core.layout import c_order_pieces
from zckpt.formats.shard_reader import ShardReader
from zckpt.io import remote
from zckpt.plan.values import ReplicaCheck
from zckpt.run.progress import Report, Ticker
from zckpt.sources.discovery import open_source
from zckpt.sources.replicas import same_bytes, sample_boxes

if TYPE_CHECKING:
    from zckpt.store.store import Store


class RankChecks(Protocol):
    """What :func:`check_rank` reads of an ingest's rank job."""

    @property
    def path(self) -> str: ...
    @property
    def checks(self) -> tuple[ReplicaCheck, ...]: ...
    @property
    def sampled(self) -> frozenset[ReplicaCheck]: ...


class CheckOptions(Protocol):
    """What :func:`check_rank` reads of an ingest's options."""

    @property
    def block_bytes(self) -> int: ...
    @property
    def storage_options(self) -> remote.StorageOptions: ...


def check_rank(
    job: RankChecks, store_path: str, options: CheckOptions, files: Mapping[int, str], report: Report | None = None
) -> int:
    """Compare one source rank's replicas with what the store holds (after every write)."""
    from zckpt.store.store import Store  # the store's modules: loaded while the sources are read (jobs.ingest)

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
    itemsize = int(ms_dtype(entry.ms_type).storage.itemsize)
    pieces = sample_boxes(box, itemsize) if sampled else c_order_pieces(box, max(1, block_bytes // itemsize))
    for piece in pieces:
        local = piece.relative_to(box)
        if box.ndim == 0:
            mine = reader.array(c.name)
        else:
            mine = reader.rows(c.name, local.start[0], local.stop[0])[(slice(None), *local.slices()[1:])]
        if not same_bytes(np.asarray(arr[piece.slices()]), mine):
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
