"""Chunk checksums: one CRC-32C per block of each stored chunk (or, in a sharded store, of
each run of inner chunks one source rank wrote into a shard file).

Why blocks and not one sum per chunk: a destination rank often reads only part of a chunk
(an optimizer shard of a row-parallel weight is half of its rows). With one sum over the
whole chunk it would have to read the rest only to check it: 1.4x the bytes it needs on the
benchmark model. With one sum per ``BLOCK_BYTES`` it reads at most one block beyond either
end of its range. Stores written before blocks carry one sum per chunk, which this module
reads as a single block spanning the chunk, so every caller has one code path.

Everything here is a pure function or a small object fed bytes in file order; reading
files is limited to :class:`SpanCheck`'s edges and :func:`file_sums`.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import google_crc32c
import numpy as np

from zckpt.core.errors import StoreError
from zckpt.io import safe_paths

BLOCK_BYTES = 256 * 1024
"""Checksum block of new stores. Smaller blocks read less beyond a range's edges, larger
ones record fewer sums. On the 4 GiB benchmark model (bench/RESULTS.md) export read
amplification was 1.0245 with 256 KiB blocks and 1.0948 with 1 MiB; a 4 GiB model records
16 384 sums (about 180 KB of JSON across the ranks' progress groups)."""

Algo = Literal["crc32c", "crc32"]


def crc32c(data: Any, start: int = 0) -> int:
    """CRC-32C (Castagnoli, Zarr v3's ``crc32c`` codec) of any buffer, extending ``start``."""
    return int(google_crc32c.extend(start, np.frombuffer(data, dtype=np.uint8)))


def extend(algo: Algo, data: Any, start: int = 0) -> int:
    """``algo``'s checksum of ``data`` continuing from ``start`` (zlib CRC-32: stores
    written before 2026-11-23)."""
    return crc32c(data, start) if algo == "crc32c" else zlib.crc32(data, start)


def _name(algo: Algo) -> str:
    return "CRC-32C" if algo == "crc32c" else "CRC-32"


@dataclass(frozen=True)
class Mismatch:
    """Why stored bytes fail their record: a block whose sum differs, or a chunk whose
    size does not match the number of recorded blocks (``got`` is then ``None``)."""

    block: int
    blocks: int
    algo: Algo
    expected: int | None
    got: int | None
    span: tuple[int, int]

    def __str__(self) -> str:
        lo, hi = self.span
        where = "" if self.blocks == 1 else f"block {self.block} of {self.blocks}, bytes {lo}-{hi}: "
        if self.got is None or self.expected is None:
            return f"{where}the chunk's size does not match its {self.blocks} recorded {_name(self.algo)} sum(s)"
        return f"{where}recorded {_name(self.algo)} {self.expected:#010x}, stored bytes give {self.got:#010x}"


@dataclass(frozen=True)
class ChunkSums:
    """The recorded sums of one chunk: ``values[i]`` covers bytes ``[i*b, (i+1)*b)`` with
    ``b = block_bytes`` (the last block shorter), or, with ``block_bytes`` ``None``, one
    value covers the whole chunk (stores written before block sums)."""

    algo: Algo
    values: tuple[int, ...]
    block_bytes: int | None = None
    origin: int = 0
    """Byte offset of the record's first byte in its file: 0 for a chunk file; in a shard
    file (format 4), where the run of inner chunks one source rank wrote starts."""
    length: int | None = None
    """Bytes the record covers (a run in a shard file); ``None``: the whole file."""

    def where(self) -> str:
        """How messages place the record in its file: nothing for a whole chunk file, the
        run's byte range for a run of a shard (followed by a separator)."""
        if self.length is None:
            return ""
        return f"run of bytes {self.origin}-{self.origin + self.length}, "

    def covers(self, start: int, stop: int) -> tuple[int, int] | None:
        """The part of file bytes ``[start, stop)`` inside this record, as offsets relative to
        :attr:`origin` (``None`` when they do not meet)."""
        end = self.origin + self.length if self.length is not None else stop
        lo, hi = max(start, self.origin), min(stop, end)
        return (lo - self.origin, hi - self.origin) if lo < hi else None

    def block_size(self, chunk_bytes: int) -> int:
        return self.block_bytes or max(1, chunk_bytes)

    def span(self, start: int, stop: int, chunk_bytes: int) -> tuple[int, int]:
        """The bytes of the blocks that ``[start, stop)`` touches (what checking it reads)."""
        b = self.block_size(chunk_bytes)
        return (start // b) * b, min(max(chunk_bytes, stop), -(-stop // b) * b)

    def blocks_in(self, start: int, stop: int, chunk_bytes: int) -> range:
        lo, hi = self.span(start, stop, chunk_bytes)
        b = self.block_size(chunk_bytes)
        return range(lo // b, max(lo // b + 1, -(-hi // b)))

    def compare(self, got: Sequence[int], first: int, chunk_bytes: int, whole: bool = False) -> Mismatch | None:
        """The first of ``got`` (sums of blocks ``first, first+1, ...``) that differs from the
        record; ``whole``: ``got`` claims to cover the whole chunk, so its count must match."""
        b = self.block_size(chunk_bytes)
        n = len(self.values)
        for i, value in enumerate(got):
            k = first + i
            span = (k * b, min(chunk_bytes, (k + 1) * b))
            if k >= n:
                return Mismatch(k, n, self.algo, None, None, span)
            if value != self.values[k]:
                return Mismatch(k, n, self.algo, self.values[k], value, span)
        if whole and first + len(got) != n:
            return Mismatch(first + len(got), n, self.algo, None, None, (chunk_bytes, chunk_bytes))
        return None

    def check_whole(self, data: Any) -> Mismatch | None:
        """Check a whole chunk's bytes, held in memory."""
        size = len(np.frombuffer(data, dtype=np.uint8))
        return self.compare(block_sums(data, self.block_size(size), self.algo), 0, size, whole=True)


def block_sums(data: Any, block_bytes: int, algo: Algo = "crc32c") -> list[int]:
    """Per-block sums of a buffer held in memory."""
    flat = np.frombuffer(data, dtype=np.uint8)
    if flat.size == 0:
        return [extend(algo, b"")]
    return [extend(algo, flat[i : i + block_bytes]) for i in range(0, flat.size, block_bytes)]


class BlockSummer:
    """Per-block sums of bytes fed in file order from ``origin`` (a block boundary), e.g.
    while ingest copies a chunk: the sums come out of the copy pass itself."""

    def __init__(self, block_bytes: int, origin: int = 0, algo: Algo = "crc32c") -> None:
        self.block_bytes, self.algo = block_bytes, algo
        self.next = origin
        self.done: list[int] = []
        self._value = 0
        self._filled = 0

    def feed(self, offset: int, data: Any) -> None:
        """Add the bytes at file ``offset`` (must follow the previous ones)."""
        if offset != self.next:
            raise AssertionError(f"summed bytes fed out of order: at {offset}, expected {self.next}")
        flat = np.frombuffer(data, dtype=np.uint8)
        pos = 0
        while pos < flat.size:
            take = min(flat.size - pos, self.block_bytes - self._filled)
            self._value = extend(self.algo, flat[pos : pos + take], self._value)
            self._filled += take
            pos += take
            if self._filled == self.block_bytes:
                self.done.append(self._value)
                self._value, self._filled = 0, 0
        self.next += flat.size

    def result(self) -> list[int]:
        """Sums of every block fed (the last possibly short; one sum for no bytes)."""
        return self.done + ([self._value] if self._filled or not self.done else [])


Sink = Callable[[int, memoryview], None]
"""Receives the bytes a copy passes along: ``sink(file_offset, data)``, in file order."""


def _pread_exact(fd: int, offset: int, length: int, path: Path) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise OSError(f"{path}: ended after {len(data)} of {length} bytes at {offset}")
    return data


class SpanCheck:
    """Checks the blocks covering ``[offset, offset + length)`` of a chunk (or run) while a
    reader or copier feeds exactly those bytes in order (:meth:`feed`, a :data:`Sink`).
    The parts of the first and last block outside the range are read from ``path`` here
    (at most one block at each end; :attr:`extra` counts them), so the range itself is
    read once, by whoever uses it. ``fail(mismatch)`` makes the error raised."""

    def __init__(self, path: Path, sums: ChunkSums, chunk_bytes: int, offset: int, length: int,
                 fail: Callable[[Mismatch], Exception], base: int = 0) -> None:
        self.path, self.sums, self.chunk_bytes, self.fail = path, sums, chunk_bytes, fail
        self.base = base
        """File offset of the record's byte 0: offsets given to :meth:`feed` are file offsets,
        ``offset`` and the record's blocks are relative to it (a run inside a shard file)."""
        self.lo, self.hi = sums.span(offset, offset + length, chunk_bytes)
        self.start, self.stop = offset, offset + length
        self.extra = (offset - self.lo) + (self.hi - self.stop)
        block = sums.block_size(chunk_bytes)
        self.summer = BlockSummer(block, self.lo, sums.algo)
        self.first = self.lo // block
        self.compared = 0
        if offset > self.lo:
            self._feed_from_file(self.lo, offset - self.lo)
        if length == 0:
            self._finish()

    def _feed_from_file(self, offset: int, length: int) -> None:
        fd = safe_paths.open_read(self.path, StoreError)
        try:
            self.summer.feed(offset, _pread_exact(fd, self.base + offset, length, self.path))
        finally:
            os.close(fd)

    def _compare(self, values: Sequence[int]) -> None:
        bad = self.sums.compare(values, self.first + self.compared, self.chunk_bytes)
        if bad is not None:
            raise self.fail(bad)
        self.compared += len(values)

    def feed(self, offset: int, data: Any) -> None:
        """The range's bytes at file ``offset``; blocks are compared as they complete."""
        offset -= self.base
        if offset + len(np.frombuffer(data, dtype=np.uint8)) > self.stop:
            raise AssertionError(f"checked range overrun: {offset}+{len(data)} past {self.stop}")
        self.summer.feed(offset, data)
        self._compare(self.summer.done[self.compared :])
        if self.summer.next == self.stop:
            self._finish()

    def _finish(self) -> None:
        if self.hi > self.stop:
            self._feed_from_file(self.stop, self.hi - self.stop)
        if self.summer.next != self.hi:
            raise AssertionError(f"checked range ended at {self.summer.next}, expected {self.hi}")
        self._compare(self.summer.result()[self.compared :])


ReadAt = Callable[[Path, int, int], memoryview]
"""``read_at(path, offset, length)``: at most ``length`` bytes of a file from ``offset`` (fewer
only at its end; empty past it), as a view valid until the next call."""


class RangeCheck(Protocol):
    """A check a writer runs once it has copied a file range (:class:`BlockCheck`, or one
    that works out its blocks where it runs)."""

    @property
    def nbytes(self) -> int:
        """About the bytes it reads (how checks are gathered into batches)."""
        ...

    def run(self, read_at: ReadAt) -> None: ...


@dataclass(frozen=True)
class BlockCheck:
    """The recorded blocks a byte range of one file touches, checked by reading them whole
    through ``read_at`` (a writer copying the range serves the reads and writes the range's
    part of them on the way). ``parts``: per record the range meets, in file order, ``(sums,
    record bytes, first block, stop block)``. Plain data, cheap to make: a destination file
    copies thousands of ranges."""

    path: Path
    parts: tuple[tuple[ChunkSums, int, int, int], ...]
    fail: Callable[[ChunkSums, Mismatch], Exception]

    @property
    def nbytes(self) -> int:
        """Bytes the check reads."""
        total = 0
        for sums, size, first, stop in self.parts:
            b = sums.block_size(size)
            total += min(size, stop * b) - first * b
        return total

    def run(self, read_at: ReadAt) -> None:
        for sums, size, first, stop in self.parts:
            b = sums.block_size(size)
            pos, end = first * b, min(size, stop * b)
            got: list[int] = []
            value = filled = 0
            while pos < end:
                data = read_at(self.path, sums.origin + pos, end - pos)
                n = len(data)
                if not n:
                    raise self.fail(sums, Mismatch(pos // b, len(sums.values), sums.algo, None, None, (pos, end)))
                i = 0
                while i < n:
                    take = min(n - i, b - filled)
                    value = extend(sums.algo, data[i : i + take], value)
                    filled += take
                    i += take
                    if filled == b:
                        got.append(value)
                        value = filled = 0
                pos += n
            if filled or not got:
                got.append(value)
            bad = sums.compare(got, first, size)
            if bad is not None:
                raise self.fail(sums, bad)


class SpanChecks:
    """Several :class:`SpanCheck` fed as one :data:`Sink`: a byte range of a shard file that
    crosses the runs of several writers (each run has its own record). Each check receives
    exactly the bytes of its part, in order."""

    def __init__(self, checks: Sequence[SpanCheck]) -> None:
        self.checks = sorted(checks, key=lambda c: c.base + c.start)

    def feed(self, offset: int, data: Any) -> None:
        flat = np.frombuffer(data, dtype=np.uint8)
        end = offset + flat.size
        for c in self.checks:
            lo, hi = max(offset, c.base + c.start), min(end, c.base + c.stop)
            if lo < hi:
                c.feed(lo, flat[lo - offset : hi - offset])


def file_sums(path: Path, block_bytes: int | None, algo: Algo = "crc32c",
              buffer: bytearray | None = None, start: int = 0, length: int | None = None) -> tuple[list[int], int]:
    """Per-block sums (one sum when ``block_bytes`` is ``None``) and size of a whole file,
    or of ``length`` bytes from ``start`` (a run of a shard file; the size returned is what
    the file holds of them), read through one buffer (faster than summing mapped pages: no
    page faults)."""
    with safe_paths.open_binary(path, StoreError) as f:
        size = os.fstat(f.fileno()).st_size - start
        if length is not None:
            size = max(0, min(size, length))
        summer = BlockSummer(block_bytes or max(1, size), 0, algo)
        view = memoryview(buffer if buffer is not None else bytearray(min(BLOCK_BYTES, max(1, size))))
        offset = 0
        while offset < size:
            n = os.preadv(f.fileno(), [view[: min(len(view), size - offset)]], start + offset)
            if not n:
                break
            summer.feed(offset, view[:n])
            offset += n
    return summer.result(), offset
