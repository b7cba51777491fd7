"""Small writes at rising offsets of one file, gathered into few ``pwritev`` calls.

A group of destination files filled source-major (:mod:`zckpt.write.group_writer`) gives
each file a thin part of every tensor it reads: a scale-up to 512 ranks writes 144 000
pieces of a few KiB, each after a ``.ckpt`` Value header of a few dozen bytes. One
``pwrite`` per piece and per header made the system calls, not the bytes, the cost (288 000
calls, about half of that export's CPU time). Pieces arrive at rising offsets of each file
(the files' tensors are read in the files' order), so the next piece usually starts where
the last one ended: such runs are kept in a buffer of the file and written with one call.

Small pieces are copied into the buffer (the band they come from is freed at once: memory
stays bounded by ``files x limit``); a piece of at least ``limit`` bytes is written straight
from where it lies. The framing of the file (known in advance) is written as the data
reaches it, inside the same runs. Nothing is ever written twice or read back.
"""

from __future__ import annotations

from collections.abc import Sequence

from zckpt.io.fileio import write_at

LIMIT = 128 * 1024
"""Bytes gathered for one file before they are written."""

_END = 1 << 62
"""Past the end of any file: the offset after the last frame."""


class GatheredWrites:
    """The writes of one open file: :meth:`add` data at an offset, :meth:`close` to write
    the rest (framing included). Offsets given must not overlap."""

    def __init__(self, fd: int, framing: Sequence[tuple[int, bytes]] = (), limit: int = LIMIT) -> None:
        self.fd = fd
        self.limit = limit
        frames = sorted(framing)
        self._frame_at = [at for at, _ in frames] + [_END]
        self._frames = [header for _, header in frames]
        self._next_frame = 0
        self._buf: memoryview | None = None  # allocated at the first small write, then reused
        self._used = 0
        self._start = 0
        self.calls = 0
        """Writes made (for tests and benchmarks)."""

    def add(self, offset: int, data: memoryview | bytes) -> None:
        """Write ``data`` at ``offset``, now or with the next call (framing before it first)."""
        while self._frame_at[self._next_frame] < offset:
            k = self._next_frame
            self._next_frame = k + 1
            self._put(self._frame_at[k], self._frames[k])
        self._put(offset, data)

    def _put(self, offset: int, data: memoryview | bytes) -> None:
        n = len(data) if isinstance(data, bytes) else data.nbytes
        used = self._used
        if used and (offset != self._start + used or used + n > self.limit):
            self.flush()
            used = 0
        if n >= self.limit:
            self._write(data, offset)
            return
        if self._buf is None:
            self._buf = memoryview(bytearray(self.limit))
        if not used:
            self._start = offset
        self._buf[used : used + n] = data
        self._used = used + n

    def flush(self) -> None:
        """Write what is gathered."""
        if self._used:
            assert self._buf is not None
            self._write(self._buf[: self._used], self._start)
            self._used = 0

    def close(self) -> None:
        """Write the framing not yet written and everything gathered."""
        for k in range(self._next_frame, len(self._frames)):
            self._put(self._frame_at[k], self._frames[k])
        self._next_frame = len(self._frames)
        self.flush()
        self._buf = None

    def _write(self, data: memoryview | bytes, at: int) -> None:
        write_at(self.fd, data, at)
        self.calls += 1
