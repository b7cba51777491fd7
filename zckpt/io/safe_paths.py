"""Reading and writing only inside the directory zckpt was given: a store or an output
directory.

A store is data that people copy, share and download, and an output directory may hold
anything: a symbolic link planted in either (a chunk file, an array folder, a temporary
file name, a ``rank_<r>`` folder) must never carry a read or a write outside it, and a key
read from a store's metadata must never name a path outside it. So the last component of a
path is opened with ``O_NOFOLLOW`` (new files also with ``O_EXCL``, under a name nobody can
guess), the folders between the given root and a file are checked once each by ``lstat``
(:class:`Confined` remembers the folders it checked, so the cost is per folder, never per
chunk), and keys are checked to be plain relative paths. The root itself is what the user
named: it may be a link.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

from zckpt.core.errors import ZckptError

ErrorClass = type[ZckptError]

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a planted FIFO must not hang


def link_refused(path: str | os.PathLike[str], err: ErrorClass, param: str | None = None) -> ZckptError:
    """The error for a symbolic link met where zckpt reads or writes."""
    try:
        target = f" (to {os.readlink(path)!r})"
    except OSError:
        target = ""
    return err(f"is a symbolic link{target}: zckpt does not follow links inside a store or an output "
               "directory (replace it with the file or folder itself)", path=path, param=param)


def check_key(key: str, err: ErrorClass, *, path: str | os.PathLike[str] | None = None,
              param: str | None = None, what: str = "key") -> str:
    """``key`` if it is a relative ``/``-separated path that stays below its root: no
    empty, ``.`` or ``..`` component, not absolute, no backslash or NUL."""
    parts = key.split("/")
    if not key or key.startswith("/") or "\\" in key or "\0" in key or any(p in ("", ".", "..") for p in parts):
        raise err(f"{what} {key!r} is not a plain relative name (it could lead outside its directory)", path=path,
                  param=param)
    return key


def open_read(path: str | os.PathLike[str], err: ErrorClass, param: str | None = None) -> int:
    """A file descriptor for reading ``path``, a regular file that is not a symbolic link.
    ``FileNotFoundError`` passes through (callers say what is missing)."""
    try:
        fd = os.open(path, _READ)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_refused(path, err, param) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise err("is not a regular file", path=path, param=param)
    return fd


def open_binary(path: str | os.PathLike[str], err: ErrorClass, param: str | None = None) -> BinaryIO:
    """:func:`open_read` as an unbuffered binary file object."""
    return os.fdopen(open_read(path, err, param), "rb", buffering=0)


def read_bytes(path: str | os.PathLike[str], err: ErrorClass, param: str | None = None) -> bytes:
    with open_binary(path, err, param) as f:
        return f.read()


def regular_size(path: str | os.PathLike[str], err: ErrorClass, param: str | None = None) -> int | None:
    """Size of the regular file ``path`` (``None`` when absent), refusing a symbolic link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise link_refused(path, err, param)
    if not stat.S_ISREG(st.st_mode):
        raise err("is not a regular file", path=path, param=param)
    return st.st_size


def refuse_link(path: str | os.PathLike[str], err: ErrorClass, param: str | None = None) -> None:
    """Raise when ``path`` is a symbolic link, or a FIFO, socket or device (reading a FIFO
    waits for a writer forever); a regular file, a folder or nothing passes."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if stat.S_ISLNK(mode):
        raise link_refused(path, err, param)
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise err("is not a regular file", path=path, param=param)


def refuse_links_below(folder: Path, err: ErrorClass, param: str | None = None) -> None:
    """Raise naming the first symbolic link found in ``folder`` or its subfolders (read
    from the listings' entry types: no ``stat`` per file)."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.is_symlink():
            raise link_refused(entry.path, err, param)
        if entry.is_dir(follow_symlinks=False):
            refuse_links_below(Path(entry.path), err, param)


def open_write(path: str | os.PathLike[str], flags: int, err: ErrorClass, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` for writing, refusing a symbolic link as the last component
    (and not waiting for a reader of a planted FIFO: ``O_NONBLOCK`` makes that an error)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_refused(path, err) from None
        raise


def temp_name(path: Path) -> Path:
    """A temporary name beside ``path`` that nobody can plant in advance (random part);
    ends in ``.tmp-zckpt`` so that interrupted runs can find and remove it. New files
    (:mod:`zckpt.io.new_files`) carry one only for the moment of their rename where the system
    lets them be written unnamed."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp-zckpt")


def real_dirs(root: Path, rel: str, err: ErrorClass, *, create: bool = False) -> Path:
    """``root / rel`` after checking that no folder on the way (below ``root``) is a symbolic
    link; with ``create``, missing folders are made one at a time (``mkdir`` never follows)."""
    at = root
    for part in check_key(rel, err, path=root / rel, what="folder").split("/"):
        at = at / part
        try:
            st = os.lstat(at)
        except FileNotFoundError:
            if not create:
                return root / rel
            with contextlib.suppress(FileExistsError):
                os.mkdir(at)
            st = os.lstat(at)
        if stat.S_ISLNK(st.st_mode):
            raise link_refused(at, err)
        if not stat.S_ISDIR(st.st_mode):
            raise err("is not a directory", path=at)
    return at


class Confined:
    """A root directory and the folders below it already checked (as :func:`real_dirs`
    does), so that each folder costs one ``lstat`` per process however many files it holds."""

    def __init__(self, root: Path, err: ErrorClass) -> None:
        self.root = root
        self.err = err
        self._seen: set[str] = set()

    def folder(self, rel: str) -> Path:
        """``root / rel`` (a folder), checked: a plain relative key, no link on the way. A
        folder checked once is not checked again (one ``lstat`` per folder); one not made
        yet is checked again once it exists."""
        if rel in self._seen:
            return self.root / rel
        head, _, name = check_key(rel, self.err, path=self.root / rel, what="folder").rpartition("/")
        path = (self.folder(head) if head else self.root) / name
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return path
        if stat.S_ISLNK(st.st_mode):
            raise link_refused(path, self.err)
        if not stat.S_ISDIR(st.st_mode):
            raise self.err("is not a directory", path=path)
        self._seen.add(rel)
        return path

    def file(self, key: str) -> Path:
        """``root / key`` (a file), its folders checked (not the file itself: open it with
        :func:`open_read`, or check it with :func:`regular_size`)."""
        head, _, name = check_key(key, self.err, path=self.root / key).rpartition("/")
        return (self.folder(head) if head else self.root) / name
