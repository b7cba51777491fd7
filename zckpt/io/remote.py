"""Paths and URLs: local directories keep their direct file paths, anything else goes through fsspec.

zckpt's fast paths (raw chunk files, ``copy_file_range``, memory-mapped readers, the
``fcntl`` ingest lock) need a POSIX file. A URL with a scheme (``s3://``, ``gs://``,
``memory://``, ...) names a location in an fsspec filesystem instead: the store is then
opened with zarr's own ``FsspecStore``, source shards are read by byte range
(:mod:`zckpt.io.ranged`), and output files are uploaded as they are written, visible under
their names only once complete (:mod:`zckpt.io.streamed_files`).
``file://`` URLs and plain paths are local.

Every failure of a remote call (no bucket, no credentials, endpoint unreachable) becomes
a zckpt error naming the URL, so the command line reports it in one line.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zckpt.core.errors import UsageError, ZckptError

StorageOptions = Mapping[str, Any] | None
"""Keyword arguments of the fsspec filesystem (``endpoint_url``, ``key``, ``anon``, ...)."""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
ATOMIC_PUT = frozenset({"s3", "s3a", "gs", "gcs", "memory"})
"""Filesystems where an uploaded object becomes visible only once complete."""


def is_remote(path: str | os.PathLike[str]) -> bool:
    """True for a URL with a scheme other than ``file``; plain paths are local."""
    m = _SCHEME.match(os.fspath(path)) if isinstance(path, str) else None
    return m is not None and m.group(1).lower() != "file"


def local_path(path: str | os.PathLike[str]) -> Path:
    """The local path of a plain path or a ``file://`` URL."""
    text = os.fspath(path)
    return Path(text[len("file://"):]) if text.lower().startswith("file://") else Path(text)


def _fail(err_cls: type[ZckptError], url: str, what: str, err: BaseException) -> ZckptError:
    if isinstance(err, ZckptError):
        return err
    detail = str(err) or type(err).__name__
    return err_cls(f"{what}: {type(err).__name__}: {detail}", path=url)


@contextlib.contextmanager
def remote_errors(err_cls: type[ZckptError], url: str, what: str) -> Iterator[None]:
    """Turn whatever an fsspec backend raises (OSError, botocore errors, aiohttp errors, ...)
    into ``err_cls`` naming ``url``; zckpt errors pass through unchanged."""
    try:
        yield
    except ZckptError:
        raise
    except Exception as err:  # backends raise many unrelated types (botocore, aiohttp, ...)
        raise _fail(err_cls, url, what, err) from err


@dataclass(frozen=True)
class Location:
    """A directory or file on an fsspec filesystem: ``url`` as given, ``path`` inside ``fs``."""

    url: str
    fs: Any
    path: str

    @property
    def protocol(self) -> str:
        proto = self.fs.protocol
        return str(proto[0] if isinstance(proto, (tuple, list)) else proto)

    def child(self, *parts: str) -> Location:
        path = "/".join([self.path.rstrip("/"), *parts])
        return Location(self.url.rstrip("/") + "/" + "/".join(parts), self.fs, path)

    def sibling(self, name: str) -> Location:
        """``<parent>/<name>`` (the store's ``.lock`` object sits beside the store)."""
        parent_url, parent_path = self.url.rstrip("/").rsplit("/", 1)[0], self.path.rstrip("/").rsplit("/", 1)[0]
        return Location(parent_url + "/" + name, self.fs, parent_path + "/" + name)

    def url_of(self, path: str | os.PathLike[str]) -> str:
        """The URL of a path inside this filesystem (for tasks that reopen it)."""
        return str(self.fs.unstrip_protocol(os.fspath(path)))


def fs_options(storage_options: StorageOptions) -> dict[str, Any]:
    """The user's options, with fsspec's directory-listing cache off unless asked for:
    progress nodes and output files are written by other processes (Dask workers), and a
    cached listing would hide them from the client."""
    return {"use_listings_cache": False, **dict(storage_options or {})}


def locate(url: str, storage_options: StorageOptions = None, err_cls: type[ZckptError] = ZckptError) -> Location:
    """The fsspec filesystem and path of a URL (``fsspec.core.url_to_fs``)."""
    import fsspec.core

    with remote_errors(err_cls, url, "cannot reach"):
        fs, path = fsspec.core.url_to_fs(url, **fs_options(storage_options))
    return Location(url, fs, str(path))


def exists(loc: Location, err_cls: type[ZckptError]) -> bool:
    with remote_errors(err_cls, loc.url, "cannot reach"):
        return bool(loc.fs.exists(loc.path))


def isdir(loc: Location, err_cls: type[ZckptError]) -> bool:
    with remote_errors(err_cls, loc.url, "cannot reach"):
        return bool(loc.fs.isdir(loc.path))


def isfile(loc: Location, err_cls: type[ZckptError]) -> bool:
    with remote_errors(err_cls, loc.url, "cannot reach"):
        return bool(loc.fs.isfile(loc.path))


