"""A store's arrays through zarr-python: remote stores, compressed arrays, and zarr arrays handed to callers.

zckpt reads and writes a local uncompressed store as raw files (:mod:`zckpt.store.chunk_files`);
everything else goes through zarr-python, which is imported here only when first used, from
:mod:`zckpt.io.zarr_local` (its import costs every command a few tenths of a second, and that
module registers Zarr's ``bfloat16`` data type first). Here belong the arrays zckpt opens or
creates through zarr (:class:`OpenArrays`), the ``uint16`` view zckpt carries BFloat16 as
(:func:`bits_view`), concurrent requests on zarr's event loop (:func:`gather`), and the
checksum check of a remote store's chunks (:func:`verify_remote_chunks`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import StoreError
from zckpt.core.layout import Box
from zckpt.io import remote
from zckpt.io.checksums import ChunkSums
from zckpt.plan.values import TensorSpec
from zckpt.store import integrity
from zckpt.store.chunk_records import Checked, all_checked, refuse_mismatch
from zckpt.store.manifest import EntryRecord

if TYPE_CHECKING:  # zarr-python is imported where it is used, from zckpt.io.zarr_local
    import zarr
    from zarr.storage import FsspecStore

    from zckpt.zarr_bfloat16 import BFloat16

    ZarrType = np.dtype[Any] | BFloat16
    """What an array is created with: a numpy dtype, or Zarr's ``bfloat16`` extension type."""


def zarr_type(ms_type: str, kind: str) -> ZarrType:
    """The Zarr data type of an entry's array: the numpy dtype holding MindSpore's bytes
    (``uint8`` for a map's encoded bytes), except BFloat16, which is Zarr's ``bfloat16`` so
    that other readers (TensorStore, zarr-python with the type registered) see bf16 numbers."""
    from zckpt import zarr_bfloat16

    if kind != "tensor":
        return np.dtype("u1")
    if ms_type == "BFloat16":
        return zarr_bfloat16.BFloat16()
    return ms_dtype(ms_type).storage


def bits_view(arr: zarr.Array[Any]) -> zarr.Array[Any]:
    """A ``bfloat16`` array read and written as ``uint16`` bit patterns (the same chunks, the
    same bytes: only the in-memory metadata says ``uint16``), which is how zckpt carries bf16
    everywhere; other arrays are returned unchanged. The view never writes its metadata (zckpt
    does not change array attributes after creation), so the store keeps ``bfloat16``."""
    from zckpt import zarr_bfloat16
    from zckpt.io.zarr_local import ArrayV3Metadata, AsyncArray, zarr

    meta = arr.metadata
    if not isinstance(getattr(meta, "data_type", None), zarr_bfloat16.BFloat16):
        return arr
    doc = meta.to_dict()
    doc["data_type"] = "uint16"
    doc["fill_value"] = zarr_bfloat16.bits_from_json(doc["fill_value"])
    base = arr._async_array
    config = getattr(base, "config", None) or base._config  # ``config`` is public from zarr 3.1.6
    return zarr.Array(AsyncArray(metadata=ArrayV3Metadata.from_dict(doc), store_path=base.store_path,
                                 config=config))


def data_type_name(arr: zarr.Array[Any]) -> str:
    """The array's data type as its ``zarr.json`` names it (``"bfloat16"``, ``"uint16"``, ...)."""
    return str(arr.metadata.data_type.to_json(zarr_format=3))  # type: ignore[union-attr]


def gather(coros: Sequence[Awaitable[Any]]) -> list[Any]:
    """Run coroutines concurrently on zarr's own event loop and return their results."""
    if not coros:
        return []
    import asyncio  # heavy (~35 ms to import): only beside zarr-python, for its event loop

    from zckpt.io.zarr_local import sync as zarr_sync

    async def run() -> list[Any]:
        return list(await asyncio.gather(*coros))

    result: list[Any] = zarr_sync(run())
    return result



def fsspec_store(url: str, storage_options: remote.StorageOptions, *, read_only: bool) -> FsspecStore:
    """zarr's own fsspec store for a URL (it wraps synchronous filesystems such as ``memory://``)."""
    from zckpt.io.zarr_local import FsspecStore

    return FsspecStore.from_url(url, storage_options=remote.fs_options(storage_options), read_only=read_only)


def writing_empty_chunks(node: zarr.Array[Any]) -> zarr.Array[Any]:
    """``node`` with ``write_empty_chunks`` on: without it an all-zero chunk written through
    zarr leaves no file, which raw chunk readers then miss. zarr 3.1 drops ``config`` when it
    opens an existing array, and ``Array.with_config`` only exists from zarr 3.1.6 (numpy 1.26
    gets 3.1.5), so the array is rebuilt from its metadata with that runtime config."""
    from zckpt.io.zarr_local import AsyncArray, zarr

    a = node._async_array
    return zarr.Array(AsyncArray(metadata=a.metadata, store_path=a.store_path,
                                 config={"order": "C", "write_empty_chunks": True}))



def create_arrays(group: zarr.Group, arrays: Sequence[tuple[str, str, TensorSpec, tuple[int, ...], dict[str, Any]]],
                  compressors: Any) -> list[tuple[str, zarr.Array[Any]]]:
    """Create compressed arrays (``(entry name, node, entry, chunk shape, attributes)``)
    through zarr's async API, thousands of them concurrently; ``(entry name, array)`` each."""
    if not arrays:
        return []
    from zckpt.io.zarr_local import zarr

    agroup = group._async_group
    created = gather([agroup.create_array(node, shape=t.shape, chunks=chunks, dtype=zarr_type(t.ms_type, t.kind),
                                          compressors=compressors, fill_value=0, attributes={"zckpt": attrs},
                                          config={"write_empty_chunks": True})
                      for _, node, t, chunks, attrs in arrays])
    return [(a[0], zarr.Array(node)) for a, node in zip(arrays, created, strict=True)]


