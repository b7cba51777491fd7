"""Copying byte ranges between open files: in the kernel when it can, else through one
reusable buffer (bounded memory, no fresh allocation per block). A copy can pass the
bytes it moves to a :data:`zckpt.io.checksums.Sink` (checksums summed or checked in the same
pass)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Protocol

from zckpt.core.errors import DiskFullError
from zckpt.io.checksums import Sink
from zckpt.io.new_files import NewFile, Opener, Unpublished
from zckpt.io.new_files import fsync_dir as fsync_dir  # callers import it from here

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


FULL = (errno.ENOSPC, errno.EDQUOT)
"""``OSError`` numbers of a full device or an exhausted quota."""


@contextlib.contextmanager
def disk_full_named(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn "No space left on device" (or "Disk quota exceeded") raised inside into a
    :class:`~zckpt.core.errors.DiskFullError` naming the file being written (the OSError's own
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
    """``err`` as a :class:`~zckpt.core.errors.DiskFullError` naming its file (else ``path``), or
    ``None`` when it is not about a full device."""
    if isinstance(err, DiskFullError):
        return err
    if err.errno not in FULL:
        return None
    where = err.filename if err.filename is not None else path
    return DiskFullError(f"no space left on the device while writing ({os.strerror(err.errno)}); free space "
                         "and rerun", path=os.fspath(where))


UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})
"""``fallocate(2)`` errors of a filesystem that does not reserve blocks (the file stays sparse)."""


@functools.cache
def _fallocate() -> Callable[[int, int, int, int], int] | None:
    """The C library's ``fallocate`` (64-bit offsets), or ``None`` where there is none.

    Not ``os.posix_fallocate``: where the filesystem cannot reserve blocks, glibc's
    ``posix_fallocate`` writes a byte into every block instead, a slow second write of the
    whole file (over NFS, of the network)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        func = getattr(libc, "fallocate64", None)
        if func is None and ctypes.sizeof(ctypes.c_long) == 8:
            func = getattr(libc, "fallocate", None)
    except OSError:
        return None
    if func is None:
        return None
    func.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    func.restype = ctypes.c_int

    def call(fd: int, mode: int, offset: int, length: int) -> int:
        return 0 if func(fd, mode, offset, length) == 0 else ctypes.get_errno()

    return call


def allocate(fd: int, size: int, path: str | os.PathLike[str]) -> bool:
    """Reserve the disk blocks of an open file's first ``size`` bytes, growing it to ``size``
    (the new bytes read as zeros, as a sparse file's do): writers then fill blocks the
    filesystem already placed (less work per write), and a full disk shows here, as a
    :class:`~zckpt.core.errors.DiskFullError` naming ``path``, before any data is written.
    ``False`` where the system or the filesystem cannot reserve blocks (nothing changed)."""
    call = _fallocate()
    if call is None or size <= 0:
        return False
    while True:
        err = call(fd, 0, 0, size)
        if err != errno.EINTR:
            break
    if err in UNSUPPORTED:
        return False
    if err:
        oserr = OSError(err, os.strerror(err), os.fspath(path))
        raise as_disk_full(oserr, path) or oserr
    return True


@functools.cache
def _syncfs() -> Callable[[int], int] | None:
    """The C library's ``syncfs``, or ``None`` where there is none."""
    try:
        func = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
    except OSError:
        return None
    if func is None:
        return None
    func.argtypes = (ctypes.c_int,)
    func.restype = ctypes.c_int

    def call(fd: int) -> int:
        return 0 if func(fd) == 0 else ctypes.get_errno()

    return call


def sync_filesystem(fd: int, *, close: bool = False) -> bool:
    """Write out everything the filesystem holding ``fd`` has not yet written (``syncfs``),
    waiting until it is on the disk (``fd`` closed after with ``close``); ``False`` where the
    system has no such call."""
    call = _syncfs()
    try:
        if call is None:
            return False
        err = call(fd)
        if err:
            raise OSError(err, os.strerror(err))
        return True
    finally:
        if close:
            os.close(fd)


BATCH = 32
"""Files published together (:func:`publish_all`) from which one filesystem sync replaces a
sync of each file and of each folder."""


def publish_all(news: Sequence[Unpublished], fsync: bool) -> None:
    """Publish files completed together (a source-major group), each as by its ``publish``.

    With ``fsync``, :data:`BATCH` files or more on one local filesystem: their bytes are made
    durable by one filesystem sync (``syncfs``), then they are named, then one more sync makes
    the names durable, in place of a sync of every file and every folder: 512 files in 512
    folders took 1 024 syncs, each one journal commit. A file is still named only once its
    bytes are on the disk. The syncs also write out what other writers left on that
    filesystem, as ``sync`` does."""
    local = [n for n in news if isinstance(n, NewFile)]
    batch = fsync and len(news) >= BATCH and len(local) == len(news) and _syncfs() is not None and \
        len({os.fstat(n.file.fileno()).st_dev for n in local}) == 1
    done = 0
    try:
        if not batch:
            for n in news:
                n.publish(fsync)
                done += 1
            return
        for n in local:
            n.file.flush()
        with disk_full_named(local[0].path):
            sync_filesystem(local[0].file.fileno())
        for n in local:
            n.publish(False, sync_dir=False)
            done += 1
        with disk_full_named(local[0].path.parent):
            sync_filesystem(os.open(local[0].path.parent, os.O_RDONLY | os.O_DIRECTORY), close=True)
    except BaseException:
        for n in news[done:]:
            n.discard()
        raise