def listdir(loc: Location, err_cls: type[ZckptError]) -> list[tuple[str, bool]]:
    """``(name, is_directory)`` of each child; empty when the directory does not exist."""
    with remote_errors(err_cls, loc.url, "cannot list"):
        if not loc.fs.exists(loc.path):
            return []
        found = loc.fs.ls(loc.path, detail=True, refresh=True)
    base = loc.path.rstrip("/")
    out = []
    for info in found:
        name = str(info["name"]).rstrip("/")
        if name == base:
            continue
        out.append((name.rsplit("/", 1)[-1], info.get("type") == "directory"))
    return sorted(out)


def find(loc: Location, err_cls: type[ZckptError]) -> list[str]:
    """Every file below ``loc`` (filesystem paths)."""
    with remote_errors(err_cls, loc.url, "cannot list"):
        return sorted(str(p) for p in loc.fs.find(loc.path))


def file_identities(loc: Location, err_cls: type[ZckptError]) -> dict[str, tuple[int, str]]:
    """``{filesystem path: (size, ETag)}`` of every file below ``loc`` (one listing; the ETag
    is ``""`` where the server gives none)."""
    with remote_errors(err_cls, loc.url, "cannot list"):
        if not loc.fs.exists(loc.path):
            return {}
        found = loc.fs.find(loc.path, detail=True)
    return {str(p): (int(info.get("size") or 0), str(info.get("ETag") or info.get("etag") or ""))
            for p, info in sorted(found.items())}


def read_bytes(loc: Location, err_cls: type[ZckptError]) -> bytes:
    with remote_errors(err_cls, loc.url, "cannot read"):
        return bytes(loc.fs.cat_file(loc.path))


def write_bytes(loc: Location, data: bytes, err_cls: type[ZckptError]) -> None:
    with remote_errors(err_cls, loc.url, "cannot write"):
        loc.fs.pipe_file(loc.path, data)


def create_exclusive(loc: Location, data: bytes, err_cls: type[ZckptError]) -> bool:
    """Create ``loc`` only if absent; ``False`` when it exists. Atomic on S3 (``If-None-Match``
    conditional put) and in ``memory://``; other filesystems check then write."""
    with remote_errors(err_cls, loc.url, "cannot create"):
        try:
            loc.fs.pipe_file(loc.path, data, mode="create")
        except FileExistsError:
            return False
    return True


def remove(loc: Location, err_cls: type[ZckptError], *, recursive: bool = False) -> None:
    with remote_errors(err_cls, loc.url, "cannot remove"):
        if loc.fs.exists(loc.path):
            loc.fs.rm(loc.path, recursive=recursive)


def size(loc: Location, err_cls: type[ZckptError]) -> int:
    with remote_errors(err_cls, loc.url, "cannot read"):
        return int(loc.fs.size(loc.path))


def identity(loc: Location, err_cls: type[ZckptError]) -> tuple[int, str]:
    """Size and version of an object (its ETag, else its modification time): what a resumed
    job compares to see that a remote source is the one it started from."""
    with remote_errors(err_cls, loc.url, "cannot read"):
        info = loc.fs.info(loc.path)
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
    return int(info.get("size") or 0), str(version)


def upload(source: Path, loc: Location, err_cls: type[ZckptError]) -> None:
    """Put a complete local file at ``loc`` so that no reader ever sees it half written: an
    object store publishes an object when its upload completes; elsewhere the file goes to
    ``<name>.tmp-zckpt`` first and is moved into place."""
    with remote_errors(err_cls, loc.url, "cannot upload"):
        if loc.protocol in ATOMIC_PUT:
            loc.fs.put_file(str(source), loc.path)
            return
        tmp = loc.path + ".tmp-zckpt"
        loc.fs.put_file(str(source), tmp)
        loc.fs.mv(tmp, loc.path)


@contextlib.contextmanager
def named_by_url(tmp: str | os.PathLike[str], url: str, *, children: bool = False) -> Iterator[None]:
    """Errors about a temporary local copy (any path under ``tmp``) name the URL it came from
    instead; with ``children`` the copy is a directory and a file in it is named as the
    URL's file of that name."""
    root = os.fspath(tmp)
    try:
        yield
    except ZckptError as err:
        if err.path is None or not err.path.startswith(root):
            raise
        where = url.rstrip("/") + "/" + Path(err.path).name if children and err.path != root else url
        raise type(err)(err.message, path=where, param=err.param) from None


def require_local(command: str, **paths: str | os.PathLike[str] | None) -> None:
    """Refuse URLs where a command reads local files only (a clear error rather than a
    report about paths that do not exist)."""
    for what, p in paths.items():
        if p is not None and is_remote(p):
            raise UsageError(f"{command} reads {what} from local paths only; {str(p)!r} is a URL "
                             "(copy it locally first, e.g. with fsspec or the aws CLI)")
