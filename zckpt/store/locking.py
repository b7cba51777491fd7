"""How an ingest takes hold of its store: the writer's lock, then the store opened as new,
resumed or already complete, with what an interrupted writer left half-written removed.

One writer at a time: a local store is locked through :mod:`zckpt.io.locks`, a store on
object storage through a lock object beside it. What is written into the store, and from
which sources, is not this module's business (:mod:`zckpt.store.chunk_writer`, ``zckpt.jobs``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from zckpt.core.errors import StoreError
from zckpt.io import locks, remote

if TYPE_CHECKING:
    from zckpt.store.store import Store


def store_lock(path: Path) -> contextlib.AbstractContextManager[None]:
    """Hold ``<store>.lock`` exclusively (:mod:`zckpt.io.locks`): a second ingest, or an ingest
    while an export, verify or load reads the store, is refused rather than interleaved."""
    return locks.store_writing(path)


LOCK_SUFFIX = ".lock"


def remote_store_lock_of(url: str, storage_options: remote.StorageOptions) -> remote.Location:
    """Where an ingest's lock object on object storage lives: ``<store>.lock`` beside it."""
    return remote.locate(url, storage_options, StoreError).sibling(url.rstrip("/").rsplit("/", 1)[-1] + LOCK_SUFFIX)


def remote_lock_held(loc: remote.Location) -> StoreError:
    """The refusal of an ingest whose store's lock object exists, naming its holder."""
    try:
        who = remote.read_bytes(loc, StoreError).decode("utf-8", "replace")
    except StoreError:
        who = "?"
    return StoreError(f"another zckpt ingest is writing this store (lock object held by {who}); if no ingest "
                      "is running (one was killed), delete the lock object and rerun to resume", path=loc.url)


@contextmanager
def remote_store_lock(url: str, storage_options: remote.StorageOptions) -> Iterator[None]:
    """Hold ``<store>.lock`` on object storage: an object created only if absent (S3's
    conditional ``If-None-Match: *`` put, which AWS S3 and compatible servers honour; other
    fsspec filesystems check then write, which is not atomic). A lock left by a killed
    ingest is not taken over: the error says which object to delete once no ingest runs."""
    loc = remote_store_lock_of(url, storage_options)
    holder = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}).encode()
    if not remote.create_exclusive(loc, holder, StoreError):
        raise remote_lock_held(loc)
    try:
        yield
    finally:
        with contextlib.suppress(StoreError):
            remote.remove(loc, StoreError)


def open_for_ingest(
    path: str | Path, fingerprint: str, overwrite: bool, storage_options: remote.StorageOptions = None
) -> tuple[Store, str]:
    """The store to ingest into and what to do: ``"new"``, ``"resume"`` or ``"complete"``."""
    # the store's modules: loaded while the sources are read (jobs.ingest); not by transform --dry-run
    from zckpt.store.store import Store

    if isinstance(path, str):
        return _open_remote_for_ingest(path, fingerprint, overwrite, storage_options)
    if path.exists() and not overwrite:
        try:
            existing = Store.open(path, mode="r+")
        except StoreError:
            if path.is_dir() and not any(path.iterdir()):
                return Store.create(path, overwrite=True), "new"
            raise StoreError("exists and is not a zckpt store (--overwrite replaces it)", path=path) from None
        found = existing.manifest.get("fingerprint")
        if found == fingerprint:
            if existing.complete:
                return existing, "complete"
            remove_partial_files(path)
            return existing, "resume"
        if found is None and not existing.complete:
            return Store.create(path, overwrite=True), "new"  # interrupted before it held anything
        raise StoreError("store already exists and holds a different ingest (--overwrite replaces it)",
                         path=path)
    return Store.create(path, overwrite=overwrite), "new"


def _open_remote_for_ingest(
    url: str, fingerprint: str, overwrite: bool, storage_options: remote.StorageOptions
) -> tuple[Store, str]:
    """:func:`open_for_ingest` for a store at a URL (zarr's fsspec store leaves no partial
    files: every object is written whole)."""
    # the store's modules: loaded while the sources are read (jobs.ingest); not by transform --dry-run
    from zckpt.store.store import Store

    loc = remote.locate(url, storage_options, StoreError)
    present = remote.listdir(loc, StoreError)
    if present and not overwrite:
        try:
            existing = Store.open(url, mode="r+", storage_options=storage_options)
        except StoreError:
            raise StoreError("exists and is not a zckpt store (--overwrite replaces it)", path=url) from None
        found = existing.manifest.get("fingerprint")
        if found == fingerprint:
            return existing, "complete" if existing.complete else "resume"
        if found is None and not existing.complete:
            return Store.create(url, overwrite=True, storage_options=storage_options), "new"
        raise StoreError("store already exists and holds a different ingest (--overwrite replaces it)",
                         path=url)
    return Store.create(url, overwrite=overwrite, storage_options=storage_options), "new"

def drop_temporaries(target: str | Path) -> None:
    """The temporary files of writes that did not finish (after a full disk, or of a task
    killed on a Dask worker and run again elsewhere), removed by the run holding the store."""
    if isinstance(target, Path):
        remove_partial_files(target)


def remove_partial_files(root: Path) -> None:
    """Temporary files an interrupted writer left (zarr's ``*.partial``, zckpt's own
    ``*.tmp-zckpt`` of the manifest and the progress records)."""
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith((".partial", ".tmp-zckpt")):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))

