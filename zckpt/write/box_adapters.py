"""Small :class:`~zckpt.write.boxes.BoxReader` s, so that every writer serves every job.

The store and the source shards have readers of their own (:mod:`zckpt.store.reader`,
:mod:`zckpt.sources.reader`). The jobs that write files without a plan of global boxes need
only these: one shard file read entry by entry (file conversion, the unified directory's
hyper-parameters), a callable that reads a region of an entry (``load_distributed_checkpoint``
saving ranks), and another reader's entries under new names (``name_map``, ``choice_func``).
Nothing here writes a file or knows a format's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import OutputError
from zckpt.core.layout import Box
from zckpt.formats.entries import FileRange
from zckpt.formats.shard_reader import ShardReader
from zckpt.write.boxes import BoxReader


class ShardBoxes:
    """One shard file's entries, whole (each box is :meth:`Box.full` of the entry's shape),
    read through memory in blocks of whole rows of at most ``block_bytes``."""

    def __init__(self, shard: ShardReader, block_bytes: int) -> None:
        self.shard = shard
        self.band_bytes = block_bytes
        self.batches_ahead = 1
        self.read_bytes = 0
        self.checked_bytes = 0

    def kind(self, name: str) -> str:
        return self.shard.entries[name].kind

    def ms_type(self, name: str) -> str:
        return self.shard.entries[name].ms_type

    def string(self, name: str) -> str:
        return self.shard.string(name)

    def map_bytes(self, name: str) -> bytes:
        return self.shard.map_bytes(name)

    def file_ranges(self, name: str, box: Box) -> list[FileRange] | None:
        return None

    def bands(self, name: str, box: Box) -> list[Box]:
        """Blocks of whole rows, as :meth:`ShardReader.row_blocks` cuts them."""
        shape = box.shape
        row_bytes = math.prod(shape[1:]) * ms_dtype(self.ms_type(name)).storage.itemsize if shape else 0
        if not shape or row_bytes == 0 or shape[0] == 0:
            return [box]
        per = max(1, self.band_bytes // row_bytes)
        return [Box((r, *box.start[1:]), (min(shape[0], r + per), *box.stop[1:])) for r in range(0, shape[0], per)]

    def materialise(self, items: list[tuple[str, Box]]) -> list[np.ndarray]:
        out = []
        for name, box in items:
            whole = box.ndim == 0 or box.size == 0
            arr = self.shard.array(name) if whole else self.shard.rows(name, box.start[0], box.stop[0])
            self.read_bytes += arr.nbytes
            out.append(arr)
        return out


class RegionBoxes:
    """Entries ``(name, kind, ms_type, box)`` read by ``read(name, box)`` (an array, or a
    string entry's value), one region per batch: each is read whole, as the callable gives it."""

    def __init__(self, entries: Sequence[tuple[str, str, str, Box]], read: Callable[[str, Box], np.ndarray | str]
                 ) -> None:
        self.entries = {n: (kind, ms_type, box) for n, kind, ms_type, box in entries}
        self.read = read
        self.band_bytes = 1
        self.batches_ahead = 1
        self.read_bytes = 0
        self.checked_bytes = 0

    def kind(self, name: str) -> str:
        return self.entries[name][0]

    def ms_type(self, name: str) -> str:
        return self.entries[name][1]

    def string(self, name: str) -> str:
        return str(self.read(name, self.entries[name][2]))

    def map_bytes(self, name: str) -> bytes:
        """Refused by name: a loaded rank's regions are tensors and strings; a MapParameter
        entry has no region to read."""
        raise OutputError("a MapParameter entry cannot be written from a loaded rank's regions", param=name)

    def file_ranges(self, name: str, box: Box) -> list[FileRange] | None:
        return None

    def bands(self, name: str, box: Box) -> list[Box]:
        return [box]

    def materialise(self, items: list[tuple[str, Box]]) -> list[np.ndarray]:
        out = []
        for name, box in items:
            arr = self.read(name, box)
            assert isinstance(arr, np.ndarray)
            out.append(arr.view(ms_dtype(self.ms_type(name)).storage))
        return out


class Renamed:
    """``reader``'s entries under new names: ``names`` maps each new name to the reader's."""

    def __init__(self, reader: BoxReader, names: Mapping[str, str]) -> None:
        self.reader = reader
        self.names = names
        self.band_bytes = reader.band_bytes
        self.batches_ahead = reader.batches_ahead

    @property
    def read_bytes(self) -> int:
        return self.reader.read_bytes

    @property
    def checked_bytes(self) -> int:
        return self.reader.checked_bytes

    def _old(self, name: str) -> str:
        return self.names.get(name, name)

    def kind(self, name: str) -> str:
        return self.reader.kind(self._old(name))

    def ms_type(self, name: str) -> str:
        return self.reader.ms_type(self._old(name))

    def string(self, name: str) -> str:
        return self.reader.string(self._old(name))

    def map_bytes(self, name: str) -> bytes:
        return self.reader.map_bytes(self._old(name))

    def file_ranges(self, name: str, box: Box) -> list[FileRange] | None:
        return self.reader.file_ranges(self._old(name), box)

    def bands(self, name: str, box: Box) -> list[Box]:
        return self.reader.bands(self._old(name), box)

    def materialise(self, items: list[tuple[str, Box]]) -> list[np.ndarray]:
        return self.reader.materialise([(self._old(n), b) for n, b in items])
