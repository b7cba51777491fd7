"""New files that get their final name only when complete, and leave nothing when killed.

Every file zckpt writes into a user's directory or a store (rank files, safetensors
parts and indexes, a store's records) is written as a :class:`NewFile` and published
under its final name by an atomic rename, so the final name never shows a partial file.
Where the system allows, the file has no name at all while it is written: it is created
with ``O_TMPFILE`` in its destination folder, and publishing links it to its final name in
one call (or, when a file of that name is to be replaced, to a temporary name renamed over
it: the link and the rename take microseconds). A
process killed while writing (``SIGKILL``, power loss) then leaves nothing behind: the
kernel frees an unnamed file when its last descriptor closes. Elsewhere (no ``O_TMPFILE``
on the filesystem, or no way to link an unnamed file) the file is created under
:func:`zckpt.io.safe_paths.temp_name` (``.<name>.<pid>.<random>.tmp-zckpt``), which a rerun
removes.

Linking an unnamed file takes one of two calls, tried once per filesystem and process
(:func:`_link_method`): ``linkat(AT_EMPTY_PATH)`` on the descriptor (allowed to the
process that opened the file since Linux 6.10, earlier only with ``CAP_DAC_READ_SEARCH``),
or ``linkat`` of ``/proc/self/fd/<fd>`` (fails with ``EXDEV`` where ``/proc`` is seen
through another mount).

A file need not be written on this machine at all: the writers are handed an
:data:`Opener` that makes each new file they write, :func:`local` (a :class:`NewFile`) by
default, or a remote output's upload, streamed as it is written
(:mod:`zckpt.io.streamed_files`); they write either alike, through the :class:`Unpublished`
each gets.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

from zckpt.io import safe_paths

_NEW = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_NO_TMPFILE = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOSYS, errno.ENOTSUP})

Link = Callable[[int, Path], None]
_methods: dict[int, Link | None] = {}
_methods_lock = threading.Lock()

UNNAMED = True
"""Write new files unnamed where the system allows (tests turn it off to exercise the named fallback)."""


class Unpublished(Protocol):
    """A file being written for :attr:`path`, named only by :meth:`publish` (a :class:`NewFile`,
    or a remote upload: :mod:`zckpt.io.streamed_files`)."""

    path: Path
    file: BinaryIO

    def publish(self, fsync: bool, *, sync_dir: bool = True) -> None:
        """Give the completely written file its final name (dropped on any failure)."""
        ...

    def discard(self) -> None:
        """Drop the file: nothing of it stays under any name."""
        ...


Opener = Callable[[Path, bool], Unpublished]
"""Opens a new file for a path (:func:`local`, or a remote output's:
:class:`zckpt.io.streamed_files.Uploads`); the flag says its head is rewritten once the rest
is written (so it cannot be streamed front to back)."""


def local(path: Path, head_last: bool = False) -> Unpublished:
    """The :data:`Opener` of files on this machine: a :class:`NewFile` for ``path``, its folder
    made first (``head_last`` does not matter: a local file is rewritten in place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return NewFile(path)


class NewFile:
    """A file being written for ``path``, in ``path``'s folder: :attr:`file` is open for
    writing (and its descriptor for reading too). :meth:`publish` gives it the final name,
    :meth:`discard` drops it; the folders on the way must have been checked by the caller
    (:func:`zckpt.io.safe_paths.real_dirs`), the file itself is never opened through a link."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.temp: Path | None = None
        """The file's temporary name while it has one (always, in the named fallback)."""
        unnamed = _open_unnamed(path.parent) if UNNAMED else None
        if unnamed is None:
            self.temp = safe_paths.temp_name(path)
            fd = os.open(self.temp, _NEW, 0o644)
            self._link: Link | None = None
        else:
            fd, self._link = unnamed
        self.unnamed = unnamed is not None
        """Whether the file is written without a name (else under :attr:`temp`)."""
        self.file: BinaryIO = os.fdopen(fd, "wb")

    def sync(self, fsync: bool) -> None:
        """Flush the file's bytes to the kernel (and to the disk with ``fsync``)."""
        self.file.flush()
        if fsync:
            os.fsync(self.file.fileno())

    def publish(self, fsync: bool, *, sync_dir: bool = True) -> None:
        """Give the completely written file its final name: flush, fsync (when asked), then
        link it to ``path`` when that name is free (an unnamed file), else rename it
        atomically over ``path``; close; then sync the folder (unless ``sync_dir``
        is off: the caller syncs it later), so that once this returns the final name
        survives a crash. The file is dropped on any failure."""
        try:
            self.sync(fsync)
            if self.temp is None and self._link_final():
                self.file.close()
            else:
                self._rename_over()
        except BaseException:
            self.discard()
            raise
        if fsync and sync_dir:
            fsync_dir(self.path.parent)

    def _link_final(self) -> bool:
        """Link the unnamed file straight to its final name when that name is free: one
        atomic call, so no kill can leave a temporary name behind. ``False`` when the name
        exists (the file then replaces it by :meth:`_rename_over`)."""
        assert self._link is not None
        try:
            self._link(self.file.fileno(), self.path)
        except FileExistsError:
            return False
        return True

    def _rename_over(self) -> None:
        """Name the file under a temporary name (unless it has one) and rename that over ``path``."""
        if self.temp is None:
            assert self._link is not None
            temp = safe_paths.temp_name(self.path)
            self._link(self.file.fileno(), temp)
            self.temp = temp
        self.file.close()
        os.replace(self.temp, self.path)
        self.temp = None

    def discard(self) -> None:
        """Close and forget the file (its temporary name removed, if it has one)."""
        with contextlib.suppress(OSError):
            self.file.close()
        if self.temp is not None:
            with contextlib.suppress(FileNotFoundError):
                self.temp.unlink()
            self.temp = None


def fsync_dir(path: Path) -> None:
    """Make a rename or a new name in ``path`` durable: until its directory is synced, a
    crash can lose the new name even though the file's own bytes were synced."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_unnamed(folder: Path) -> tuple[int, Link] | None:
    """An unnamed file in ``folder`` and how to link it, or ``None`` where either cannot be."""
    if not hasattr(os, "O_TMPFILE"):
        return None
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno in _NO_TMPFILE:
            return None
        raise
    try:
        link = _link_method(os.fstat(fd).st_dev, folder)
    except BaseException:
        os.close(fd)
        raise
    if link is None:
        os.close(fd)
        return None
    return fd, link


def _link_method(dev: int, folder: Path) -> Link | None:
    """How unnamed files of the filesystem ``dev`` get a name in this process: the first
    method that links an empty unnamed file of ``folder`` to a probe name (an unnamed
    file can be linked once only, so the probe is a file of its own)."""
    with _methods_lock:
        if dev in _methods:
            return _methods[dev]
        found: Link | None = None
        for method in (_link_empty_path, _link_proc):
            fd = os.open(folder, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o644)
            probe = safe_paths.temp_name(folder / "probe")
            try:
                method(fd, probe)
            except OSError:
                continue
            finally:
                os.close(fd)
            probe.unlink()
            found = method
            break
        _methods[dev] = found
        return found


@functools.cache
def _linkat() -> Callable[..., int] | None:
    try:
        func = ctypes.CDLL(None, use_errno=True).linkat
    except (OSError, AttributeError):
        return None
    func.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
    func.restype = ctypes.c_int
    return func


def _link_empty_path(fd: int, target: Path) -> None:
    func = _linkat()
    if func is None:
        raise OSError(errno.ENOSYS, "no linkat in the C library")
    if func(fd, b"", _AT_FDCWD, os.fsencode(target), _AT_EMPTY_PATH) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(target))


def _link_proc(fd: int, target: Path) -> None:
    os.link(f"/proc/self/fd/{fd}", target, follow_symlinks=True)
