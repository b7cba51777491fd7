"""Where an array's chunks lie: chunk shapes, shard grids, chunk keys and byte offsets.

Pure layout maths over shapes and the ``zarr.json`` an array was defined with: ingest chooses
chunk and shard shapes here, and every reader and writer of raw chunk files finds a chunk's
file and byte offset here (:class:`ChunkInfo`), so that writer and reader agree without
reading each other's files. Nothing here opens a file; what a chunk file holds and how it is
checked is :mod:`zckpt.store.chunk_files`.

Format 4 and later group the chunks of a local store into shards (Zarr's ``sharding_indexed``
codec): the chunk of format 3 becomes the shard's inner chunk, stored uncompressed at an
offset that follows from the layout alone (C order of the inner grid), so that several
writers fill disjoint byte ranges of one preallocated shard file and the shard index is
written once, when the array is defined (:func:`shard_grid`, :func:`write_runs`).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from zckpt.core.errors import StoreError
from zckpt.core.layout import Box, tiles
from zckpt.io.checksums import crc32c

NO_CHUNK = 2**64 - 1
"""Offset and size of an absent inner chunk in a shard index (Zarr's sharding codec)."""


def _raw_bytes_codec(codecs: Any) -> bool:
    """Whether a codec list is the single ``bytes`` codec in this machine's byte order."""
    if not (isinstance(codecs, (list, tuple)) and len(codecs) == 1 and isinstance(codecs[0], dict)
            and codecs[0].get("name") == "bytes"):
        return False
    return (codecs[0].get("configuration") or {}).get("endian") in (None, sys.byteorder)


def _raw_shards(codecs: list[Any]) -> tuple[int, ...] | None:
    """The inner chunk shape of a sharding codec whose inner chunks are raw bytes and whose
    index is zckpt's (little-endian, CRC-32C, at the end); else ``None``."""
    if len(codecs) != 1 or not isinstance(codecs[0], dict) or codecs[0].get("name") != "sharding_indexed":
        return None
    conf = codecs[0].get("configuration") or {}
    index = conf.get("index_codecs")
    if not (_raw_bytes_codec(conf.get("codecs")) and conf.get("index_location", "end") == "end"
            and isinstance(index, (list, tuple)) and len(index) == 2 and isinstance(index[0], dict)
            and index[0].get("name") == "bytes"
            and (index[0].get("configuration") or {}).get("endian", "little") == "little"
            and isinstance(index[1], dict) and index[1].get("name") == "crc32c"):
        return None
    return tuple(int(x) for x in conf["chunk_shape"])


@dataclass(frozen=True)
class ChunkInfo:
    """What a chunk-level reader or writer needs to know about an array.

    ``raw``: chunks are stored as their raw C-order values in this machine's byte order
    (the single ``bytes`` codec), so a chunk file is exactly its values' bytes. In a
    sharded array (``per_shard``: inner chunks per shard in each dimension) ``chunks`` is
    the inner chunk shape, and a raw inner chunk is ``inner_bytes`` at a fixed offset of its
    shard file (:meth:`locate`).
    """

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    raw: bool
    separator: str
    folder: Path | None
    per_shard: tuple[int, ...] | None = None
    itemsize: int = 0
    at: tuple[str, int, int] | None = None
    """A packed tensor (:mod:`zckpt.store.packed`): its one chunk is ``at[1]`` bytes into the
    chunk file ``at[0]`` of its packed array, a file of ``at[2]`` bytes."""

    @staticmethod
    def from_json(doc: Mapping[str, Any], folder: Path | None, itemsize: int = 0) -> ChunkInfo:
        codecs = list(doc.get("codecs") or [])
        grid = tuple(int(x) for x in doc["chunk_grid"]["configuration"]["chunk_shape"])
        inner = _raw_shards(codecs)
        raw = _raw_bytes_codec(codecs) or inner is not None
        enc = doc.get("chunk_key_encoding") or {}
        sep = str((enc.get("configuration") or {}).get("separator", "/"))
        if sep not in (".", "/"):  # Zarr v3 allows these two; any other could climb out of the array
            raise StoreError(f"chunk_key_encoding separator {sep!r} is neither '.' nor '/'",
                             path=None if folder is None else folder / "zarr.json")
        raw = raw and enc.get("name", "default") == "default"
        per_shard = None
        if inner is not None:
            per_shard = tuple(g // c for g, c in zip(grid, inner, strict=True))
            if any(g % c for g, c in zip(grid, inner, strict=True)) or itemsize <= 0:
                raw = False
        return ChunkInfo(
            shape=tuple(int(x) for x in doc["shape"]),
            chunks=inner if inner is not None else grid,
            raw=raw,
            separator=sep,
            folder=folder,
            per_shard=per_shard,
            itemsize=itemsize,
        )

    def chunk_key(self, coords: Sequence[int]) -> str:
        """Zarr v3's default chunk key: ``c`` followed by the chunk coordinates (of a shard,
        in a sharded array)."""
        if self.at is not None:
            return self.at[0]
        if not coords:
            return "c"
        return "c" + self.separator + self.separator.join([str(int(c)) for c in coords])

    @cached_property
    def prefix(self) -> str:
        """The array's folder as a path prefix of its chunk keys (``folder/``)."""
        return "" if self.folder is None else str(self.folder) + os.sep

    @cached_property
    def inner_bytes(self) -> int:
        return math.prod(self.chunks) * self.itemsize

    def locate(self, coords: Sequence[int]) -> tuple[str, int]:
        """``(file key, byte offset)`` of the chunk at ``coords`` (of the inner chunk grid
        in a sharded array: its shard's key and its place in the shard's C order)."""
        if self.at is not None:
            return self.at[0], self.at[1]
        if self.per_shard is None:
            return self.chunk_key(coords), 0
        shard = []
        linear = 0
        for c, k in zip(coords, self.per_shard, strict=True):
            q, i = divmod(int(c), k)
            shard.append(q)
            linear = linear * k + i
        return self.chunk_key(shard), linear * self.inner_bytes

    def file_bytes(self, coords: Sequence[int]) -> int:
        """Size of the file holding the chunk at ``coords``: the chunk, or its shard's data
        and index (inner chunks present form a box of the shard's grid, so the last one in
        C order is the one at the largest local coordinates)."""
        if self.at is not None:
            return self.at[2]
        if self.per_shard is None:
            return self.inner_bytes
        counts = self.grid_counts()
        last = 0
        for c, k, n in zip(coords, self.per_shard, counts, strict=True):
            first = (int(c) // k) * k
            last = last * k + (min(k, n - first) - 1)
        return (last + 1) * self.inner_bytes + 16 * math.prod(self.per_shard) + 4

    def grid_counts(self) -> tuple[int, ...]:
        """Number of (inner) chunks along each dimension."""
        return tuple(-(-s // c) for s, c in zip(self.shape, self.chunks, strict=True))

    def shard_layout(self, shard: Sequence[int]) -> tuple[int, bytes]:
        """Data bytes and index bytes (with its CRC-32C) of the shard at ``shard``: inner
        chunks inside the array at their C-order offsets, the others absent."""
        assert self.per_shard is not None
        per = np.array(self.per_shard, dtype=np.int64)[:, None]
        local = np.indices(self.per_shard, dtype=np.int64).reshape(len(self.per_shard), -1)  # C order
        start = np.array([int(s) for s in shard], dtype=np.int64)[:, None] * per
        inside = np.flatnonzero(np.all(start + local < np.array(self.grid_counts(), dtype=np.int64)[:, None], axis=0))
        index = np.full((math.prod(self.per_shard), 2), NO_CHUNK, dtype="<u8")
        index[inside, 0] = inside.astype("<u8") * self.inner_bytes
        index[inside, 1] = self.inner_bytes
        data = (int(inside[-1]) + 1) * self.inner_bytes if inside.size else 0
        body = index.tobytes()
        return data, body + int(crc32c(body)).to_bytes(4, "little")

    def keys_in(self, box: Box) -> list[str]:
        """Keys of every chunk ``box`` touches when chunks are stored raw (else none)."""
        if not self.raw:
            return []
        if box.ndim == 0:
            return [self.chunk_key(())]
        return [self.chunk_key(tuple(a // c for a, c in zip(t.start, self.chunks, strict=True)))
                for t in tiles(box, self.chunks)]

    def shard_count(self) -> tuple[int, ...]:
        assert self.per_shard is not None
        return tuple(-(-n // k) for n, k in zip(self.grid_counts(), self.per_shard, strict=True))


def shard_grid(shape: Sequence[int], chunks: Sequence[int], itemsize: int, target_bytes: int) -> tuple[int, ...] | None:
    """Inner chunks per shard in each dimension: the whole width of the array in every
    dimension but the first, and as many rows of chunks as fit ``target_bytes`` (at least
    one). With chunks spanning the full width, consecutive inner chunks of a shard are then
    consecutive rows of the array, so a range of rows is one byte range of the shard.
    ``None`` when a shard would hold a single chunk (the array is stored unsharded)."""
    if not shape or any(int(s) == 0 for s in shape):
        return None
    counts = [-(-int(s) // int(c)) for s, c in zip(shape, chunks, strict=True)]
    row = math.prod(counts[1:]) * math.prod(int(c) for c in chunks) * itemsize
    k0 = min(counts[0], max(1, target_bytes // max(1, row)))
    per = (k0, *counts[1:])
    return per if math.prod(per) > 1 else None


@dataclass(frozen=True)
class Run:
    """Consecutive inner chunks of one writer box that are one byte range of a shard file
    (a whole chunk file, unsharded): the unit ingest copies and checksums in one pass."""

    key: str
    """File key (``c.<i>...``) of the shard, or of the chunk."""
    offset: int
    length: int
    tiles: tuple[Box, ...]
    """The chunks' element boxes, in file order."""


def write_runs(info: ChunkInfo, box: Box) -> list[Run]:
    """The chunks of ``box`` (a writer box that the chunk grid divides) as runs: grouped by
    file and merged while each starts where the previous ends. Pure layout maths: the
    reader of a store finds the same runs from the writers' boxes."""
    if box.ndim == 0:
        return [Run(info.chunk_key(()), 0, info.itemsize, (box,))]
    if box.shape == info.chunks:  # one chunk (the grid divides writer boxes): most boxes of a many-rank job
        key, offset = info.locate(tuple(a // c for a, c in zip(box.start, info.chunks, strict=True)))
        return [Run(key, offset, info.inner_bytes, (box,))]
    placed = []
    for t in tiles(box, info.chunks):
        key, offset = info.locate(tuple(a // c for a, c in zip(t.start, info.chunks, strict=True)))
        placed.append((key, offset, t))
    placed.sort(key=lambda x: (x[0], x[1]))
    size = info.inner_bytes
    runs: list[Run] = []
    for key, offset, t in placed:
        last = runs[-1] if runs else None
        if info.per_shard is not None and last is not None and last.key == key \
                and last.offset + last.length == offset:
            runs[-1] = Run(key, last.offset, last.length + size, (*last.tiles, t))
        else:
            runs.append(Run(key, offset, size, (t,)))
    return runs


def chunk_shape(shard: Sequence[int], itemsize: int, target_bytes: int) -> tuple[int, ...]:
    """Largest chunk that divides ``shard`` in every dimension and fits ``target_bytes``.

    Dividing the shard keeps chunk borders on shard borders, so writers never share a chunk.
    An empty shard has no chunk to write: its chunk is its shape (dims may be huge).
    """
    c = [max(1, int(s)) for s in shard]
    if any(int(s) == 0 for s in shard):
        return tuple(c)
    for d in range(len(c)):
        if math.prod(c) * itemsize <= target_bytes:
            break
        others = math.prod(c) // c[d]
        c[d] = _largest_divisor_at_most(c[d], max(1, target_bytes // max(1, others * itemsize)))
    return tuple(c)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    """Largest divisor of ``n`` not above ``limit``, by trial division up to the square root
    (a non-empty dimension is bounded by its file's payload, so this stays small)."""
    if n <= limit:
        return n
    best = 1
    k = 1
    while k * k <= n:
        if n % k == 0:
            if k <= limit:
                best = max(best, k)
            if n // k <= limit:
                best = max(best, n // k)
        k += 1
    return best

