"""Where a writer's bytes come from: the :class:`BoxReader` protocol and the one band batcher.

A destination file is a list of slices (:class:`~zckpt.plan.values.RankExport`); where their
bytes come from is a :class:`BoxReader`: the store (:class:`zckpt.store.reader.StoreReader`),
the source shards (:class:`zckpt.sources.reader.SourceReader`), one shard file or a read
callable (:mod:`zckpt.write.box_adapters`). Every writer (:mod:`zckpt.write.writers`) cuts the
slices it copies through memory into bands and reads them batch by batch through
:class:`BandSource` (at most ``band_bytes`` in memory, the next batch read on a helper thread
while the current one is written when ``overlap`` says so): a fix to batching is made here
once. What every writer shares lives here too: its :class:`WriterSettings` and what it
reports, a :class:`RankResult`. The writers themselves live beside this module, not in it.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.layout import Box
from zckpt.formats.entries import FileRange
from zckpt.run.engines import wants_overlap

LOCAL_BATCH_BYTES = 8 * 1024 * 1024
"""Largest batch of bands read at once from local files (the store's raw chunks, source
shards). Each fresh batch is memory the kernel must fault in and zero, at about the cost of
reading it: 128 MiB batches (a 1 GiB budget) made the 8 -> 4 benchmark fault in 600 MiB per
export (155 000 page faults, a quarter of its CPU time; 36 000 with 8 MiB batches). Batches
this small are served again from what the allocator freed; a few of them are read ahead
(:data:`AHEAD`) to keep the writer busy."""

AHEAD = 3
"""Batches read ahead at most (in order, on the one helper thread). With one, the reader and
the writer waited for each other in turn: a tp8xdp2 -> tp2xdp4 export from the store, cold,
spent 29% of its writer's time waiting for a batch while the reader sat idle 31% of its own
(a batch's read and its scatter take about as long, each varying with the disk)."""


def batch_bytes(block_bytes: int, overlap: bool, *, local: bool = True) -> int:
    """Largest batch of bands a reader hands out at once: ``block_bytes`` shared by the batch
    being written and those read ahead (:func:`batches_ahead`), and at most
    :data:`LOCAL_BATCH_BYTES` for local files (remote stores keep large batches, one ahead:
    their reads are concurrent round trips)."""
    limit = max(1, block_bytes // (1 + batches_ahead(local)) if overlap else block_bytes)
    return min(limit, LOCAL_BATCH_BYTES) if local else limit


def batches_ahead(local: bool) -> int:
    """Batches a reader of local files (:data:`AHEAD`) or of remote ones (1) has read ahead."""
    return AHEAD if local else 1


class WriteOptions(Protocol):
    """What the writers take from a job's options (:class:`zckpt.jobs.export_job.ExportOptions`)."""

    @property
    def crc(self) -> bool: ...

    @property
    def fsync(self) -> bool: ...

    @property
    def overlap(self) -> bool | None: ...

    @property
    def max_file_bytes(self) -> int: ...


BoxCorners = tuple[np.ndarray, np.ndarray]
"""Boxes of one tensor as two ``(boxes, ndim)`` arrays: their starts and their stops."""


@dataclass(frozen=True)
class WriterSettings:
    """How a writer writes, whatever its format (a format ignores what it has no use for)."""

    crc: bool = False
    """MindSpore's checksum: a ``.ckpt``'s ``crc_num`` trailer, a safetensors file's ``crc_num``."""
    fsync: bool = True
    overlap: bool = False
    """Read the next batch of bands on a second thread while this one is written."""
    max_file_bytes: int = 0
    """Split a safetensors rank above this size into parts plus an index (0: never)."""

    @classmethod
    def of(cls, options: WriteOptions) -> WriterSettings:
        """A job's options, with auto overlap (``None``) resolved for a task running alone."""
        return cls(options.crc, options.fsync, wants_overlap(options.overlap), options.max_file_bytes)


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
    """What a writer needs from a place where boxes of global tensors live."""

    @property
    def band_bytes(self) -> int:
        """Largest batch of bands :meth:`materialise` is asked for at once."""
        ...

    @property
    def batches_ahead(self) -> int:
        """Batches read ahead at most while one is written (when reading ahead at all)."""
        ...

    @property
    def read_bytes(self) -> int:
        """Bytes read so far for the data (a :class:`RankResult`'s ``read_bytes``)."""
        ...

    @property
    def checked_bytes(self) -> int:
        """Bytes read so far only to be checked or cut away."""
        ...

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


class BandSource:
    """The bands of a file's tensors, handed out in file order and read in batches of at
    most the reader's ``band_bytes`` (bounded memory): with a ``helper`` thread, the next
    batch is read while the current one is written. Every writer streams its tensors from
    one of these, so batching and read-ahead live here only."""

    def __init__(self, reader: BoxReader, boxes: Iterable[tuple[str, Box]], helper: Executor | None = None) -> None:
        self.reader = reader
        self.helper = helper
        self.counts: dict[str, int] = {}
        bands: list[tuple[str, Box]] = []
        for name, box in boxes:
            cut = reader.bands(name, box)
            self.counts[name] = len(cut)
            bands += [(name, b) for b in cut]
        self.batches = collections.deque(self._batches(bands, reader.band_bytes))
        self.ready: collections.deque[tuple[str, np.ndarray]] = collections.deque()
        self.ahead: collections.deque[tuple[list[tuple[str, Box]], Future[list[np.ndarray]]]] = collections.deque()

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
        while self.helper is not None and self.batches and len(self.ahead) < self.reader.batches_ahead:
            batch = self.batches.popleft()
            self.ahead.append((batch, self.helper.submit(self.reader.materialise, batch)))

    def _fill(self) -> None:
        if self.helper is None:
            batch = self.batches.popleft()
            arrays = self.reader.materialise(batch)
        else:
            self._read_ahead()
            batch, pending = self.ahead.popleft()
            arrays = pending.result()
            self._read_ahead()
        for (name, _), arr in zip(batch, arrays, strict=True):
            self.ready.append((name, arr))

    def next(self, name: str) -> np.ndarray:
        if not self.ready:
            self._fill()
        got, arr = self.ready.popleft()
        assert got == name, f"band order broken: {got} != {name}"
        return arr

    def take(self, name: str) -> Iterator[np.ndarray]:
        """The bands of ``name``, the next tensor in file order."""
        for _ in range(self.counts[name]):
            yield self.next(name)


@contextlib.contextmanager
def reading_ahead(overlap: bool) -> Iterator[Executor | None]:
    """The thread a :class:`BandSource` reads the next batch on, when ``overlap`` asks for one."""
    if not overlap:
        yield None
        return
    with ThreadPoolExecutor(1, thread_name_prefix="zckpt-read") as helper:
        yield helper
