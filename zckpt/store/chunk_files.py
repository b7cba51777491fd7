"""A local store's chunk files: their paths, preallocated shards, packed chunks, and their checksums checked.

Local stores are read and written as raw files, without zarr-python: a raw chunk (or shard)
file is its values' bytes at offsets :class:`~zckpt.store.geometry.ChunkInfo` computes. This
module turns those keys into checked paths inside the store (no symbolic link, no key
climbing out: :mod:`zckpt.io.safe_paths`), creates sharded arrays' files at their final size,
reads a packed tensor's bytes, and checks chunk files against their checksum records
(:mod:`zckpt.store.chunk_records`). A remote store has no chunk files: its chunks are read
through zarr's store API (:mod:`zckpt.store.zarr_arrays`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import StoreError
from zckpt.core.layout import Box, tiles
from zckpt.io import fileio, safe_paths
from zckpt.io.checksums import ChunkSums, file_sums
from zckpt.plan.values import TensorSpec
from zckpt.store import integrity, packed
from zckpt.store.chunk_records import Checked, all_checked, refuse_mismatch
from zckpt.store.geometry import ChunkInfo
from zckpt.store.manifest import EntryRecord


def preallocate_shards(folder: Path, t: TensorSpec, chunks: tuple[int, ...], per_shard: tuple[int, ...]) -> None:
    """Every shard file of a sharded array at its final size, its blocks reserved where
    the filesystem can (:func:`zckpt.io.fileio.allocate`: a full disk fails here, naming the
    file), with its index at the end: the index follows from the layout, so it is written
    once here and never read back or rewritten. Reserved blocks are not written data:
    what is present is what the progress records say, never the file's size."""
    info = ChunkInfo(t.shape, chunks, True, ".", folder, per_shard, ms_dtype(t.ms_type).storage.itemsize)
    for shard in np.ndindex(*info.shard_count()):
        data, index = info.shard_layout(shard)
        path = folder / info.chunk_key(shard)
        fd = safe_paths.open_write(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, StoreError)
        try:
            with fileio.disk_full_named(path):
                fileio.allocate(fd, data + len(index), path)
                os.pwrite(fd, index, data)
        finally:
            os.close(fd)