class OpenArrays:
    """The arrays of one store opened through zarr-python, as zckpt uses them (bf16 as bits),
    each checked against its manifest entry once and kept with the data type it is stored
    with. ``where`` names a node of the store in messages; ``url`` is the store's."""

    def __init__(self, where: Callable[..., str], url: str) -> None:
        self._where = where
        self._url = url
        self._arrays: dict[str, zarr.Array[Any]] = {}
        self._data_types: dict[str, str] = {}

    def get(self, name: str) -> zarr.Array[Any] | None:
        return self._arrays.get(name)

    def data_type(self, name: str) -> str | None:
        """The data type ``name`` is stored with, once its array was opened."""
        return self._data_types.get(name)

    def open(self, group: zarr.Group, e: EntryRecord, mode: str) -> zarr.Array[Any]:
        """Open the array of entry ``e``."""
        from zckpt.io.zarr_local import zarr

        try:
            node = writing_empty_chunks(zarr.open_array(store=group.store, path=e.key, mode=mode))
        except Exception as err:  # zarr raises several types for a missing or broken node
            raise StoreError(f"array {e.key} cannot be opened: {err}", path=self._url, param=e.name) from None
        self._check(e, node)
        return self.keep(e.name, node)

    def open_many(self, group: zarr.Group, entries: Sequence[EntryRecord], mode: str) -> None:
        """Open the arrays of ``entries`` concurrently (in a remote store each open is a round
        trip; one after another they dominate small transfers)."""
        from zckpt.io.zarr_local import open_array, zarr

        with remote.remote_errors(StoreError, self._url, "cannot open arrays"):
            opened = gather([open_array(store=group.store, path=e.key, mode=mode, zarr_format=3)
                             for e in entries])
        for e, node in zip(entries, opened, strict=True):
            self._check(e, zarr.Array(node))
            self.keep(e.name, writing_empty_chunks(zarr.Array(node)))

    def packed(self, e: EntryRecord, raw: bytes, writers: Sequence[tuple[int, Box]]) -> zarr.Array[Any]:
        """A packed tensor as a zarr array of its own, in memory: its bytes ``raw`` under the
        attributes its array would have had."""
        from zckpt.io.zarr_local import zarr

        attrs: dict[str, Any] = {"name": e.name, "ms_dtype": e.ms_type, "kind": e.kind,
                                 "writers": [[r, b.to_json()] for r, b in writers]}
        node = zarr.create_array(store=zarr.storage.MemoryStore(), shape=e.shape, chunks=e.shape,
                                 dtype=zarr_type(e.ms_type, e.kind), compressors=None, fill_value=0,
                                 attributes={"zckpt": attrs})
        bits_view(node)[...] = np.frombuffer(raw, dtype=ms_dtype(e.ms_type).storage).reshape(e.shape)
        return self.keep(e.name, node)

    def _check(self, e: EntryRecord, node: zarr.Array[Any]) -> None:
        """An opened array against its manifest entry (:func:`zckpt.store.integrity.check_array`)."""
        doc = {"shape": node.shape, "data_type": data_type_name(node),
               "attributes": {"zckpt": node.attrs.get("zckpt")}}
        integrity.check_array(e.kind, e.ms_type, e.shape, e.name, doc, self._where(e.key, "zarr.json"))
        integrity.check_codecs(node.metadata.to_dict().get("codecs"), self._where(e.key, "zarr.json"), e.name)

    def keep(self, name: str, node: zarr.Array[Any]) -> zarr.Array[Any]:
        """Cache an opened array as zckpt uses it (bf16 as bits), remembering its stored type."""
        self._data_types[name] = data_type_name(node)
        view = bits_view(node)
        self._arrays[name] = view
        return view


def verify_remote_chunks(group: zarr.Group, url: str, e: EntryRecord, chunks: Sequence[int], keys: Sequence[str],
                         expected: Mapping[str, ChunkSums], done: Checked | None) -> int:
    """Check the chunks ``keys`` of entry ``e``'s array in a remote store against their
    records ``expected``: each chunk's stored bytes are fetched through zarr's store API, a
    few at a time (concurrent requests, at most ~64 MiB in flight). Returns the bytes checked."""
    from zckpt.io.zarr_local import default_buffer_prototype

    name = e.name
    chunk_bytes = max(1, math.prod(chunks) * ms_dtype(e.ms_type).storage.itemsize)
    per_batch = max(1, (64 * 1024 * 1024) // chunk_bytes)
    todo = [k for k in keys if k in expected and not all_checked(done, name, k, expected[k])]
    prefix = e.key
    checked = 0
    for i in range(0, len(todo), per_batch):
        batch = todo[i : i + per_batch]
        proto = default_buffer_prototype()
        with remote.remote_errors(StoreError, url, "cannot read chunks"):
            bufs = gather([group.store.get(f"{prefix}/{k}", prototype=proto) for k in batch])
        for key, buf in zip(batch, bufs, strict=True):
            where = f"{url.rstrip('/')}/{prefix}/{key}"
            if buf is None:
                raise StoreError("chunk is missing: the store is damaged", path=where, param=name)
            data = buf.as_numpy_array()
            want = expected[key]
            refuse_mismatch(want.check_whole(data), key, where, name)
            checked += int(data.nbytes)
            if done is not None:
                done.update((name, key, i) for i in range(len(want.values)))
    return checked
