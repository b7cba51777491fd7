"""zarr-python for the store paths that need it, imported on first use.

Local reads and writes of a zckpt store go through raw chunk files and ``zarr.json`` documents
(:mod:`zckpt.store`); importing zarr-python (asyncio, numcodecs, ...) would add a few tenths of a
second to every command's start. Its users import it from here, which also registers Zarr's
``bfloat16`` data type (:mod:`zckpt.zarr_bfloat16`) before any array reaches a caller.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import zarr as zarr
from zarr.abc.store import ByteRequest
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import LocalStore

from zckpt import safe_paths, zarr_bfloat16
from zckpt.errors import StoreError

zarr_bfloat16.register()


class ConfinedStore(LocalStore):
    """zarr's local store that never follows a symbolic link below its root, nor a key that
    climbs out of it (:mod:`zckpt.safe_paths`): zarr itself reads and writes any path it
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
