"""Copying byte ranges between open files: in the kernel when it can, else through one
reusable buffer (bounded memory, no fresh allocation per block). A copy can pass the
bytes it moves to a :data:`zckpt.checksums.Sink` (checksums summed or checked in the same
pass)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from zckpt import safe_paths
from zckpt.checksums import Sink
from zckpt.errors import DiskFullError

BLOCK = 1024 * 1024
"""Copy buffer size: large enough for few system calls, small enough that the bytes just
read are still in the CPU cache when written (16 MiB measured slower on tmpfs)."""


def kernel_copy(src: int, dst: int, offset: int, length: int) -> int:
    """``copy_file_range`` from ``src`` at ``offset`` to ``dst`` at its position; returns the
    bytes copied (fewer than ``length``, possibly 0, when the kernel cannot, e.g. across
    filesystems: the caller copies the rest)."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src, dst, length - done, offset + done)
        except OSError:
            return done
        if n == 0:
            return done
        done += n
    return done


def _blocks(src: int, offset: int, length: int, view: memoryview) -> Iterator[tuple[int, memoryview]]:
    """The range read into ``view`` one block at a time, with each block's file offset
    (each block valid until the next)."""
    done = 0
    while done < length:
        n = os.preadv(src, [view[: min(len(view), length - done)]], offset + done)
        if n == 0:
            raise OSError(f"source ended after {done} of {length} bytes")
        yield offset + done, view[:n]
        done += n


def buffered_copy(
    src: int, dst: int, offset: int, length: int, buf: bytearray | None = None, sink: Sink | None = None
) -> None:
    """Copy through ``buf`` (or a fresh ``BLOCK``-sized one) to ``dst`` at its position,
    passing the bytes to ``sink`` on the way."""
    view = memoryview(buf if buf is not None else bytearray(min(BLOCK, max(1, length))))
    for at, block in _blocks(src, offset, length, view):
        if sink is not None:
            sink(at, block)
        written = 0
        while written < len(block):
            written += os.write(dst, block[written:])


def read_through(src: int, offset: int, length: int, buf: bytearray, sink: Sink) -> None:
    """Pass a range of ``src`` to ``sink``, read through ``buf`` (no mapping: the process's
    resident memory stays at one buffer whatever the file size)."""
    for at, block in _blocks(src, offset, length, memoryview(buf)):
        sink(at, block)


def copy_range(
    src: int, dst: int, offset: int, length: int, buf: bytearray | None = None, sink: Sink | None = None
) -> None:
    """Append ``length`` bytes of ``src`` at ``offset`` to ``dst`` (at its position), passing
    them to ``sink``: the kernel copies when it can (then the bytes are read once more,
    through ``buf``, for the sink), else one pass through ``buf`` does both."""
    done = kernel_copy(src, dst, offset, length)
    if done and sink is not None:
        read_through(src, offset, done, buf if buf is not None else bytearray(BLOCK), sink)
    if done < length:
        buffered_copy(src, dst, offset + done, length - done, buf, sink)


FULL = (errno.ENOSPC, errno.EDQUOT)
"""``OSError`` numbers of a full device or an exhausted quota."""


@contextlib.contextmanager
def disk_full_named(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn "No space left on device" (or "Disk quota exceeded") raised inside into a
    :class:`~zckpt.errors.DiskFullError` naming the file being written (the OSError's own
    file name when it has one, else ``path``): the bare OSError names none."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as err:
        full = as_disk_full(err, path)
        if full is None:
            raise
        raise full from None


def as_disk_full(err: OSError, path: str | os.PathLike[str]) -> DiskFullError | None:
    """``err`` as a :class:`~zckpt.errors.DiskFullError` naming its file (else ``path``), or
    ``None`` when it is not about a full device."""
    if isinstance(err, DiskFullError):
        return err
    if err.errno not in FULL:
        return None
    where = err.filename if err.filename is not None else path
    return DiskFullError(f"no space left on the device while writing ({os.strerror(err.errno)}); free space "
                         "and rerun", path=os.fspath(where))


def fsync_dir(path: Path) -> None:
    """Make a rename or a new name in ``path`` durable: until its directory is synced, a
    crash can lose the new name even though the file's own bytes were synced."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(f: BinaryIO, tmp_path: Path, path: Path, fsync: bool) -> None:
    """Give a completely written temporary file its final name: flush, fsync (when asked),
    close, rename atomically, then sync the directory, so the final name never shows a
    partial file and, once this returns, survives a crash."""
    f.flush()
    if fsync:
        os.fsync(f.fileno())
    f.close()
    os.replace(tmp_path, path)
    if fsync:
        fsync_dir(path.parent)


def write_atomic(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write a small file whole under a temporary name in its directory (created anew,
    never through a planted link: :func:`zckpt.safe_paths.create_temp`), then
    :func:`publish` it; the temporary file is removed on any failure."""
    f, tmp = safe_paths.create_temp(path)
    try:
        with disk_full_named(path), f:
            f.write(data)
            publish(f, tmp, path, fsync)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def copy_range_at(
    src: int, dst: int, offset: int, length: int, at: int, buf: bytearray | None = None, sink: Sink | None = None
) -> None:
    """Copy ``length`` bytes of ``src`` at ``offset`` to ``dst`` at ``at`` (a byte range of a
    shard file that other writers fill around it): in the kernel when it can, else through
    ``buf``; ``sink`` receives the bytes (read once more through ``buf`` after a kernel copy)."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src, dst, length - done, offset + done, at + done)
        except OSError:
            break
        if n == 0:
            break
        done += n
    if done and sink is not None:
        read_through(src, offset, done, buf if buf is not None else bytearray(BLOCK), sink)
    if done < length:
        view = memoryview(buf if buf is not None else bytearray(min(BLOCK, max(1, length - done))))
        for pos, block in _blocks(src, offset + done, length - done, view):
            if sink is not None:
                sink(pos, block)
            write_at(dst, block, at + (pos - offset))


def write_at(dst: int, data: memoryview | bytes, at: int) -> None:
    """Write all of ``data`` to ``dst`` at byte ``at`` (``pwrite`` until done)."""
    view = memoryview(data).cast("B")
    written = 0
    while written < len(view):
        written += os.pwrite(dst, view[written:], at + written)
