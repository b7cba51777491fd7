"""Writing MindSpore ``.ckpt`` files: :class:`CkptWriter`.

Writing streams entry by entry (and block by block inside an entry) to a new file that is
given its name when complete, so a crash never leaves a file that looks finished. Blocks are
arrays or ranges of other files (:class:`~zckpt.formats.entries.FileRange`), copied file to
file through one buffer or by the kernel, their checks run on the way. The bytes themselves
are encoded by :mod:`zckpt.formats.ckpt_encoding`; reading is :mod:`zckpt.formats.ckpt`.
"""

from __future__ import annotations

import binascii
import collections
import mmap
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import CheckpointFormatError
from zckpt.formats.ckpt_encoding import CRC_MAGIC, map_value, string_value, tensor_values
from zckpt.formats.entries import FileRange
from zckpt.io import fileio
from zckpt.io.checksums import Sink
from zckpt.io.new_files import NewFile, Opener, local

Block = np.ndarray | FileRange
"""A piece of tensor data handed to :meth:`CkptWriter.write_blocks`."""


class CkptWriter:
    """Writes a ``.ckpt`` entry by entry to a new file beside it (:class:`~zckpt.io.new_files.NewFile`:
    unnamed where the system allows; or whatever ``files`` opens, e.g. an upload) and gives it
    its name on :meth:`commit`.

    Leaving the context without committing (an exception) drops the new file. A
    file range that carries checks is checked in the pass that copies it, so a failed check
    raises before the file is committed and leaves nothing under the final name.
    """

    def __init__(self, path: str | os.PathLike[str], *, crc: bool = False, fsync: bool = True,
                 publisher: fileio.Publisher | None = None, files: Opener = local) -> None:
        self.path = Path(path)
        self._publisher = publisher
        """Where a committed file is synced and renamed (on its thread), else here."""
        self.size = 0
        """The file's size once committed."""
        self._unflushed = False
        self._crc_enabled = crc
        self._fsync = fsync
        self._crc = 0
        self.bytes_written = 0
        self._buffer: bytearray | None = None
        self._names: set[str] = set()
        self._sources: collections.OrderedDict[Path, tuple[int, int]] = collections.OrderedDict()
        """Open source files of recent file ranges with their sizes (a job of hundreds of ranks
        copies thousands of ranges out of each file: one open and fstat per file, not per range)."""
        self._new = files(self.path, False)  # unnamed until published where the system allows
        self._kernel = isinstance(self._new, NewFile)
        """The file has a descriptor the kernel can copy into (not a remote upload)."""
        self._f: BinaryIO | None = self._new.file
        self._behind = fileio.WriteBehind(fileio.OpenFiles({str(self.path): self._f.fileno()})) \
            if self._kernel and fsync else None
        """Starts the write-back of what is written as the file grows: its sync at the end (a
        merge to one file: 2 GiB) then waits for little."""
        self._behind_at = 0

    def __enter__(self) -> CkptWriter:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is None and self._f is not None:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()

    def _write(self, data: bytes | memoryview) -> None:
        assert self._f is not None, "writer already closed"
        self._f.write(data)
        self._unflushed = True
        n = len(data) if isinstance(data, bytes) else data.nbytes
        self.bytes_written += n
        if self._behind is not None and self.bytes_written - self._behind_at >= BEHIND_BYTES:
            self._write_behind()
        if self._crc_enabled:
            self._crc = binascii.crc32(data, self._crc)

    def _write_behind(self) -> None:
        """Hand the bytes written since the last call to the write-back thread."""
        assert self._f is not None and self._behind is not None
        self._f.flush()
        self._unflushed = False
        self._behind.add([(str(self.path), self._behind_at, self.bytes_written - self._behind_at)])
        self._behind_at = self.bytes_written

    def _stop_behind(self) -> None:
        if self._behind is not None:
            self._behind.close()
            self._behind = None

    def _claim(self, name: str) -> None:
        if name in self._names:
            raise CheckpointFormatError("entry written twice", path=self.path, param=name)
        self._names.add(name)

    def write_array(self, name: str, ms_type: str, array: np.ndarray) -> None:
        """Write a whole in-memory tensor (a view is fine)."""
        self.write_blocks(name, ms_type, array.shape, iter([array]))

    def write_blocks(
        self, name: str, ms_type: str, shape: tuple[int, ...], blocks: Iterable[Block]
    ) -> None:
        """Stream a tensor given as consecutive blocks of its C-order bytes: arrays (row
        blocks), or ranges of other files (:meth:`_copy_range`).

        Tensors above MindSpore's slice size are split into several Values exactly as
        MindSpore does (np.array_split of axis 0), so readers see familiar files.
        """
        self._claim(name)
        dt = ms_dtype(ms_type, path=str(self.path), param=name).storage
        dims = list(shape)
        pending: np.ndarray | FileRange | None = None
        block_iter = coalesce(blocks)
        for header, need in tensor_values(name, ms_type, shape):
            self._write(header)
            while need > 0:
                if pending is None or _block_size(pending) == 0:
                    nxt = next(block_iter, None)
                    if nxt is None:
                        raise CheckpointFormatError(
                            f"tensor data ended {need} bytes early", path=self.path, param=name
                        )
                    pending = nxt if isinstance(nxt, FileRange) else _as_le_bytes(nxt, dt)
                take = min(need, _block_size(pending))
                if isinstance(pending, FileRange):
                    if take == pending.length:  # the usual case: a whole range
                        self._copy_range(pending)
                        pending = None
                        need -= take
                        continue
                    self._copy_range(pending.part(0, take))
                    pending = pending.part(take, pending.length - take)
                else:
                    self._write(pending[:take].data)
                    pending = pending[take:]
                need -= take
        leftover = (0 if pending is None else _block_size(pending)) + sum(
            b.length if isinstance(b, FileRange) else _as_le_bytes(b, dt).size for b in block_iter
        )
        if leftover:
            raise CheckpointFormatError(
                f"tensor data has {leftover} bytes more than shape {dims} needs", path=self.path, param=name
            )

    def _copy_range(self, block: FileRange) -> None:
        """Append a file range: through the writer's buffer in one pass (each byte read once,
        passed to the range's checks and the CRC trailer while in the CPU cache, then
        written), or by the kernel when nothing needs the bytes and the range's pages line
        up with the file's (:meth:`_kernel_copies`)."""
        assert self._f is not None, "writer already closed"
        src, size = self._source(block.path)
        if size < block.offset + block.length:
            raise CheckpointFormatError(
                f"block {block.offset}+{block.length} lies past the end of the file", path=block.path
            )
        if block.verify:
            self._copy_verified(block, src)
        else:
            self._copy_bytes(block.path, src, block.offset, block.length, block.check)

    def _kernel_copies(self, offset: int) -> bool:
        """Whether ``copy_file_range`` is the cheaper copy of source bytes at ``offset`` to the
        file's end: only when they fall at the same place in a page. Otherwise ext4 splices
        each source page into two destination pages and costs more than a read and a write
        through the buffer (bench/bench_copy.py)."""
        return self._kernel and not self._crc_enabled and (offset - self.bytes_written) % mmap.PAGESIZE == 0

    def _copy_bytes(self, path: Path, src: int, offset: int, length: int, check: Sink | None) -> None:
        """Append ``length`` bytes of ``src`` at ``offset``, passing them to ``check``."""
        assert self._f is not None, "writer already closed"
        done = 0
        if check is None and self._kernel_copies(offset):
            if self._unflushed:  # the kernel writes at the file's position: what Python buffers goes first
                self._f.flush()
                self._unflushed = False
            done = fileio.kernel_copy(src, self._f.fileno(), offset, length)
            self.bytes_written += done
            if self._behind is not None and self.bytes_written - self._behind_at >= BEHIND_BYTES:
                self._write_behind()
        view = self._view()
        while done < length:
            n = os.preadv(src, [view[: min(len(view), length - done)]], offset + done)
            if not n:
                raise CheckpointFormatError(f"file ended after {done} of {length} bytes", path=path)
            if check is not None:
                check(offset + done, view[:n])
            self._write(view[:n])
            done += n

    def _copy_verified(self, block: FileRange, src: int) -> None:
        """Copy a range while its checks read the recorded blocks it lies in: the bytes they
        read from the range are written on the way (read once, checked while in the CPU
        cache); the parts they do not read (blocks checked already for an earlier range) are
        copied plainly, in order. A ``check`` of the range receives its bytes as written."""
        stop = block.offset + block.length
        pos = block.offset
        check = block.check
        view = self._view()

        def read_at(path: Path, offset: int, length: int) -> memoryview:
            nonlocal pos
            if path != block.path:
                raise AssertionError(f"a check of a range of {block.path} reads {path}")
            if pos < min(offset, stop):  # bytes of the range before these: copied first
                self._copy_bytes(block.path, src, pos, min(offset, stop) - pos, check)
                pos = min(offset, stop)
            data = view[: os.preadv(src, [view[: min(length, len(view))]], offset)]
            lo, hi = max(offset, pos), min(offset + len(data), stop)
            if lo == pos and lo < hi:
                if check is not None:
                    check(lo, data[lo - offset : hi - offset])
                self._write(data[lo - offset : hi - offset])
                pos = hi
            return data

        for c in block.verify:
            c.run(read_at)
        if pos < stop:
            self._copy_bytes(block.path, src, pos, stop - pos, check)

    def _view(self) -> memoryview:
        if self._buffer is None:
            self._buffer = bytearray(fileio.BLOCK)
        return memoryview(self._buffer)

    def _source(self, path: Path) -> tuple[int, int]:
        """``(fd, size)`` of a range's source file, kept open for the next ranges from it."""
        got = self._sources.get(path)
        if got is not None:
            self._sources.move_to_end(path)
            return got
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointFormatError("block source file is missing", path=path) from None
        got = self._sources[path] = (fd, os.fstat(fd).st_size)
        if len(self._sources) > OPEN_SOURCES:
            os.close(self._sources.popitem(last=False)[1][0])
        return got

    def _close_sources(self) -> None:
        while self._sources:
            os.close(self._sources.popitem()[1][0])

    def write_string(self, name: str, value: str) -> None:
        """Write an ``append_dict`` string entry the way MindSpore does (dims [0], type "str")."""
        self._claim(name)
        self._write(string_value(name, value))

    def write_map(self, name: str, body: bytes) -> None:
        """Write a MapParameter entry from its encoded ``MapTensorProto`` body (passed through)."""
        self._claim(name)
        self._write(map_value(name, body))

    def commit(self) -> Path:
        """Finish the file: trailer, flush, fsync, atomic rename to the final name (with a
        publisher: handed to it, which syncs and renames it on its thread)."""
        assert self._f is not None, "writer already closed"
        if self._crc_enabled:
            self._f.write(CRC_MAGIC + self._crc.to_bytes(10, "big"))
        f, self._f = self._f, None
        self._close_sources()
        self._stop_behind()
        f.flush()
        self.size = f.tell()
        if self._publisher is not None:
            self._publisher.submit(self._new)
        else:
            self._new.publish(self._fsync)
        return self.path

    def abort(self) -> None:
        self._close_sources()
        self._stop_behind()
        self._f = None
        self._new.discard()