SYNC_THREADS = 8
"""Files a :class:`Publisher` syncs at once."""


class Publisher:
    """Publishes completed new files (:class:`~zckpt.io.new_files.NewFile`) on threads of its
    own, so that waiting for one file's bytes to reach the disk overlaps with writing the
    next: each file is fsynced, named and closed there; leaving the context waits for all of
    them, then syncs each directory that received a name once, and the parents of those
    directories (which may have been created for them). Until it returns, a rename may not
    be durable: callers report success only after it.

    :data:`SYNC_THREADS` files are synced at once: a group of 512 files handed over together
    was synced one after another, one journal commit and one short write-out each; synced
    together, the filesystem writes them out and commits them in batches.

    A file whose sync or rename fails is dropped; the first failure is raised on leaving
    (after every other file was published)."""

    def __init__(self, fsync: bool = True) -> None:
        self.fsync = fsync
        self._pool = ThreadPoolExecutor(SYNC_THREADS if fsync else 1, thread_name_prefix="zckpt-publish")
        self._pending: list[Future[None]] = []
        self._dirs: dict[Path, None] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close(raise_errors=et is None)

    def submit(self, new: Unpublished) -> None:
        """Publish a completely written new file (this object now owns it)."""
        new.file.flush()
        with self._lock:
            self._pending.append(self._pool.submit(self._publish, new))

    def submit_all(self, news: Sequence[Unpublished]) -> None:
        """Publish files completed together (:func:`publish_all`; this object now owns them)."""
        if len(news) < BATCH:
            for n in news:
                self.submit(n)
            return
        with self._lock:
            self._pending.append(self._pool.submit(publish_all, list(news), self.fsync))

    def _publish(self, new: Unpublished) -> None:
        new.publish(self.fsync, sync_dir=False)
        self._dirs.setdefault(new.path.parent)

    def close(self, raise_errors: bool = True) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        errors = [e for e in (fut.exception() for fut in pending) if e is not None]
        self._pool.shutdown()
        if self.fsync:
            dirs = list(self._dirs)
            for d in [*dirs, *dict.fromkeys(d.parent for d in dirs if d.parent not in self._dirs)]:
                fsync_dir(d)
        self._dirs.clear()
        if errors and raise_errors:
            raise errors[0]


def available_memory() -> int | None:
    """Bytes the kernel reports it could give without swapping (``MemAvailable``), or
    ``None`` where that is not known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def write_atomic(path: Path, data: bytes, *, fsync: bool = True, files: Opener | None = None) -> None:
    """Write a small file whole as a :class:`~zckpt.io.new_files.NewFile` (unnamed where the
    system allows, never through a planted link; or as ``files`` opens it), then publish it;
    nothing of it is left on any failure."""
    new = files(path, False) if files is not None else NewFile(path)
    try:
        with disk_full_named(path):
            new.file.write(data)
            new.publish(fsync)
    except BaseException:
        new.discard()
        raise


class SourceEnded(OSError):
    """A copy's source file is shorter than the range asked for (it changed after it was read)."""


def copy_range_at(
    src: int, dst: int, offset: int, length: int, at: int, buf: bytearray | None = None, sink: Sink | None = None
) -> None:
    """Copy ``length`` bytes of ``src`` at ``offset`` to ``dst`` at ``at`` (a byte range of a
    shard file that other writers fill around it) through ``buf``, passing them to ``sink``
    on the way: each byte is read once, summed while in the CPU cache, and written.

    Not ``copy_file_range``: the sums need the bytes in this process, and the kernel's copy
    plus a second read cost more than one read and one write (bench/bench_copy.py: ext4 splices
    the destination a page at a time, ``pwrite`` fills it a buffer at a time)."""
    view = memoryview(buf if buf is not None else bytearray(min(BLOCK, max(1, length))))
    size = len(view)
    done = 0
    while done < length:  # a plain loop (no generator): ingest calls this once per run, 10 000s of times
        n = os.preadv(src, [view[: min(size, length - done)]], offset + done)
        if n == 0:
            raise SourceEnded(f"source ended after {done} of {length} bytes")
        block = view[:n]
        if sink is not None:
            sink(offset + done, block)
        write_at(dst, block, at + done)
        done += n