class ChunkFiles:
    """The chunk files of one local store, each path found (and checked) once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.confined = safe_paths.Confined(path, StoreError)
        self._files: dict[tuple[str, str], tuple[Path, int]] = {}
        self._packs: dict[str, tuple[int, Path, int, str]] = {}
        """Packed arrays located so far: chunk length, folder, item size, the type checked."""
        self._pack_files: dict[tuple[Path, str], Path] = {}

    def folder(self, e: EntryRecord) -> Path:
        """An array's folder, checked to be a real folder inside the store."""
        return self.confined.folder(e.key)

    def check_links(self, entries: Iterable[EntryRecord]) -> None:
        """Refuse, by name, a symbolic link anywhere in the store's array folders (a listing
        per folder, no ``stat`` per file)."""
        seen = set()
        for e in entries:
            if e.kind != "str" and e.key not in seen:  # packed tensors share their array's folder
                seen.add(e.key)
                safe_paths.refuse_links_below(self.folder(e), StoreError, e.name)

    def array_document(self, e: EntryRecord, where: str) -> dict[str, Any] | None:
        """An array's ``zarr.json`` checked against its manifest entry and what the format
        requires; ``None`` when it cannot be read as JSON (zarr-python then says why)."""
        try:
            doc: Any = json.loads(safe_paths.read_bytes(self.folder(e) / "zarr.json", StoreError, e.name))
        except StoreError:
            raise
        except (OSError, ValueError):
            return None
        if doc is not None:
            integrity.check_array(e.kind, e.ms_type, e.shape, e.name, doc, where)
            integrity.check_codecs(doc.get("codecs"), where, e.name)
        return doc  # type: ignore[no-any-return]

    def chunk_at(self, name: str, info: ChunkInfo, coords: Sequence[int]) -> tuple[str, Path, int, int] | None:
        """``(file key, file, byte offset, file size)`` of a raw (inner) chunk, or ``None``
        when chunks are encoded otherwise."""
        if not info.raw or info.folder is None:
            return None
        key, offset = info.locate(coords)
        got = self._files.get((name, key))
        if got is None:  # a file's path and size follow from its key: found once, not per chunk
            got = self._files[(name, key)] = (self._chunk_path(info, key), info.file_bytes(coords))
        return key, got[0], offset, got[1]

    def chunk_files(self, info: ChunkInfo, box: Box) -> list[tuple[str, Path]]:
        """``(file key, file)`` of every chunk (or shard) file ``box`` touches (raw chunks;
        else empty)."""
        if not info.raw or info.folder is None:
            return []
        if box.ndim == 0:
            return [(info.chunk_key(()), self._chunk_path(info, info.chunk_key(())))]
        out: dict[str, Path] = {}
        for t in tiles(box, info.chunks):
            key, _ = info.locate(tuple(a // c for a, c in zip(t.start, info.chunks, strict=True)))
            if key not in out:
                out[key] = self._chunk_path(info, key)
        return list(out.items())

    def files_of(self, info: ChunkInfo, box: Box) -> list[tuple[str, Path]]:
        """:meth:`chunk_files` of an array, or the packed chunk file of a packed tensor."""
        return self.chunk_files(info, box) if info.at is None else [self.packed_file(info)]

    def _chunk_path(self, info: ChunkInfo, key: str) -> Path:
        """A chunk file's path; chunk keys with the ``/`` separator have folders of their own,
        checked (once each) like the array's."""
        assert info.folder is not None
        if "/" in key:
            return self.confined.file(f"{info.folder.relative_to(self.path).as_posix()}/{key}")
        return info.folder / key

    def packed_file(self, info: ChunkInfo) -> tuple[str, Path]:
        """``(chunk key, file)`` of the packed chunk a packed tensor's :class:`~zckpt.store.geometry.ChunkInfo`
        places it in (one path per chunk file, not one per tensor)."""
        assert info.at is not None and info.folder is not None
        got = self._pack_files.get((info.folder, info.at[0]))
        if got is None:
            got = self._pack_files[(info.folder, info.at[0])] = info.folder / info.at[0]
        return info.at[0], got

    def packed_place(self, e: EntryRecord, where: str) -> tuple[Path, str, int, int]:
        """``(packed array folder, chunk key, byte offset, chunk file bytes)`` of a packed
        tensor, checked to lie inside one chunk of the packed array of its type (without a
        :class:`ChunkInfo` each: ingest places 100 000s of them); ``where``: the store, as
        messages name it."""
        got = self._packs.get(e.key)
        if got is None or got[3] != e.ms_type or e.offset is None or e.offset < 0:
            if e.key != packed.pack_key(e.ms_type) or e.offset is None or e.offset < 0:
                raise misplaced_pack(e, where)
            folder = self.folder(e)
            got = self._packs[e.key] = (packed.read_chunk_length(folder), folder,
                                        ms_dtype(e.ms_type).storage.itemsize, e.ms_type)
        chunk, folder, itemsize, _ = got
        key, at = packed.locate(e.offset, chunk, itemsize)
        if at + math.prod(e.shape) * itemsize > chunk * itemsize:
            raise StoreError(f"manifest places a packed tensor across chunk {key}'s end", path=where, param=e.name)
        return folder, key, at, chunk * itemsize

    @staticmethod
    def read_packed(info: ChunkInfo, name: str) -> bytes:
        """A packed tensor's bytes, read from its packed chunk (not checked here)."""
        assert info.at is not None and info.folder is not None
        with safe_paths.open_binary(info.folder / info.at[0], StoreError, name) as f:
            raw = os.pread(f.fileno(), info.inner_bytes, info.at[1])
        if len(raw) != info.inner_bytes:
            raise StoreError(f"packed chunk {info.at[0]} ended early: the store is damaged",
                             path=info.folder / info.at[0], param=name)
        return raw

    def verify(self, name: str, owner: str, info: ChunkInfo, box: Box,
               records_of: Callable[[str], list[tuple[str, ChunkSums]]], done: Checked | None) -> int:
        """Check every recorded block of every chunk file ``box`` touches against
        ``records_of(file key)``; raise naming parameter and chunk. Returns the bytes checked;
        blocks are remembered in ``done`` under ``owner`` (the name the records are filed under)."""
        checked = 0
        buffer: bytearray | None = None
        for file_key, path in self.files_of(info, box):
            for key, want in records_of(file_key):
                if all_checked(done, owner, key, want):
                    continue
                buffer = buffer if buffer is not None else bytearray(1024 * 1024)
                try:
                    got, size = file_sums(path, want.block_bytes, want.algo, buffer, want.origin, want.length)
                except FileNotFoundError:
                    raise StoreError("chunk file is missing: the store is damaged", path=path, param=name) from None
                if done is not None:  # a damaged run is reported once, not for each tensor it holds
                    done.update((owner, key, i) for i in range(len(want.values)))
                refuse_mismatch(want.compare(got, 0, want.length if want.length is not None else size, whole=True),
                                file_key, str(path), name, want)
                checked += size
        return checked


def misplaced_pack(e: EntryRecord, where: str) -> StoreError:
    """A manifest entry that places a packed tensor outside the packed array of its type
    (or in a remote store, which has no packed arrays)."""
    return StoreError(f"manifest places a packed tensor at {e.key!r}, not in the packed array of its type",
                      path=where, param=e.name)
