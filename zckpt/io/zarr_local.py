"""zarr-python for the store paths that need it, imported on first use: zckpt's one door to zarr.

Local reads and writes of a zckpt store go through raw chunk files and ``zarr.json`` documents
(:mod:`zckpt.store.chunk_files`, :mod:`zckpt.store.array_documents`); importing zarr-python
(asyncio, numcodecs, ...) would add a few tenths of a second to every command's start. Every
zarr name zckpt uses at run time is imported from here, never from ``zarr`` itself: this module
registers Zarr's ``bfloat16`` data type (:mod:`zckpt.zarr_bfloat16`) before any of them is used,
so a store holding bf16 opens in a fresh interpreter whichever command or function opens it
first (tests/test_fresh_interpreter.py also checks the sources for a stray ``import zarr``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import zarr as zarr
from zarr.abc.store import ByteRequest
from zarr.api.asynchronous import open_array as open_array
from zarr.core.array import AsyncArray as AsyncArray
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.core.buffer import default_buffer_prototype as default_buffer_prototype
from zarr.core.metadata import ArrayV3Metadata as ArrayV3Metadata
from zarr.core.sync import sync as sync
from zarr.storage import FsspecStore as FsspecStore
from zarr.storage import LocalStore

from zckpt import zarr_bfloat16
from zckpt.core.errors import StoreError
from zckpt.io import safe_paths

zarr_bfloat16.register()


class ConfinedStore(LocalStore):
    """zarr's local store that never follows a symbolic link below its root, nor a key that
    climbs out of it (:mod:`zckpt.io.safe_paths`): zarr itself reads and writes any path it
    is given. Each folder is checked once; each file read costs one ``lstat``."""

    def __init__(self, root: Path | str, *, read_only: bool = False) -> None:
        super().__init__(root, read_only=read_only)
        self.confined = safe_paths.Confined(self.root, StoreError)

    def _check(self, key: str, reading: bool = True) -> None:
        path = self.confined.file(key)
        if reading:
            safe_paths.refuse_link(path, StoreError)

    async def get(self, key: str, prototype: BufferPrototype | None = None,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        self._check(key)
        return await super().get(key, prototype, byte_range)

    def get_sync(self, key: str, *, prototype: BufferPrototype | None = None,
                 byte_range: ByteRequest | None = None) -> Buffer | None:
        self._check(key)
        return super().get_sync(key, prototype=prototype, byte_range=byte_range)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
        key_ranges = list(key_ranges)
        for key, _ in key_ranges:
            self._check(key)
        return await super().get_partial_values(prototype, key_ranges)

    async def _set(self, key: str, value: Buffer, exclusive: bool = False) -> None:
        self._check(key, reading=False)  # zarr writes a temporary file and renames it over the key
        await super()._set(key, value, exclusive)

    def set_sync(self, key: str, value: Buffer) -> None:
        self._check(key, reading=False)
        super().set_sync(key, value)

    async def delete(self, key: str) -> None:
        self._check(key, reading=False)
        await super().delete(key)

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        if prefix.strip("/"):
            self.confined.folder(prefix.strip("/"))
        async for key in super().list_dir(prefix):
            yield key