def write_at(dst: int, data: memoryview | bytes, at: int) -> None:
    """Write all of ``data`` to ``dst`` at byte ``at`` (``pwrite`` until done)."""
    view = memoryview(data).cast("B")
    written = 0
    while written < len(view):
        written += os.pwrite(dst, view[written:], at + written)


class SharedFiles:
    """Write descriptors of files that many writers fill at disjoint offsets (a store's shard
    files), each opened once and shared by the threads of this process instead of opened and
    closed for every write: at 512 source ranks an ingest writes 28 803 runs into 972 files.

    :meth:`acquire` returns the open descriptor of a path (opening it with ``opener`` the first
    time), :meth:`release` gives it back. At most ``limit`` stay open: opening one more closes
    the least recently used descriptor that no writer holds, so a descriptor is never closed
    (and its number reused) under a writer. :meth:`close` closes them all."""

    def __init__(self, opener: Callable[[str], int], limit: int = 256) -> None:
        self._opener = opener
        self._limit = max(1, limit)
        self._open: OrderedDict[str, list[int]] = OrderedDict()  # path -> [descriptor, writers holding it]
        self._lock = threading.Lock()

    def acquire(self, path: str) -> int:
        with self._lock:
            held = self._open.get(path)
            if held is None:
                held = self._open[path] = [self._opener(path), 1]
                self._trim()  # never the new one: it is held
            else:
                self._open.move_to_end(path)
                held[1] += 1
            return held[0]

    def release(self, path: str) -> None:
        with self._lock:
            self._open[path][1] -= 1

    def _trim(self) -> None:
        if len(self._open) <= self._limit:
            return
        for path, (fd, users) in list(self._open.items()):
            if users == 0:
                del self._open[path]
                os.close(fd)
                if len(self._open) <= self._limit:
                    return

    def close(self) -> None:
        with self._lock:
            opened, self._open = self._open, OrderedDict()
        for fd, _ in opened.values():
            os.close(fd)

    def __enter__(self) -> SharedFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Descriptors(Protocol):
    """Open descriptors by path, lent to one user at a time (:class:`SharedFiles`)."""

    def acquire(self, path: str) -> int: ...

    def release(self, path: str) -> None: ...


class OpenFiles:
    """:class:`Descriptors` of files a caller holds open (a group's new files, unnamed)."""

    def __init__(self, fds: Mapping[str, int]) -> None:
        self._fds = fds

    def acquire(self, path: str) -> int:
        return self._fds[path]

    def release(self, path: str) -> None:
        pass


class WriteBehind:
    """Starts the disk writes of byte ranges just written into open files (:class:`SharedFiles`
    of an ingest, a source-major group's new files: :class:`OpenFiles`), on a
    thread of its own, instead of leaving every dirty page to the final ``sync``: the kernel
    writes nothing back before a tenth of the memory is dirty (or 30 s have passed), so a
    2 GiB ingest on a 24 GiB host wrote nothing until it ended, then waited a second for the
    disk. The ranges are handed over (:meth:`add`) once written; every ``batch_bytes`` the
    thread asks the kernel to write them (``posix_fadvise(POSIX_FADV_DONTNEED)``, which starts
    the write-back of a range's dirty pages without waiting and leaves pages being written in
    the page cache), while the writers go on. Only a hint: :meth:`close` asks for the batches
    handed over and drops the last, partial one; nothing here is a durability promise."""

    def __init__(self, files: Descriptors, batch_bytes: int = 32 * 1024 * 1024) -> None:
        self._files = files
        self._batch = batch_bytes
        self._pending: list[tuple[str, int, int]] = []
        self._pending_bytes = 0
        self._queue: queue.SimpleQueue[list[tuple[str, int, int]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if hasattr(os, "posix_fadvise"):  # elsewhere the kernel's own write-back stays in charge
            self._thread = threading.Thread(target=self._run, name="zckpt-write-behind", daemon=True)
            self._thread.start()

    def add(self, ranges: Sequence[tuple[str, int, int]]) -> None:
        """``(path, offset, length)`` of ranges written (into files of the :class:`Descriptors`)."""
        if self._thread is None:
            return
        with self._lock:
            self._pending.extend(ranges)
            self._pending_bytes += sum(n for _, _, n in ranges)
            if self._pending_bytes < self._batch:
                return
            ready, self._pending, self._pending_bytes = self._pending, [], 0
        self._queue.put(ready)

    def _run(self) -> None:
        while True:
            ranges = self._queue.get()
            if ranges is None:
                return
            for path, offset, length in _merged(ranges):
                fd = self._files.acquire(path)
                try:
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass  # only a hint
                finally:
                    self._files.release(path)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _merged(ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The ranges sorted by file and offset, those that touch merged into one."""
    out: list[tuple[str, int, int]] = []
    for path, offset, length in sorted(ranges):
        if out and out[-1][0] == path and out[-1][1] + out[-1][2] >= offset:
            last = out[-1]
            out[-1] = (path, last[1], max(last[2], offset + length - last[1]))
        else:
            out.append((path, offset, length))
    return out
