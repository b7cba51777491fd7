"""Small writes at rising offsets of many files, gathered as rows of one array.

A group of destination files filled source-major (:mod:`zckpt.write.group_writer`) gives
each file a thin part of every tensor it reads: a scale-up to 512 ranks writes 144 000
pieces of a few KiB, each after a ``.ckpt`` Value header of a few dozen bytes. One
``pwrite`` per piece and per header made the system calls the cost (288 000 calls); one
buffer per file, filled piece by piece, made the Python steps the cost (several per piece,
about 40 us of CPU each time). Here each file is a row of one window array: pieces arrive
at rising offsets of each file (the files' tensors are read in the files' order), so the
next piece of a row usually starts where the last ended, and the rows that stand at the
same point of the same framing (files of one layout, reached by the same band) take their
pieces with one array copy and their framing with one broadcast. A row is written with one
call when its window fills or a gap comes.

Small pieces are copied into the window (the band they come from is freed at once: memory
stays bounded by ``files x window``); a piece of at least ``window`` bytes is written straight
from where it lies. The framing of a file (known in advance) is written as the data reach
it, inside the same runs. Nothing is ever written twice or read back.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from zckpt.io.fileio import WriteBehind, disk_full_named, write_at

WINDOW = 128 * 1024
"""Bytes gathered per file before they are written."""

_END = 1 << 62
"""Past the end of any file: the offset after the last frame."""

Rows = np.ndarray
"""Row positions (``int64``)."""


class GatheredWrites:
    """The writes of several open files (rows): :meth:`put` data at offsets, :meth:`close` to
    write the rest (framing included). Offsets given to one row must not overlap.

    ``kinds[k]`` is row ``k``'s framing (an index into ``framings``): rows of one kind have
    the same framing bytes at the same offsets (files of one layout)."""

    def __init__(self, fds: Sequence[int], paths: Sequence[Path], framings: Sequence[Sequence[tuple[int, bytes]]],
                 kinds: Sequence[int], window: int = WINDOW, behind: WriteBehind | None = None) -> None:
        n = len(fds)
        self.behind = behind
        """Told every range written (keyed by ``str(path)``), to start its write-back."""
        self.fds = list(fds)
        self.paths = list(paths)
        self._keys = [str(p) for p in self.paths]  # the write-back's names of the files
        self.window = window
        self._buf = np.empty((n, window), dtype=np.uint8)  # pages are touched only as rows fill
        self._start = np.zeros(n, dtype=np.int64)
        self._used = np.zeros(n, dtype=np.int64)
        self._next = np.zeros(n, dtype=np.int64)
        self._kind = np.asarray(kinds, dtype=np.int64)
        self._frame_at: list[list[int]] = []
        self._frames: list[list[np.ndarray]] = []
        for framing in framings:
            frames = sorted(framing)
            self._frame_at.append([at for at, _ in frames] + [_END])
            self._frames.append([np.frombuffer(b, dtype=np.uint8) for _, b in frames])
        self.calls = 0
        """Writes made (for tests and benchmarks)."""

    def put(self, rows: Rows, at: Rows, data: np.ndarray, index: Rows | None = None) -> None:
        """Write ``data[j]`` (bytes, ``uint8``) to row ``rows[j]`` at offset ``at[j]``, after the
        framing of that file that lies before it; ``data`` is 2-D (one piece per row, or with
        ``index`` the piece ``data[index[j]]``: replicas share one) or 1-D (the same bytes for
        every row)."""
        pieces: np.ndarray | _Indexed = data if index is None else _Indexed(data, index)
        for sel in self._cohorts(rows, at):
            r = rows if sel is None else rows[sel]
            piece = pieces if sel is None or pieces.ndim == 1 else \
                pieces.rows(sel) if isinstance(pieces, _Indexed) else pieces[sel]
            k = int(r[0])
            offset = int(at[0] if sel is None else at[sel[0]])
            self._frames_before(r, k, offset)
            self._put(r, k, offset, piece)

    def put_one(self, row: int, at: int, data: memoryview | bytes | np.ndarray) -> None:
        """:meth:`put` of one piece."""
        piece = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        rows = np.array([row], dtype=np.int64)
        self._frames_before(rows, row, at)
        self._put(rows, row, at, piece.reshape(-1))

    def close(self) -> None:
        """Write the framing not yet written and everything gathered, row by row."""
        for k in range(len(self.fds)):
            rows = np.array([k], dtype=np.int64)
            self._frames_before(rows, k, _END)
            self._flush(rows, k)
        self._buf = np.empty((0, 0), dtype=np.uint8)

    def _cohorts(self, rows: Rows, at: Rows) -> list[np.ndarray | None]:
        """``rows`` split where their state differs (framing, next frame, gathered run,
        target offset): each cohort advances as one."""
        keys = (self._kind[rows], self._next[rows], self._start[rows], self._used[rows], at)
        if len(rows) == 1 or all(bool((k == k[0]).all()) for k in keys):
            return [None]
        _, inverse = np.unique(np.stack(keys, axis=1), axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        order = np.argsort(inverse, kind="stable")
        cuts = np.flatnonzero(np.diff(inverse[order])) + 1
        return list(np.split(order, cuts))

    def _frames_before(self, rows: Rows, k: int, offset: int) -> None:
        kind = int(self._kind[k])
        frame_at, frames = self._frame_at[kind], self._frames[kind]
        j = int(self._next[k])
        start = j
        while frame_at[j] < offset:
            self._put(rows, k, frame_at[j], frames[j])
            j += 1
        if j != start:
            self._next[rows] = j

    def _put(self, rows: Rows, k: int, offset: int, piece: np.ndarray | _Indexed) -> None:
        """Rows in one state (row ``k``'s): ``piece`` (one per row, or shared) at ``offset``."""
        n = piece.shape[-1]
        used = int(self._used[k])
        if used and (offset != int(self._start[k]) + used or used + n > self.window):
            self._flush(rows, k)
            used = 0
        if n >= self.window:
            for j, row in enumerate(rows.tolist()):
                self._write(row, _row(piece, j), offset)
            return
        if not used:
            self._start[rows] = offset
        whole = piece.array() if isinstance(piece, _Indexed) else piece
        if len(rows) == 1:
            self._buf[k, used : used + n] = whole.reshape(-1)
        else:
            self._buf[rows, used : used + n] = whole
        self._used[rows] = used + n

    def _flush(self, rows: Rows, k: int) -> None:
        used = int(self._used[k])
        if not used:
            return
        start = int(self._start[k])
        for row in rows.tolist():
            self._write(row, self._buf[row, :used], start)
        self._used[rows] = 0

    def _write(self, row: int, data: np.ndarray, at: int) -> None:
        with disk_full_named(self.paths[row]):
            write_at(self.fds[row], data.data if data.flags.c_contiguous else np.ascontiguousarray(data).data, at)
        self.calls += 1
        if self.behind is not None:
            self.behind.add([(self._keys[row], at, data.nbytes)])


def _row(piece: np.ndarray | _Indexed, j: int) -> np.ndarray:
    """Row ``j``'s piece: its own, or the one piece shared by every row (1-D)."""
    if isinstance(piece, _Indexed):
        return piece.row(j)
    return piece[j] if piece.ndim == 2 else piece


class _Indexed:
    """Pieces shared by several rows (replicas), row ``j``'s being ``data[index[j]]``, each
    taken where it lies: only a piece copied into the window is copied."""

    ndim = 2

    def __init__(self, data: np.ndarray, index: Rows) -> None:
        self.data = data
        self.index = index
        self.shape = (len(index), int(data.shape[1]))

    def rows(self, sel: np.ndarray) -> _Indexed:
        return _Indexed(self.data, self.index[sel])

    def row(self, j: int) -> np.ndarray:
        out: np.ndarray = self.data[int(self.index[j])]
        return out

    def array(self) -> np.ndarray:
        out: np.ndarray = self.data[self.index]
        return out
