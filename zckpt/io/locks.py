"""Advisory locks (``flock``) that make writers of a store or an output directory exclusive.

* ``<store>.lock`` beside a local store: ``zckpt ingest`` holds it exclusively, readers
  (``export``, ``verify``, ``load``) hold it shared for as long as they read, so a reader
  never sees a store half rewritten by ``ingest --overwrite``, and an ingest never rewrites
  a store under a reader's feet: whichever comes second is refused by name.
* the output directory itself: ``export`` and ``transform`` hold a ``flock`` on the
  directory (its own descriptor: no file is created in it) exclusively while they write
  there, so that two writers of one directory never remove each other's files. Where a
  directory cannot be locked (``flock`` refused on a directory descriptor, as on some
  network filesystems), ``<out>/.zckpt-out.lock`` is locked instead and removed when done.

Lock files are opened without following a symbolic link (``O_NOFOLLOW``): a planted link
cannot make zckpt create or truncate a file elsewhere. The exclusive holder removes its lock
file when done; every locker checks, once it holds the lock, that the name still leads to the
file it locked (else it locked a removed file and tries again), so removal is safe.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from zckpt.core.errors import OutputError, StoreError, ZckptError

STORE_SUFFIX = ".lock"
OUTPUT_LOCK = ".zckpt-out.lock"
"""The output directory's lock file, only where the directory itself cannot be locked."""


def store_lock_path(store: Path) -> Path:
    return store.with_name(store.name + STORE_SUFFIX)


def _open(path: Path, create: bool) -> int | None:
    """The lock file, opened without following a link; ``None`` when it cannot be (a
    read-only place where it does not exist: nobody can write there to hold it either)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags | (os.O_CREAT if create else 0), 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "the lock file is a symbolic link", str(path)) from None
        if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            try:
                return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
        raise


@contextmanager
def hold(path: Path, *, shared: bool, busy: ZckptError, remove: bool = False) -> Iterator[None]:
    """Hold ``path`` locked (shared or exclusive) without waiting; raise ``busy`` when another
    process holds it the other way. ``remove``: delete the lock file on release when nobody
    else holds it (a shared holder first converts its lock to exclusive, without waiting), so
    that readers and writers leave nothing behind."""
    while True:
        try:
            fd = _open(path, create=True)
        except OSError as err:
            raise type(busy)(f"cannot open the lock file: {err.strerror}", path=path) from None
        if fd is None:
            yield
            return
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise busy from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder before us removed it while we waited: lock the new one
    try:
        yield
    finally:
        if remove and _alone(fd, shared):
            with contextlib.suppress(OSError):
                os.unlink(path)
        os.close(fd)


def _alone(fd: int, shared: bool) -> bool:
    """Whether this holder is the only one (an exclusive lock, or a shared one that converts)."""
    if not shared:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def store_writing(store: Path) -> contextlib.AbstractContextManager[None]:
    """Exclusive hold of a local store (``zckpt ingest``)."""
    lock = store_lock_path(store)
    lock.parent.mkdir(parents=True, exist_ok=True)
    return hold(lock, shared=False, busy=store_busy(store, shared=False), remove=True)


def store_reading(store: Path) -> contextlib.AbstractContextManager[None]:
    """Shared hold of a local store while it is read: refused while an ingest writes it."""
    lock = store_lock_path(store)
    if not lock.parent.is_dir():
        return contextlib.nullcontext()
    return hold(lock, shared=True, busy=store_busy(store, shared=True), remove=True)


def store_busy(store: Path, *, shared: bool) -> StoreError:
    """Why a local store's lock cannot be had: by a reader (``shared``) or by a writer."""
    if shared:
        return StoreError("a zckpt ingest is writing this store (lock held): retry when it has finished", path=store)
    return StoreError("another zckpt ingest is writing this store, or an export, verify or load is reading it "
                      "(lock held): retry when it has finished", path=store_lock_path(store))


def probe_store(store: Path, *, shared: bool) -> None:
    """:func:`store_reading`'s (``shared``) or :func:`store_writing`'s refusal, found without
    creating or locking anything."""
    probe(store_lock_path(store), shared=shared, busy=store_busy(store, shared=shared))


@contextmanager
def output_writing(out: Path) -> Iterator[None]:
    """Exclusive hold of an output directory (``export``, ``transform``); creates it. The
    lock is on the directory itself (the directory the name leads to: a user may name a
    link to it), so nothing of it stays in the directory, even after a ``SIGKILL``."""
    out.mkdir(parents=True, exist_ok=True)
    busy = output_busy(out)
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise OutputError(f"cannot open the output directory: {err.strerror}", path=out) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        except OSError as err:
            if err.errno not in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            with hold(out / OUTPUT_LOCK, shared=False, busy=busy, remove=True):
                yield
            return
        yield
    finally:
        os.close(fd)


def output_busy(out: Path) -> OutputError:
    return OutputError("another zckpt export or transform is writing into this directory (lock held): retry when "
                       "it has finished, or choose another directory", path=out)


def probe(path: Path, *, shared: bool, busy: ZckptError) -> None:
    """Raise ``busy`` where a holder of ``path`` (a lock file or a directory) locked the other
    way would stop a run, without creating anything or keeping the lock (``--dry-run``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # nothing there: nobody holds it (a planted link is the run's to refuse)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        raise busy from None
    except OSError:
        return  # a filesystem without flock: the run falls back to a lock file, probed below
    finally:
        os.close(fd)


def probe_output(out: Path) -> None:
    """:func:`output_writing`'s refusal, found without creating or locking anything."""
    if out.is_dir():
        probe(out.resolve(), shared=False, busy=output_busy(out))
        probe(out / OUTPUT_LOCK, shared=False, busy=output_busy(out))