BEHIND_BYTES = 8 * 1024 * 1024
"""Bytes written between two hand-overs to the write-back thread."""

OPEN_SOURCES = 64
"""Source files a writer keeps open at once (least recently used closed first)."""


def coalesce(blocks: Iterable[Block]) -> Iterator[Block]:
    """Merge consecutive file ranges that continue each other in the same file (with the same
    check): a destination slice over many small source chunks becomes one copy per run."""
    run: FileRange | None = None
    for b in blocks:
        if isinstance(b, FileRange):
            if run is not None and b.path == run.path and b.offset == run.offset + run.length and b.check is run.check:
                run = FileRange(run.path, run.offset, run.length + b.length, run.check, run.verify + b.verify)
                continue
            if run is not None:
                yield run
            run = b
            continue
        if run is not None:
            yield run
            run = None
        yield b
    if run is not None:
        yield run


def _block_size(block: np.ndarray | FileRange) -> int:
    return block.length if isinstance(block, FileRange) else int(block.size)


def _as_le_bytes(block: np.ndarray, dt: np.dtype) -> np.ndarray:
    arr = np.asarray(block)
    if arr.dtype != dt:
        if arr.dtype.itemsize != dt.itemsize or arr.dtype.kind not in "biuf":
            raise CheckpointFormatError(f"block dtype {arr.dtype} does not match {dt}")
        arr = arr.view(dt)
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
