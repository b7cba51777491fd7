"""The executor: write one destination rank's ``.ckpt`` from any place where boxes live.

A destination file is a list of slices (:class:`~zckpt.plan.values.RankExport`); where their
bytes come from is a :class:`BoxReader`. The store (:class:`zckpt.store.reader.StoreReader`)
and the source shards themselves (:class:`zckpt.sources.reader.SourceReader`) are two such
places, so one executor serves ``export`` and the direct ``transform`` alike: a slice the
reader can hand out as file ranges is copied file to file (:meth:`CkptWriter.write_blocks`),
any other is cut into bands read batch by batch (at most ``band_bytes`` in memory, the next batch read on a
helper thread while the current one is written when ``overlap`` says so).
"""

from __future__ import annotations

import collections
import contextlib
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.layout import Box
from zckpt.formats.ckpt_writer import CkptWriter
from zckpt.formats.entries import FileRange
from zckpt.io.fileio import Publisher
from zckpt.plan.values import RankExport
from zckpt.run.engines import wants_overlap
from zckpt.run.progress import Ticker

LOCAL_BATCH_BYTES = 8 * 1024 * 1024
"""Largest batch of bands read at once from local files (the store's raw chunks, source
shards). Each fresh batch is memory the kernel must fault in and zero, at about the cost of
reading it: 128 MiB batches (a 1 GiB budget) made the 8 -> 4 benchmark fault in 600 MiB per
export (155 000 page faults, a quarter of its CPU time; 36 000 with 8 MiB batches). Batches
this small are served again from what the allocator freed, and one read ahead is still
plenty to keep the writer busy."""


def batch_bytes(block_bytes: int, overlap: bool, *, local: bool = True) -> int:
    """Largest batch of bands a reader hands out at once: half of ``block_bytes`` when the
    next batch is read ahead (two in flight), and at most :data:`LOCAL_BATCH_BYTES` for
    local files (remote stores keep large batches: their reads are concurrent round trips)."""
    limit = max(1, block_bytes // (2 if overlap else 1))
    return min(limit, LOCAL_BATCH_BYTES) if local else limit


@dataclass(frozen=True)
class RankResult:
    rank: int
    path: str
    tensors: int
    bytes: int
    read_bytes: int = 0
    """Bytes read for the file's data (slices only: exact slicing makes this ``bytes``
    minus the file's framing)."""
    checked_bytes: int = 0
    """Bytes read only to check checksums or to be cut away: the parts of checksum blocks
    outside a slice's range, columns of chunk (or source shard) rows a slice does not take,
    and whole chunks read through zarr (encoded chunks, remote stores)."""


class BoxReader(Protocol):
    """What the executor needs from a place where boxes of global tensors live."""

    band_bytes: int
    """Largest batch of bands :meth:`materialise` is asked for at once."""
    read_bytes: int
    checked_bytes: int

    def kind(self, name: str) -> str:
        """``"tensor"``, ``"str"`` or ``"map"``."""
        ...

    def ms_type(self, name: str) -> str: ...

    def string(self, name: str) -> str: ...

    def map_bytes(self, name: str) -> bytes: ...

    def file_ranges(self, name: str, box: Box) -> list[FileRange] | None:
        """The box's C-order bytes as ranges of files, when they lie so (else ``None``)."""
        ...

    def bands(self, name: str, box: Box) -> list[Box]:
        """The box cut into C-order pieces of at most ``band_bytes``."""
        ...

    def materialise(self, items: list[tuple[str, Box]]) -> list[np.ndarray]:
        """The boxes of a batch as arrays (in order)."""
        ...


def write_ckpt_rank(
    reader: BoxReader, rank: RankExport, target: Path, *, crc: bool = False, fsync: bool = True,
    overlap: bool | None = None, ticker: Ticker | None = None, publisher: Publisher | None = None,
) -> RankResult:
    """Write ``rank``'s slices from ``reader`` into the ``.ckpt`` file ``target`` (under a
    temporary name, renamed once complete: here, or by ``publisher`` on its thread while
    the caller writes the next file)."""
    tensors = 0
    direct: dict[str, list[FileRange]] = {}
    plan: list[tuple[str, list[Box]]] = []
    for s in rank.slices:
        if reader.kind(s.name) != "tensor":
            continue
        ranges = reader.file_ranges(s.name, s.box)
        if ranges is not None:
            direct[s.name] = ranges
        else:
            plan.append((s.name, reader.bands(s.name, s.box)))
    band_counts = {name: len(bands) for name, bands in plan}
    with contextlib.ExitStack() as stack:
        helper = (stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="zckpt-read"))
                  if wants_overlap(overlap) else None)
        source = BandSource(reader, [(name, b) for name, bands in plan for b in bands], reader.band_bytes, helper)
        w = stack.enter_context(CkptWriter(target, crc=crc, fsync=fsync, publisher=publisher))
        for s in rank.slices:
            kind = reader.kind(s.name)
            if kind == "str":
                w.write_string(s.name, reader.string(s.name))
            elif kind == "map":
                w.write_map(s.name, reader.map_bytes(s.name))
            elif s.name in direct:
                w.write_blocks(s.name, reader.ms_type(s.name), s.box.shape, direct[s.name])
                tensors += 1
            else:
                n = band_counts[s.name]
                w.write_blocks(s.name, reader.ms_type(s.name), s.box.shape, (source.next(s.name) for _ in range(n)))
                tensors += 1
            if ticker is not None and kind == "tensor":
                ticker.add(s.name, s.box.size * ms_dtype(reader.ms_type(s.name)).storage.itemsize)
    if ticker is not None:
        ticker.close()
    return RankResult(rank.rank, str(target), tensors, w.size, reader.read_bytes,
                      reader.checked_bytes)


class BandSource:
    """Hands out band arrays in plan order, reading them in batches of at most ``limit``
    bytes (bounded memory): with a ``helper`` thread, the next batch is read while the
    current one is written."""

    def __init__(self, reader: BoxReader, bands: list[tuple[str, Box]], limit: int,
                 helper: Executor | None = None) -> None:
        self.reader = reader
        self.helper = helper
        self.batches = collections.deque(self._batches(bands, limit))
        self.ready: collections.deque[tuple[str, np.ndarray]] = collections.deque()
        self.ahead: Future[list[np.ndarray]] | None = None
        self.ahead_batch: list[tuple[str, Box]] = []

    def _batches(self, bands: list[tuple[str, Box]], limit: int) -> list[list[tuple[str, Box]]]:
        out: list[list[tuple[str, Box]]] = []
        size = 0
        for name, box in bands:
            nbytes = box.size * ms_dtype(self.reader.ms_type(name)).storage.itemsize
            if not out or size + nbytes > limit:
                out.append([])
                size = 0
            out[-1].append((name, box))
            size += nbytes
        return out

    def _read_ahead(self) -> None:
        if self.helper is not None and self.batches:
            self.ahead_batch = self.batches.popleft()
            self.ahead = self.helper.submit(self.reader.materialise, self.ahead_batch)

    def _fill(self) -> None:
        if self.helper is None:
            batch = self.batches.popleft()
            arrays = self.reader.materialise(batch)
        else:
            if self.ahead is None:
                self._read_ahead()
            assert self.ahead is not None
            batch, arrays = self.ahead_batch, self.ahead.result()
            self.ahead = None
            self._read_ahead()
        for (name, _), arr in zip(batch, arrays, strict=True):
            self.ready.append((name, arr))

    def next(self, name: str) -> np.ndarray:
        if not self.ready:
            self._fill()
        got, arr = self.ready.popleft()
        assert got == name, f"band order broken: {got} != {name}"
        return arr
