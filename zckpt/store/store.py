"""The Zarr v3 store: every checkpoint entry in global coordinates.

Layout (readable without zckpt, see docs/store-format.md)::

    STORE.zarr/zarr.json              group; attributes["zckpt"] = manifest (entries, source, state)
    STORE.zarr/tensors/<key>/         one array per tensor entry, full logical shape
    STORE.zarr/maps/<key>/            MapParameter entries: their encoded bytes (uint8)

Array keys are the entry names percent-encoded so that no name can escape the store.
BFloat16 arrays have Zarr's extension data type ``bfloat16`` (format version 2 and later; version 1
stored them as ``uint16``); the first use of zarr-python here registers that type with it
(:mod:`zckpt.io.zarr_local`, :mod:`zckpt.zarr_bfloat16`), and zckpt itself reads and writes them
as their ``uint16`` bit patterns (:func:`bits_view`), as it does every other bf16 value.
Local stores are opened, read and exported without zarr-python (its import alone costs a few
tenths of a second): the group's and the arrays' ``zarr.json`` are read as JSON.
Each array's attributes say which source rank wrote which box ("writers"); a region is
present when its writer's rank has its progress record, ``progress/rank_<r>.json`` (format 5;
a ``progress/rank_<r>`` group before, see :mod:`zckpt.store.records`). Chunks divide the
source shard shape, so two writers never touch the same chunk.

Format 4 groups the chunks of a local store into shards (Zarr's ``sharding_indexed``
codec): the chunk of format 3 becomes the shard's inner chunk, stored uncompressed at an
offset that follows from the layout alone (C order of the inner grid), so that several
writers fill disjoint byte ranges of one preallocated shard file and the shard index is
written once, when the array is defined (:func:`shard_grid`, :func:`write_runs`).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
from collections.abc import Awaitable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import StoreError
from zckpt.core.layout import Box, tiles
from zckpt.formats.strategy import ParamLayout
from zckpt.io import fileio, remote, safe_paths
from zckpt.io.checksums import ChunkSums, Mismatch, crc32c, file_sums
from zckpt.plan.values import TensorSpec
from zckpt.store import integrity, packed
from zckpt.store import records as rank_records
from zckpt.store.records import decode_runs

if TYPE_CHECKING:  # zarr-python is imported where it is used, from zckpt.io.zarr_local
    import zarr
    from zarr.storage import FsspecStore

    from zckpt.zarr_bfloat16 import BFloat16

    ZarrType = np.dtype[Any] | BFloat16
    """What an array is created with: a numpy dtype, or Zarr's ``bfloat16`` extension type."""

FORMAT = "zckpt-store"
VERSION = 7
"""7: the progress records of consecutive ranks may share one file (:mod:`zckpt.store.records`);
6: small tensors that one source rank writes whole are packed into one array per data type
(:mod:`zckpt.store.packed`); 5: progress records are plain files (:mod:`zckpt.store.records`), not zarr
groups; 4: local stores group chunks into shards (``sharding_indexed``), checksums per block of
each writer's run of a shard; 3: chunk checksums per block (``crc32c_blocks``); 2: one per
chunk; 2 and later: BFloat16 arrays are Zarr ``bfloat16``; 1: they were ``uint16``. Older
versions are still read."""

SHARDED_LAYOUTS = (4, 5)
"""Versions whose arrays ingest defines raw, ``.``-separated, sharded as :func:`shard_grid` says."""

NO_CHUNK = 2**64 - 1
"""Offset and size of an absent inner chunk in a shard index (Zarr's sharding codec)."""

Checked = set[tuple[str, str, int]]
"""Chunk blocks already checked in this process: ``(entry name, record key, block index)``."""

_SAFE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789._-")
_MAX_KEY = 180


def encode_key(name: str) -> str:
    """A store-safe node name for an entry name: one path component that no other name maps
    to, even on a case-insensitive disk, and never Zarr's own ``zarr.json``.

    Only lowercase letters, digits and ``._-`` are kept; everything else (uppercase included,
    so that ``W`` and ``w`` differ in more than case) is percent-encoded as UTF-8 bytes.
    """
    out = []
    for i, ch in enumerate(name):
        if ch in _SAFE and not (i == 0 and ch in "._"):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    key = "".join(out) or "%"
    if key == "zarr.json":
        key = "%7A" + key[1:]
    if len(key) > _MAX_KEY:
        digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:16]
        key = f"{key[:_MAX_KEY - 18]}~{digest}"
    return key


def layout_to_json(lay: ParamLayout) -> dict[str, Any]:
    return {
        "dev_matrix": list(lay.dev_matrix),
        "tensor_map": [list(a) for a in lay.tensor_map],
        "opt_weight_shard_step": lay.opt_shard_step,
        "opt_weight_shard_size": lay.opt_shard_size,
    }


@dataclass(frozen=True)
class EntryRecord:
    """A manifest line: one checkpoint entry and where it lives in the store."""

    name: str
    kind: str
    ms_type: str
    shape: tuple[int, ...]
    key: str
    value: str | None = None
    stages: tuple[int, ...] = (0,)
    note: str | None = None
    offset: int | None = None
    """A packed tensor's element offset in its packed array ``key`` (:mod:`zckpt.store.packed`)."""
    writer: int | None = None
    """The source rank that writes a packed tensor (other tensors list their writers in their
    array's attributes)."""

    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.kind, self.ms_type, self.shape, stages=self.stages, note=self.note)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "ms_type": self.ms_type,
            "shape": list(self.shape),
            "key": self.key,
        }
        if self.value is not None:
            doc["value"] = self.value
        doc["stages"] = list(self.stages)
        if self.note is not None:
            doc["note"] = self.note
        if self.offset is not None:
            doc["offset"], doc["writer"] = self.offset, self.writer
        return doc

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> EntryRecord:
        return EntryRecord(
            name=str(doc["name"]),
            kind=str(doc["kind"]),
            ms_type=str(doc["ms_type"]),
            shape=tuple(map(int, doc["shape"])),
            key=str(doc["key"]),
            value=doc.get("value"),
            stages=tuple(map(int, doc.get("stages", (0,)))),
            note=doc.get("note"),
            offset=None if doc.get("offset") is None else int(doc["offset"]),
            writer=None if doc.get("offset") is None else int(doc["writer"]),
        )


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


def _data_type_name(arr: zarr.Array[Any]) -> str:
    """The array's data type as its ``zarr.json`` names it (``"bfloat16"``, ``"uint16"``, ...)."""
    return str(arr.metadata.data_type.to_json(zarr_format=3))  # type: ignore[union-attr]


def _type_name(ms_type: str, kind: str) -> tuple[str, int]:
    """The Zarr data type of an entry's array as its ``zarr.json`` names it, and its item size
    (:func:`zarr_type`, without importing zarr-python)."""
    if kind != "tensor":
        return "uint8", 1
    if ms_type == "BFloat16":
        return "bfloat16", 2
    dtype = ms_dtype(ms_type).storage
    return dtype.name, dtype.itemsize


def _template(ms_type: str, kind: str, sharded: bool = False) -> dict[str, Any]:
    """The ``zarr.json`` that zarr-python writes for an uncompressed array of the entry's data
    type (tests/test_lazy_zarr.py compares the two for every type), with or without the
    sharding codec (inner chunks uncompressed, index at the end); written here so that
    defining a store's arrays needs no zarr-python.

    Chunk keys use the ``.`` separator (``c.0.1``): one file per chunk (or shard) in the
    array's folder, with no directory per chunk coordinate to create.
    """
    name, itemsize = _type_name(ms_type, kind)
    raw: dict[str, Any] = {"name": "bytes"}
    if itemsize > 1:  # zckpt's storage types are little-endian
        raw["configuration"] = {"endian": "little"}
    codecs: list[dict[str, Any]] = [raw]
    if sharded:
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [1], "codecs": [raw],
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "index_location": "end"}}]
    fill: Any = False if name == "bool" else 0.0 if "float" in name else 0
    return {"shape": [2], "data_type": name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2 if sharded else 1]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
            "fill_value": fill, "codecs": codecs, "attributes": {}, "zarr_format": 3, "node_type": "array",
            "storage_transformers": []}


def _array_json(ms_type: str, kind: str, shape: Sequence[int], chunks: Sequence[int], attributes: dict[str, Any],
                per_shard: Sequence[int] | None = None) -> str:
    """An array's ``zarr.json``: ``chunks`` is the chunk shape, the inner chunk shape of a
    sharded array whose shards hold ``per_shard`` inner chunks per dimension."""
    doc = _template(ms_type, kind, per_shard is not None)
    doc["shape"] = [int(s) for s in shape]
    grid = [int(c) for c in chunks] if per_shard is None else [int(c) * int(k) for c, k in zip(chunks, per_shard,
                                                                                                   strict=True)]
    doc["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": grid}}
    if per_shard is not None:
        doc["codecs"][0]["configuration"]["chunk_shape"] = [int(c) for c in chunks]
    doc["attributes"] = attributes
    return json.dumps(doc)


GROUP_DOCUMENT: dict[str, Any] = {"attributes": {}, "zarr_format": 3, "node_type": "group"}
"""A group's ``zarr.json`` as zarr-python writes it (``tensors``, ``maps``)."""


def _write_json(folder: Path, doc: Mapping[str, Any]) -> None:
    """A node's ``zarr.json`` in a local store being defined (no data yet: not atomic), laid
    out as zarr-python lays it out."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "zarr.json").write_text(json.dumps(doc, indent=2), encoding="utf-8")


def _write_array_json(
    folder: Path, ms_type: str, kind: str, shape: Sequence[int], chunks: Sequence[int], attributes: dict[str, Any],
    per_shard: Sequence[int] | None = None,
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "zarr.json").write_text(_array_json(ms_type, kind, shape, chunks, attributes, per_shard),
                                      encoding="utf-8")


def _raw_bytes_codec(codecs: Any) -> bool:
    """Whether a codec list is the single ``bytes`` codec in this machine's byte order."""
    if not (isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict)
            and codecs[0].get("name") == "bytes"):
        return False
    return (codecs[0].get("configuration") or {}).get("endian") in (None, sys.byteorder)


def _raw_shards(codecs: list[Any]) -> tuple[int, ...] | None:
    """The inner chunk shape of a sharding codec whose inner chunks are raw bytes and whose
    index is zckpt's (little-endian, CRC-32C, at the end); else ``None``."""
    if len(codecs) != 1 or not isinstance(codecs[0], dict) or codecs[0].get("name") != "sharding_indexed":
        return None
    conf = codecs[0].get("configuration") or {}
    index = conf.get("index_codecs")
    if not (_raw_bytes_codec(conf.get("codecs")) and conf.get("index_location", "end") == "end"
            and isinstance(index, list) and len(index) == 2 and isinstance(index[0], dict)
            and index[0].get("name") == "bytes"
            and (index[0].get("configuration") or {}).get("endian", "little") == "little"
            and isinstance(index[1], dict) and index[1].get("name") == "crc32c"):
        return None
    return tuple(int(x) for x in conf["chunk_shape"])


@dataclass(frozen=True)
class ChunkInfo:
    """What a chunk-level reader or writer needs to know about an array.

    ``raw``: chunks are stored as their raw C-order values in this machine's byte order
    (the single ``bytes`` codec), so a chunk file is exactly its values' bytes. In a
    sharded array (``per_shard``: inner chunks per shard in each dimension) ``chunks`` is
    the inner chunk shape, and a raw inner chunk is ``inner_bytes`` at a fixed offset of its
    shard file (:meth:`locate`).
    """

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    raw: bool
    separator: str
    folder: Path | None
    per_shard: tuple[int, ...] | None = None
    itemsize: int = 0
    at: tuple[str, int, int] | None = None
    """A packed tensor (:mod:`zckpt.store.packed`): its one chunk is ``at[1]`` bytes into the
    chunk file ``at[0]`` of its packed array, a file of ``at[2]`` bytes."""

    @staticmethod
    def from_json(doc: Mapping[str, Any], folder: Path | None, itemsize: int = 0) -> ChunkInfo:
        codecs = list(doc.get("codecs") or [])
        grid = tuple(int(x) for x in doc["chunk_grid"]["configuration"]["chunk_shape"])
        inner = _raw_shards(codecs)
        raw = _raw_bytes_codec(codecs) or inner is not None
        enc = doc.get("chunk_key_encoding") or {}
        sep = str((enc.get("configuration") or {}).get("separator", "/"))
        if sep not in (".", "/"):  # Zarr v3 allows these two; any other could climb out of the array
            raise StoreError(f"chunk_key_encoding separator {sep!r} is neither '.' nor '/'",
                             path=None if folder is None else folder / "zarr.json")
        raw = raw and enc.get("name", "default") == "default"
        per_shard = None
        if inner is not None:
            per_shard = tuple(g // c for g, c in zip(grid, inner, strict=True))
            if any(g % c for g, c in zip(grid, inner, strict=True)) or itemsize <= 0:
                raw = False
        return ChunkInfo(
            shape=tuple(int(x) for x in doc["shape"]),
            chunks=inner if inner is not None else grid,
            raw=raw,
            separator=sep,
            folder=folder,
            per_shard=per_shard,
            itemsize=itemsize,
        )

    def chunk_key(self, coords: Sequence[int]) -> str:
        """Zarr v3's default chunk key: ``c`` followed by the chunk coordinates (of a shard,
        in a sharded array)."""
        if self.at is not None:
            return self.at[0]
        if not coords:
            return "c"
        return "c" + self.separator + self.separator.join([str(int(c)) for c in coords])

    @cached_property
    def prefix(self) -> str:
        """The array's folder as a path prefix of its chunk keys (``folder/``)."""
        return "" if self.folder is None else str(self.folder) + os.sep

    @cached_property
    def inner_bytes(self) -> int:
        return math.prod(self.chunks) * self.itemsize

    def locate(self, coords: Sequence[int]) -> tuple[str, int]:
        """``(file key, byte offset)`` of the chunk at ``coords`` (of the inner chunk grid
        in a sharded array: its shard's key and its place in the shard's C order)."""
        if self.at is not None:
            return self.at[0], self.at[1]
        if self.per_shard is None:
            return self.chunk_key(coords), 0
        shard = []
        linear = 0
        for c, k in zip(coords, self.per_shard, strict=True):
            q, i = divmod(int(c), k)
            shard.append(q)
            linear = linear * k + i
        return self.chunk_key(shard), linear * self.inner_bytes

    def file_bytes(self, coords: Sequence[int]) -> int:
        """Size of the file holding the chunk at ``coords``: the chunk, or its shard's data
        and index (inner chunks present form a box of the shard's grid, so the last one in
        C order is the one at the largest local coordinates)."""
        if self.at is not None:
            return self.at[2]
        if self.per_shard is None:
            return self.inner_bytes
        counts = self.grid_counts()
        last = 0
        for c, k, n in zip(coords, self.per_shard, counts, strict=True):
            first = (int(c) // k) * k
            last = last * k + (min(k, n - first) - 1)
        return (last + 1) * self.inner_bytes + 16 * math.prod(self.per_shard) + 4

    def grid_counts(self) -> tuple[int, ...]:
        """Number of (inner) chunks along each dimension."""
        return tuple(-(-s // c) for s, c in zip(self.shape, self.chunks, strict=True))

    def shard_layout(self, shard: Sequence[int]) -> tuple[int, bytes]:
        """Data bytes and index bytes (with its CRC-32C) of the shard at ``shard``: inner
        chunks inside the array at their C-order offsets, the others absent."""
        assert self.per_shard is not None
        per = np.array(self.per_shard, dtype=np.int64)[:, None]
        local = np.indices(self.per_shard, dtype=np.int64).reshape(len(self.per_shard), -1)  # C order
        start = np.array([int(s) for s in shard], dtype=np.int64)[:, None] * per
        inside = np.flatnonzero(np.all(start + local < np.array(self.grid_counts(), dtype=np.int64)[:, None], axis=0))
        index = np.full((math.prod(self.per_shard), 2), NO_CHUNK, dtype="<u8")
        index[inside, 0] = inside.astype("<u8") * self.inner_bytes
        index[inside, 1] = self.inner_bytes
        data = (int(inside[-1]) + 1) * self.inner_bytes if inside.size else 0
        body = index.tobytes()
        return data, body + int(crc32c(body)).to_bytes(4, "little")

    def shard_count(self) -> tuple[int, ...]:
        assert self.per_shard is not None
        return tuple(-(-n // k) for n, k in zip(self.grid_counts(), self.per_shard, strict=True))


def shard_grid(shape: Sequence[int], chunks: Sequence[int], itemsize: int, target_bytes: int) -> tuple[int, ...] | None:
    """Inner chunks per shard in each dimension: the whole width of the array in every
    dimension but the first, and as many rows of chunks as fit ``target_bytes`` (at least
    one). With chunks spanning the full width, consecutive inner chunks of a shard are then
    consecutive rows of the array, so a range of rows is one byte range of the shard.
    ``None`` when a shard would hold a single chunk (the array is stored unsharded)."""
    if not shape or any(int(s) == 0 for s in shape):
        return None
    counts = [-(-int(s) // int(c)) for s, c in zip(shape, chunks, strict=True)]
    row = math.prod(counts[1:]) * math.prod(int(c) for c in chunks) * itemsize
    k0 = min(counts[0], max(1, target_bytes // max(1, row)))
    per = (k0, *counts[1:])
    return per if math.prod(per) > 1 else None


@dataclass(frozen=True)
class Run:
    """Consecutive inner chunks of one writer box that are one byte range of a shard file
    (a whole chunk file, unsharded): the unit ingest copies and checksums in one pass."""

    key: str
    """File key (``c.<i>...``) of the shard, or of the chunk."""
    offset: int
    length: int
    tiles: tuple[Box, ...]
    """The chunks' element boxes, in file order."""


def write_runs(info: ChunkInfo, box: Box) -> list[Run]:
    """The chunks of ``box`` (a writer box that the chunk grid divides) as runs: grouped by
    file and merged while each starts where the previous ends. Pure layout maths: the
    reader of a store finds the same runs from the writers' boxes."""
    if box.ndim == 0:
        return [Run(info.chunk_key(()), 0, info.itemsize, (box,))]
    if box.shape == info.chunks:  # one chunk (the grid divides writer boxes): most boxes of a many-rank job
        key, offset = info.locate(tuple(a // c for a, c in zip(box.start, info.chunks, strict=True)))
        return [Run(key, offset, info.inner_bytes, (box,))]
    placed = []
    for t in tiles(box, info.chunks):
        key, offset = info.locate(tuple(a // c for a, c in zip(t.start, info.chunks, strict=True)))
        placed.append((key, offset, t))
    placed.sort(key=lambda x: (x[0], x[1]))
    size = info.inner_bytes
    runs: list[Run] = []
    for key, offset, t in placed:
        last = runs[-1] if runs else None
        if info.per_shard is not None and last is not None and last.key == key \
                and last.offset + last.length == offset:
            runs[-1] = Run(key, last.offset, last.length + size, (*last.tiles, t))
        else:
            runs.append(Run(key, offset, size, (t,)))
    return runs


def _all_checked(done: Checked | None, name: str, key: str, sums: ChunkSums) -> bool:
    return done is not None and all((name, key, i) in done for i in range(len(sums.values)))


def _gather(coros: Sequence[Awaitable[Any]]) -> list[Any]:
    """Run coroutines concurrently on zarr's own event loop and return their results."""
    if not coros:
        return []
    import asyncio

    from zckpt.io.zarr_local import sync as zarr_sync

    async def run() -> list[Any]:
        return list(await asyncio.gather(*coros))

    result: list[Any] = zarr_sync(run())
    return result


def chunk_shape(shard: Sequence[int], itemsize: int, target_bytes: int) -> tuple[int, ...]:
    """Largest chunk that divides ``shard`` in every dimension and fits ``target_bytes``.

    Dividing the shard keeps chunk borders on shard borders, so writers never share a chunk.
    An empty shard has no chunk to write: its chunk is its shape (dims may be huge).
    """
    c = [max(1, int(s)) for s in shard]
    if any(int(s) == 0 for s in shard):
        return tuple(c)
    for d in range(len(c)):
        if math.prod(c) * itemsize <= target_bytes:
            break
        others = math.prod(c) // c[d]
        c[d] = _largest_divisor_at_most(c[d], max(1, target_bytes // max(1, others * itemsize)))
    return tuple(c)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    """Largest divisor of ``n`` not above ``limit``, by trial division up to the square root
    (a non-empty dimension is bounded by its file's payload, so this stays small)."""
    if n <= limit:
        return n
    best = 1
    k = 1
    while k * k <= n:
        if n % k == 0:
            if k <= limit:
                best = max(best, k)
            if n // k <= limit:
                best = max(best, n // k)
        k += 1
    return best


def _fsspec_store(url: str, storage_options: remote.StorageOptions, *, read_only: bool) -> FsspecStore:
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


def _group_attributes(root: Path) -> dict[str, Any]:
    """The attributes of the Zarr v3 group at ``root``, read from its ``zarr.json`` alone
    (not through zarr-python, whose import costs every command a few tenths of a second)."""
    try:
        doc = json.loads(safe_paths.read_bytes(root / "zarr.json", StoreError))
        if not isinstance(doc, dict):
            raise ValueError("zarr.json is not a JSON object")
        if doc.get("zarr_format") != 3:
            raise ValueError(f"zarr.json: zarr_format is {doc.get('zarr_format')!r}, not 3")
        if doc.get("node_type") != "group":
            raise ValueError(f"zarr.json: node_type is {doc.get('node_type')!r}, not 'group'")
        attrs = doc.get("attributes", {})
        if not isinstance(attrs, dict):
            raise ValueError("zarr.json: attributes is not a JSON object")
    except (OSError, ValueError, StoreError) as err:
        raise StoreError(f"cannot open zarr store: {err}", path=root) from None
    return attrs


def _new_manifest() -> dict[str, Any]:
    """The manifest of a store just created: no entries yet, a fresh identity."""
    return {"format": FORMAT, "version": VERSION, "complete": False, "entries": []}


class Store:
    """A zckpt store opened for reading or being written by ingest."""

    def __init__(
        self,
        path: Path,
        group: zarr.Group | None,
        mode: Literal["r", "r+", "a", "w", "w-"] = "r",
        location: remote.Location | None = None,
    ) -> None:
        self.path = path
        """The local directory (for a remote store: its path inside the filesystem, for messages)."""
        self.location = location
        """Where a remote store lives (``None`` for a local directory)."""
        self.url = location.url if location is not None else str(path)
        """The store as the user named it: what tasks reopen and what messages show."""
        self._group = group
        self._mode: Literal["r", "r+", "a", "w", "w-"] = "r" if mode == "r" else "r+"
        self._entries: dict[str, EntryRecord] | None = None
        self._writers: dict[str, list[tuple[int, Box]]] = {}
        self._arrays: dict[str, zarr.Array[Any]] = {}
        self._data_types: dict[str, str] = {}
        self._ingested: set[int] | None = None
        self._chunk_info: dict[str, ChunkInfo] = {}
        self._files: dict[tuple[str, str], tuple[Path, int]] = {}
        self._crcs: dict[str, dict[str, ChunkSums]] | None = None
        self._records: dict[tuple[str, str, int], list[tuple[str, ChunkSums]]] = {}
        self._index: dict[tuple[str, str], tuple[list[int], list[int], list[str]]] = {}
        self._plain: dict[str, dict[str, ChunkSums]] | None = None
        self._texts: dict[tuple[str, str], list[str]] | None = None
        self._version: int | None = None
        self._confined = safe_paths.Confined(path, StoreError) if location is None else None
        self._packs: dict[str, tuple[int, Path, int, str]] = {}
        """Packed arrays located so far: chunk length, folder, item size, the type checked."""
        self._trusted = False
        self._owners: set[str] | None = None
        self._pack_files: dict[tuple[Path, str], Path] = {}
        self._digested: tuple[dict[str, Any], str] | None = None
        self._manifest: dict[str, Any] | None = None
        """The manifest as this process last wrote it (local stores: not through zarr)."""
        self._other_attrs: dict[str, Any] | None = None
        """The root group's attributes besides the manifest, as this process last wrote them."""
        self._record_files: dict[int, str] = {}
        """Per source rank, the file its progress record was read from (for messages)."""

    @classmethod
    def attach(
        cls, path: Path, entries: Iterable[EntryRecord], infos: Mapping[str, ChunkInfo], version: int
    ) -> Store:
        """A local store as an ingest task writes it, from what its plan already knows (its
        entries and their chunk layouts): zarr opens it only if a write needs zarr (scalars,
        MapParameters), so that hundreds of rank tasks do not each open the store."""
        store = cls(path, None, mode="r+")
        store._entries = {e.name: e for e in entries}
        store._chunk_info = dict(infos)
        store._version = version
        return store

    @property
    def group(self) -> zarr.Group:
        if self._group is None:
            from zckpt.io.zarr_local import ConfinedStore, zarr

            try:
                self._group = zarr.open_group(ConfinedStore(self.path, read_only=self._mode == "r"),
                                              mode=self._mode, zarr_format=3)
            except Exception as err:  # zarr raises several unrelated types for a broken store
                raise StoreError(f"cannot open zarr store: {err}", path=self.path) from None
        return self._group

    @property
    def version(self) -> int:
        """The store's format version (its manifest's ``version``)."""
        if self._version is None:
            self._version = int(self.manifest.get("version", 0))
        return self._version

    # --- creation -----------------------------------------------------------------
    @property
    def is_remote(self) -> bool:
        return self.location is not None

    def where(self, *parts: str) -> str:
        """A node or chunk of the store as messages name it: a path, or a URL when remote."""
        if self.location is None:
            return str(self.path.joinpath(*parts))
        return "/".join([self.url.rstrip("/"), *parts])

    @classmethod
    def create(
        cls, path: str | Path, *, overwrite: bool = False, storage_options: remote.StorageOptions = None
    ) -> Store:
        if isinstance(path, str) and remote.is_remote(path):
            return cls._create_remote(path, overwrite, storage_options)
        p = remote.local_path(path)
        if p.exists():
            if not overwrite:
                raise StoreError("store already exists (--overwrite replaces it)", path=p)
            if (p / "zarr.json").is_file() or not any(p.iterdir()):
                shutil.rmtree(p)
            else:
                raise StoreError("refusing to overwrite a directory that is not a zarr store", path=p)
        p.mkdir(parents=True)
        store = cls(p, None, mode="w-")
        store._other_attrs = {}
        store._write_manifest(_new_manifest())
        return store

    @classmethod
    def _create_remote(cls, url: str, overwrite: bool, storage_options: remote.StorageOptions) -> Store:
        loc = remote.locate(url, storage_options, StoreError)
        children = remote.listdir(loc, StoreError)
        if children or remote.isfile(loc, StoreError):
            if not overwrite:
                raise StoreError("store already exists (--overwrite replaces it)", path=url)
            if ("zarr.json", False) not in children:
                raise StoreError("refusing to overwrite a location that is not a zarr store", path=url)
            remote.remove(loc, StoreError, recursive=True)
        from zckpt.io.zarr_local import zarr

        with remote.remote_errors(StoreError, url, "cannot create zarr store"):
            group = zarr.open_group(_fsspec_store(url, storage_options, read_only=False), mode="w-", zarr_format=3)
            group.attrs["zckpt"] = _new_manifest()
        return cls(Path(loc.path), group, mode="w-", location=loc)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        mode: Literal["r", "r+", "a"] = "r",
        storage_options: remote.StorageOptions = None,
    ) -> Store:
        if isinstance(path, str) and remote.is_remote(path):
            return cls._open_remote(path, mode, storage_options)
        p = remote.local_path(path)
        if not (p / "zarr.json").is_file():
            raise StoreError("not a zarr store (no zarr.json)", path=p)
        attrs = _group_attributes(p)
        meta = attrs.get("zckpt")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise StoreError("zarr store was not written by zckpt (no zckpt manifest)", path=p)
        if int(meta.get("version", 0)) > VERSION:
            raise StoreError(f"store format version {meta.get('version')} is newer than this zckpt", path=p)
        store = cls(p, None, mode=mode)
        store._manifest = meta
        store._other_attrs = {k: v for k, v in attrs.items() if k != "zckpt"}
        return store

    @classmethod
    def _open_remote(cls, url: str, mode: Literal["r", "r+", "a"], storage_options: remote.StorageOptions) -> Store:
        loc = remote.locate(url, storage_options, StoreError)
        if not remote.isfile(loc.child("zarr.json"), StoreError):
            raise StoreError("not a zarr store (no zarr.json)", path=url)
        from zckpt.io.zarr_local import zarr

        with remote.remote_errors(StoreError, url, "cannot open zarr store"):
            group = zarr.open_group(_fsspec_store(url, storage_options, read_only=mode == "r"), mode=mode,
                                    zarr_format=3)
            meta = group.attrs.get("zckpt")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise StoreError("zarr store was not written by zckpt (no zckpt manifest)", path=url)
        if int(meta.get("version", 0)) > VERSION:
            raise StoreError(f"store format version {meta.get('version')} is newer than this zckpt", path=url)
        return cls(Path(loc.path), group, mode=mode, location=loc)

    def remove(self) -> None:
        """Delete the whole store (an ingest that found bad input leaves nothing behind)."""
        if self.location is None:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            with contextlib.suppress(StoreError):
                remote.remove(self.location, StoreError, recursive=True)

    # --- manifest ------------------------------------------------------------------
    @property
    def manifest(self) -> dict[str, Any]:
        if self._manifest is not None:
            return self._manifest
        meta = self.group.attrs.get("zckpt")
        assert isinstance(meta, dict)
        return meta

    def _update(self, **changes: Any) -> None:
        meta = dict(self.manifest)
        meta.update(changes)
        if self.location is None:
            self._write_manifest(meta)
        else:
            self.group.attrs["zckpt"] = meta
        if "entries" in changes:
            self._entries = None

    def _write_manifest(self, meta: dict[str, Any]) -> None:
        """Write a local store's root ``zarr.json`` (the group, its attributes holding the
        manifest) as compact JSON in one atomic replace. zarr's attribute update copies and
        indents the whole document: with 100 000 entries, seconds per write. The group
        object is reopened when next needed, from this file. A consolidated copy of the
        metadata (``zckpt consolidate``) is dropped: it would no longer match."""
        if self._other_attrs is None:
            self._other_attrs = {k: v for k, v in self.group.attrs.items() if k != "zckpt"}
        doc = {"attributes": {**self._other_attrs, "zckpt": meta}, "zarr_format": 3, "node_type": "group"}
        fileio.write_atomic(self.path / "zarr.json", rank_records.canonical(doc), fsync=False)
        self._manifest = meta
        self._group = None

    def _entry_map(self) -> dict[str, EntryRecord]:
        if self._entries is None:
            entries = {d["name"]: EntryRecord.from_json(d) for d in self.manifest.get("entries", [])}
            where, safe = self.where("zarr.json"), set()  # packed tensors share their array's key
            for e in entries.values():
                if e.kind != "str" and e.key not in safe:  # a key is a path below the store: not out of it
                    safe_paths.check_key(e.key, StoreError, path=where, param=e.name, what="manifest key")
                    safe.add(e.key)
            self._entries = entries
        return self._entries

    def check_links(self) -> None:
        """Refuse, by name, a symbolic link anywhere in a local store's array folders (a
        listing per folder, no ``stat`` per file): for commands such as ``info`` that
        describe a store without reading its chunks, which every read checks anyway."""
        if self._confined is None:
            return
        seen = set()
        for e in self.entries():
            if e.kind != "str" and e.key not in seen:  # packed tensors share their array's folder
                seen.add(e.key)
                safe_paths.refuse_links_below(self._folder(e), StoreError, e.name)

    def _folder(self, e: EntryRecord) -> Path:
        """An array's folder in a local store, checked to be a real folder inside it."""
        assert self._confined is not None
        return self._confined.folder(e.key)

    def entries(self) -> list[EntryRecord]:
        return list(self._entry_map().values())

    def entry(self, name: str) -> EntryRecord:
        e = self._entry_map().get(name)
        if e is None:
            raise StoreError("no such entry in the store", path=self.url, param=name)
        return e

    def specs(self) -> list[TensorSpec]:
        return [e.spec() for e in self.entries()]

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def ingested_ranks(self) -> set[int]:
        """Source ranks whose writes are complete: one progress record each (:mod:`zckpt.store.records`),
        so that parallel ingest workers never write the same key."""
        if self._ingested is None:
            if self.location is None:
                self._ingested = rank_records.local_ranks(self.path)
            else:
                self._ingested = set(self._remote_records(read=False))
        return set(self._ingested)

    def _remote_records(self, *, read: bool) -> dict[int, dict[str, Any]]:
        """Records of a remote store (file objects and format-4 groups); with ``read=False``
        only which ranks have one (the documents are left empty)."""
        assert self.location is not None
        folder = self.location.child(rank_records.FOLDER)
        try:
            present = remote.listdir(folder, StoreError)
        except StoreError:
            return {}
        out: dict[int, dict[str, Any]] = {}
        files: dict[str, tuple[int, int]] = {}
        for name, is_dir in present:
            span = rank_records.ranks_of(name)
            if span is not None and not is_dir:
                files[name] = span
                continue
            got = rank_records.rank_of(name)
            if got is None or got[1] or not is_dir:
                continue
            if not read:
                out[got[0]] = {}
            else:
                from zckpt.io.zarr_local import zarr

                node = self.group[f"{rank_records.FOLDER}/{name}"]
                out[got[0]] = dict(node.attrs) if isinstance(node, zarr.Group) else {}
                self._record_files[got[0]] = f"{rank_records.FOLDER}/{name}/zarr.json"
        if files and read:
            with remote.remote_errors(StoreError, self.url, "cannot read progress records"):
                fetched = folder.fs.cat([folder.child(n).path for n in files])
            by_name = {str(k).rstrip("/").rsplit("/", 1)[-1]: v for k, v in fetched.items()}
            for name in sorted(files):
                got_docs = rank_records.decode_named(by_name.get(name, b""), name,
                                                     self.where(rank_records.FOLDER, name))
                out.update(got_docs)
                self._record_files.update(dict.fromkeys(got_docs, f"{rank_records.FOLDER}/{name}"))
        else:
            out.update({rank: {} for first, last in files.values() for rank in range(first, last + 1)})
        return out

    def define(
        self,
        tensors: Sequence[TensorSpec],
        writers: Mapping[str, Sequence[tuple[int, Box]]],
        chunks: Mapping[str, tuple[int, ...]],
        strings: Mapping[str, str],
        source: Mapping[str, Any],
        compressors: Any = None,
        fingerprint: str | None = None,
        shards: Mapping[str, tuple[int, ...]] | None = None,
        packing: packed.PackPlan | None = None,
    ) -> None:
        """Create every array (no data yet) and write the manifest.

        Uncompressed arrays get their ``zarr.json`` from a template that zarr itself
        rendered for the dtype, with shape, chunks and attributes filled in: creating
        thousands of arrays through zarr's API costs milliseconds each. An array named in
        ``shards`` (inner chunks per shard; local uncompressed stores only) is sharded: each
        shard file is created at its final size with its index, so that writers only fill
        their byte ranges. Tensors ``packing`` places get no array: their bytes live in a
        packed array (:mod:`zckpt.store.packed`) and their manifest entry says where.
        """
        shards = dict(shards or {})
        slots = packing.slots if packing is not None else {}
        if (shards or slots) and (self.location is not None or compressors is not None):
            raise StoreError("sharded and packed arrays are written to local uncompressed stores only", path=self.url)
        records: list[EntryRecord] = []
        pending: list[tuple[str, Awaitable[Any]]] = []
        fast = compressors is None
        docs: dict[str, bytes] = {}
        for folder in ("tensors", "maps"):
            if self.location is None:
                _write_json(self.path / folder, GROUP_DOCUMENT)
            elif fast:
                self.group.require_group(folder)
        for t in tensors:
            if t.kind == "str":
                records.append(EntryRecord(t.name, t.kind, t.ms_type, t.shape, "", strings[t.name], t.stages, t.note))
                continue
            slot = slots.get(t.name)
            if slot is not None:
                records.append(EntryRecord(t.name, t.kind, t.ms_type, t.shape, slot.key, None, t.stages, t.note,
                                           slot.offset, slot.writer))
                continue
            key = encode_key(t.name)
            folder = "tensors" if t.kind == "tensor" else "maps"
            attrs: dict[str, Any] = {
                "name": t.name,
                "ms_dtype": t.ms_type,
                "kind": t.kind,
                "writers": [[r, b.to_json()] for r, b in writers.get(t.name, ())],
                "source_layouts": {str(s): layout_to_json(lay) for s, lay in t.layouts.items()},
                "source_stages": list(t.stages),
            }
            if t.note:
                attrs["note"] = t.note
            if fast and self.location is not None:
                docs[f"{folder}/{key}/zarr.json"] = _array_json(t.ms_type, t.kind, t.shape, chunks[t.name],
                                                                {"zckpt": attrs}).encode("utf-8")
            elif fast:
                _write_array_json(self.path / folder / key, t.ms_type, t.kind, t.shape, chunks[t.name],
                                  {"zckpt": attrs}, shards.get(t.name))
                if t.name in shards:
                    self._preallocate(self.path / folder / key, t, chunks[t.name], shards[t.name])
            else:
                agroup = self.group._async_group  # zarr's async API: create thousands of arrays concurrently
                pending.append((t.name, agroup.create_array(
                f"{folder}/{key}",
                shape=t.shape,
                chunks=chunks[t.name],
                dtype=zarr_type(t.ms_type, t.kind),
                compressors=compressors,
                fill_value=0,
                attributes={"zckpt": attrs},
                config={"write_empty_chunks": True},
                )))
            records.append(EntryRecord(t.name, t.kind, t.ms_type, t.shape, f"{folder}/{key}", None, t.stages, t.note))
            self._writers[t.name] = list(writers.get(t.name, ()))
        if docs and self.location is not None:
            loc = self.location
            with remote.remote_errors(StoreError, self.url, "cannot write array metadata"):
                loc.fs.pipe({loc.child(k).path: v for k, v in docs.items()})  # concurrent puts
        created = _gather([c for _, c in pending])
        for (name, _), node in zip(pending, created, strict=True):
            from zckpt.io.zarr_local import zarr

            self._keep(name, zarr.Array(node))
        for pack in packing.arrays if packing is not None else ():
            where = self.path / pack.key
            _write_array_json(where, pack.ms_type, "tensor", (pack.length,), (pack.chunk,),
                              {"zckpt": {"kind": "packed", "ms_dtype": pack.ms_type}})
            packed.preallocate(where, pack)
        if self.location is None:
            _write_json(self.path / rank_records.FOLDER, rank_records.folder_document())
        else:
            rank_records.define_folder(self.group)
        self._seal_manifest(entries=[r.to_json() for r in records], source=dict(source), fingerprint=fingerprint)
        self._entries = {r.name: r for r in records}  # as the manifest now says: not parsed back

    # --- integrity (zckpt.store.integrity) --------------------------------------------------
    def _seal_manifest(self, **changes: Any) -> None:
        """Write the manifest digest (with ``changes``) in one update of the manifest."""
        meta = dict(self.manifest)
        meta.update(changes)
        seal = integrity.sealed(meta)
        self._update(**changes, integrity=seal)
        self._digested = ({k: meta.get(k) for k in integrity.MANIFEST_KEYS}, seal["manifest"])

    def _known_digest(self) -> str | None:
        """The manifest digest this process computed, while the digested parts of the
        manifest are still those very objects (hashing 100 000 entries again costs a second)."""
        if self._digested is None:
            return None
        parts, digest = self._digested
        return digest if all(self.manifest.get(k) is v for k, v in parts.items()) else None

    def unseal(self) -> None:
        """Mark the store incomplete again, its record digests dropped: some of its source
        ranks are about to be redone. Stores without digests are only unmarked."""
        if integrity.checked(self.manifest):
            self._seal_manifest(complete=False)
        else:
            self._update(complete=False)

    def identity(self) -> str | None:
        """The content identity of the store (:func:`zckpt.store.integrity.identity`): read from
        the manifest when complete, from the progress records otherwise."""
        if self.complete:
            return integrity.identity(self.manifest)
        return integrity.identity(self.manifest, self.progress_records())

    def check_integrity(self) -> None:
        """Refuse (by name) a store whose manifest was never written, was edited since its
        ingest, is marked complete without the sealed digests of its checksum records, or
        whose records lost their checksums or changed since. Once per command: readers call
        it before planning (:func:`zckpt.store.reader.check_coverage`); tasks that read records
        then check only that each rank's checksums are there."""
        if not self._trusted:
            try:
                integrity.check_manifest(self.manifest, self.ingested_ranks(), self.url)
            except StoreError as err:
                named = self._damaged_entry() if "manifest differs" in err.message else None
                if named is None:
                    raise
                raise StoreError(f"{err.message}; {named.message}", path=named.path, param=named.param) from None
            if integrity.checked(self.manifest):  # each record against its sealed digest, once per command
                for rank, attrs in self._progress_attributes():
                    integrity.check_record(self.manifest, rank, attrs, self.record_where(rank))
            self._trusted = True

    def check_arrays(self) -> None:
        """Every array's ``zarr.json`` against its manifest entry and what the format requires
        (which :meth:`chunk_info` checks on first use), for commands that hand the metadata to
        other readers without reading the data (``consolidate``)."""
        for e in self.entries():
            if e.kind != "str" and e.offset is None:
                self.chunk_info(e.name)

    def _damaged_entry(self) -> StoreError | None:
        """Which parameter a manifest that fails its digest got wrong, when its arrays tell:
        an entry whose array disagrees with it, or an array no entry names any more (read
        only on this error path: every array's metadata)."""
        known = set()
        for e in self.entries():
            if e.kind == "str":
                continue
            known.add(e.key)
            try:
                self.array(e.name)
            except StoreError as err:
                return err
        for folder in ("tensors", "maps"):
            try:
                node: Any = self.group[folder]
                keys = sorted(node.array_keys())
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
            for k in keys:
                if f"{folder}/{k}" not in known:
                    attrs: Any = node[k].attrs.get("zckpt") or {}
                    return StoreError("its array is in the store but the manifest lost its entry",
                                      path=self.where(folder, k), param=attrs.get("name"))
        return None

    def progress_records(self) -> dict[int, dict[str, Any]]:
        """Every source rank's progress record (its attributes: bytes, checksum records,
        source identity), as stored."""
        return dict(self._progress_attributes())

    def forget_ranks(self, ranks: Iterable[int]) -> None:
        """Remove the progress records of ``ranks`` (their writes will be redone)."""
        ranks = list(ranks)
        if self.version < rank_records.FILE_VERSION:
            for r in ranks:
                with contextlib.suppress(KeyError):
                    del self.group[f"progress/rank_{r}"]
        elif self.location is None:
            rank_records.forget_local(self.path, ranks)
        else:
            folder = self.location.child(rank_records.FOLDER)
            try:
                names = [n for n, is_dir in remote.listdir(folder, StoreError) if not is_dir]
            except StoreError:
                names = []

            def remove(name: str) -> None:
                with contextlib.suppress(StoreError):
                    remote.remove(folder.child(name), StoreError)

            rank_records.forget(names, ranks, read=lambda n: remote.read_bytes(folder.child(n), StoreError),
                                write=lambda n, data: remote.write_bytes(folder.child(n), data, StoreError),
                                remove=remove, where=lambda n: self.where(rank_records.FOLDER, n))
        self._ingested = None

    @staticmethod
    def _preallocate(folder: Path, t: TensorSpec, chunks: tuple[int, ...], per_shard: tuple[int, ...]) -> None:
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

    def write_many(self, items: Sequence[tuple[str, tuple[slice, ...], np.ndarray]]) -> None:
        """Write several regions concurrently (one event-loop round trip, I/O overlapped)."""
        self.prefetch(name for name, _, _ in items)
        with self._io_errors("cannot write"):
            _gather([self.array(name)._async_array.setitem(sel, data) for name, sel, data in items])

    def read_many(self, items: Sequence[tuple[str, tuple[slice, ...]]]) -> list[np.ndarray]:
        """Read several regions concurrently."""
        self.prefetch(name for name, _ in items)
        with self._io_errors("cannot read"):
            out = _gather([self.array(name)._async_array.getitem(sel) for name, sel in items])
        return [np.asarray(x) for x in out]

    def prefetch(self, names: Iterable[str]) -> None:
        """Remote stores: open every array of ``names`` not opened yet, concurrently (each
        open is a round trip; one after another they dominate small transfers). Local stores
        open arrays on first use, as before."""
        if self.location is None:
            return
        todo = [n for n in dict.fromkeys(names) if n not in self._arrays and self.entry(n).kind != "str"]
        if not todo:
            return
        from zckpt.io.zarr_local import open_array, zarr

        with self._io_errors("cannot open arrays"):
            opened = _gather([open_array(store=self.group.store, path=self.entry(n).key, mode=self._mode,
                                         zarr_format=3) for n in todo])
        for name, node in zip(todo, opened, strict=True):
            self._check_node(name, zarr.Array(node))
            self._keep(name, writing_empty_chunks(zarr.Array(node)))

    def _io_errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Remote stores: network and permission failures become a StoreError naming the URL
        (local stores keep raising OSError as they always did)."""
        if self.location is None:
            return contextlib.nullcontext()
        return remote.remote_errors(StoreError, self.url, what)

    def mark_ingested(self, rank: int, **info: Any) -> None:
        """Write rank ``rank``'s progress record (in one atomic write: a crash can never
        leave a rank marked done without the checksums that prove its chunks). A store of
        format 4 or older being resumed keeps its zarr group records."""
        if self.version < rank_records.FILE_VERSION:
            self.group.create_group(f"progress/rank_{rank}", attributes=dict(info), overwrite=True)
        elif self.location is None:
            rank_records.write(self.path, rank, info)
        else:
            remote.write_bytes(self.location.child(rank_records.FOLDER).child(rank_records.file_name(rank)),
                               rank_records.encode(rank, info), StoreError)
        self._ingested = None

    def mark_ingested_many(self, infos: Mapping[int, Mapping[str, Any]]) -> None:
        """Write the progress records of several ranks (``{rank: info}``, each as
        :meth:`mark_ingested` takes it): in a local store of format 7, ranks in a row share
        one file (:func:`zckpt.store.records.write_many`); elsewhere one record each."""
        if self.location is None and self.version >= rank_records.GROUP_VERSION:
            rank_records.write_many(self.path, infos)
            self._ingested = None
            return
        for rank in sorted(infos):
            self.mark_ingested(rank, **infos[rank])

    def mark_complete(self) -> None:
        problems = self.coverage_problems()
        if problems:
            raise StoreError("store is not complete: " + "; ".join(problems[:10]), path=self.url)
        if not integrity.checked(self.manifest):
            self._update(complete=True)
            return
        self._update(complete=True, integrity=integrity.sealed(self.manifest, self.progress_records(),
                                                               self._known_digest()))

    # --- data ------------------------------------------------------------------------
    def array(self, name: str) -> zarr.Array[Any]:
        cached = self._arrays.get(name)
        if cached is not None:
            return cached
        e = self.entry(name)
        if e.kind == "str":
            raise StoreError("string entries have no array", path=self.url, param=name)
        if e.offset is not None:
            return self._keep(name, self._packed_array(e))
        from zckpt.io.zarr_local import zarr

        try:
            node = writing_empty_chunks(zarr.open_array(store=self.group.store, path=e.key, mode=self._mode))
        except Exception as err:  # zarr raises several types for a missing or broken node
            raise StoreError(f"array {e.key} cannot be opened: {err}", path=self.url, param=name) from None
        self._check_node(name, node)
        return self._keep(name, node)

    def _packed_array(self, e: EntryRecord) -> zarr.Array[Any]:
        """A packed tensor as a zarr array of its own, in memory: its bytes (checked
        against their recorded checksum) under the attributes its array would have had.
        For the occasional reader (``load --param``, replica checks); export and verify
        read the packed bytes directly (:meth:`chunk_at`)."""
        from zckpt.io.zarr_local import zarr

        info = self.chunk_info(e.name)
        assert info.at is not None and info.folder is not None
        self.verify_chunks(e.name, Box.full(e.shape))
        dtype = ms_dtype(e.ms_type).storage
        with safe_paths.open_binary(info.folder / info.at[0], StoreError, e.name) as f:
            raw = os.pread(f.fileno(), info.inner_bytes, info.at[1])
        if len(raw) != info.inner_bytes:
            raise StoreError(f"packed chunk {info.at[0]} ended early: the store is damaged",
                             path=info.folder / info.at[0], param=e.name)
        attrs: dict[str, Any] = {"name": e.name, "ms_dtype": e.ms_type, "kind": e.kind,
                                 "writers": [[r, b.to_json()] for r, b in self.writers(e.name)]}
        node = zarr.create_array(store=zarr.storage.MemoryStore(), shape=e.shape, chunks=e.shape,
                                 dtype=zarr_type(e.ms_type, e.kind), compressors=None, fill_value=0,
                                 attributes={"zckpt": attrs})
        bits_view(node)[...] = np.frombuffer(raw, dtype=dtype).reshape(e.shape)
        return node

    def _check_node(self, name: str, node: zarr.Array[Any]) -> None:
        """An opened array against its manifest entry (:func:`zckpt.store.integrity.check_array`)."""
        e = self.entry(name)
        doc = {"shape": node.shape, "data_type": _data_type_name(node),
               "attributes": {"zckpt": node.attrs.get("zckpt")}}
        integrity.check_array(e.kind, e.ms_type, e.shape, name, doc, self.where(e.key, "zarr.json"))
        integrity.check_codecs(node.metadata.to_dict().get("codecs"), self.where(e.key, "zarr.json"), name)

    def _keep(self, name: str, node: zarr.Array[Any]) -> zarr.Array[Any]:
        """Cache an opened array as zckpt uses it (bf16 as bits), remembering its stored type."""
        self._data_types[name] = _data_type_name(node)
        view = bits_view(node)
        self._arrays[name] = view
        return view

    def data_type(self, name: str) -> str:
        """The Zarr data type an array is stored with: ``"bfloat16"`` for BFloat16 (``"uint16"``
        in stores of format version 1), else the numpy name of its storage (``"float32"``, ...)."""
        if name not in self._data_types:
            self.array(name)
        return self._data_types[name]

    def chunk_info(self, name: str) -> ChunkInfo:
        """Shape, chunk shape and chunk encoding of an array, read from its ``zarr.json``
        alone (opening a zarr array costs a millisecond or more; a store has thousands)."""
        info = self._chunk_info.get(name)
        if info is None and self.entry(name).offset is not None:
            info = self._chunk_info[name] = self._packed_info(self.entry(name))
        if info is None:
            e = self.entry(name)
            folder = self._folder(e) if self.location is None else None
            doc: Any = None
            if folder is not None:
                try:
                    doc = json.loads(safe_paths.read_bytes(folder / "zarr.json", StoreError, e.name))
                except StoreError:
                    raise
                except (OSError, ValueError):
                    doc = None
                if doc is not None:
                    integrity.check_array(e.kind, e.ms_type, e.shape, e.name, doc, self.where(e.key, "zarr.json"))
                    integrity.check_codecs(doc.get("codecs"), self.where(e.key, "zarr.json"), e.name)
            if doc is None and self.location is not None:
                self.prefetch([name])
                doc = self.array(name).metadata.to_dict()  # the zarr.json the open just read
            if doc is None:
                arr = self.array(name)
                doc = {"shape": arr.shape, "chunk_grid": {"configuration": {"chunk_shape": arr.chunks}},
                       "codecs": [], "chunk_key_encoding": {}}
            itemsize = 1 if e.kind != "tensor" else ms_dtype(e.ms_type).storage.itemsize
            info = ChunkInfo.from_json(doc, folder, itemsize)
            self._chunk_info[name] = info
        return info

    def _packed_info(self, e: EntryRecord) -> ChunkInfo:
        """A packed tensor's one chunk: where it lies in its packed array's chunk file."""
        folder, key, at, chunk_bytes = self.packed_place(e)
        itemsize = ms_dtype(e.ms_type).storage.itemsize
        return ChunkInfo(e.shape, e.shape, True, ".", folder, None, itemsize, (key, at, chunk_bytes))

    def packed_place(self, e: EntryRecord) -> tuple[Path, str, int, int]:
        """``(packed array folder, chunk key, byte offset, chunk file bytes)`` of a packed
        tensor, checked to lie inside one chunk of the packed array of its type (without a
        :class:`ChunkInfo` each: ingest places 100 000s of them)."""
        got = self._packs.get(e.key)
        if got is None or got[3] != e.ms_type or e.offset is None or e.offset < 0:
            if self.location is not None or e.key != packed.pack_key(e.ms_type) or e.offset is None or e.offset < 0:
                raise StoreError(f"manifest places a packed tensor at {e.key!r}, not in the packed array of its "
                                 "type", path=self.url, param=e.name)
            folder = self._folder(e)
            got = self._packs[e.key] = (packed.read_chunk_length(folder), folder,
                                        ms_dtype(e.ms_type).storage.itemsize, e.ms_type)
        chunk, folder, itemsize, _ = got
        key, at = packed.locate(e.offset, chunk, itemsize)
        if at + math.prod(e.shape) * itemsize > chunk * itemsize:
            raise StoreError(f"manifest places a packed tensor across chunk {key}'s end", path=self.url, param=e.name)
        return folder, key, at, chunk * itemsize

    def assume_layout(self, name: str, chunks: tuple[int, ...], per_shard: tuple[int, ...] | None) -> None:
        """Take an array's chunk layout from the ingest plan instead of its ``zarr.json``
        (an ingest task writes into every array; reading each one's metadata per source
        rank costs more than the data at hundreds of ranks). Only for local stores of this
        format, whose arrays ingest defines raw with ``.``-separated keys; others are read."""
        if self.location is not None or name in self._chunk_info or self.version not in SHARDED_LAYOUTS:
            return
        e = self.entry(name)
        if e.kind != "tensor" or not e.shape or e.offset is not None:
            return
        self._chunk_info[name] = ChunkInfo(e.shape, tuple(chunks), True, ".", self._folder(e), per_shard,
                                           ms_dtype(e.ms_type).storage.itemsize)

    def raw_chunk_file(self, name: str, coords: Sequence[int]) -> Path | None:
        """Path of a chunk whose stored bytes are the raw C-order little-endian values
        (uncompressed, bytes codec only), or ``None`` when chunks are encoded otherwise.
        In a sharded array: the shard file holding the inner chunk (see :meth:`chunk_at`).

        Such chunks can be filled from and copied to checkpoint files without decoding.
        """
        at = self.chunk_at(name, coords)
        return None if at is None else at[1]

    def chunk_at(self, name: str, coords: Sequence[int]) -> tuple[str, Path, int, int] | None:
        """``(file key, file, byte offset, file size)`` of a raw (inner) chunk in a local
        store, or ``None`` when chunks are encoded otherwise or the store is remote."""
        if self.location is not None:
            return None
        info = self.chunk_info(name)
        if not info.raw or info.folder is None:
            return None
        key, offset = info.locate(coords)
        got = self._files.get((name, key))
        if got is None:  # a file's path and size follow from its key: found once, not per chunk
            got = self._files[(name, key)] = (self._chunk_path(info, key), info.file_bytes(coords))
        return key, got[0], offset, got[1]

    def chunk_files(self, name: str, box: Box) -> list[tuple[str, Path]]:
        """``(file key, file)`` of every chunk (or shard) file ``box`` touches (raw local
        stores; else empty)."""
        info = self.chunk_info(name)
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

    def _chunk_path(self, info: ChunkInfo, key: str) -> Path:
        """A chunk file's path; chunk keys with the ``/`` separator have folders of their own,
        checked (once each) like the array's."""
        assert info.folder is not None
        if "/" in key and self._confined is not None:
            return self._confined.file(f"{info.folder.relative_to(self.path).as_posix()}/{key}")
        return info.folder / key

    def chunk_keys(self, name: str, box: Box) -> list[str]:
        """Keys of every chunk ``box`` touches when chunks are stored raw (local or remote)."""
        info = self.chunk_info(name)
        if not info.raw:
            return []
        if box.ndim == 0:
            return [info.chunk_key(())]
        return [info.chunk_key(tuple(a // c for a, c in zip(t.start, info.chunks, strict=True)))
                for t in tiles(box, info.chunks)]

    def checksums(self) -> dict[str, dict[str, ChunkSums]]:
        """Checksums of every chunk, as recorded by the source rank that wrote it: per block
        (``crc32c_blocks``), or one per chunk in stores of version 2 and older. In sharded
        arrays, one record per run a rank wrote, keyed ``<shard key>@<offset>`` (its
        :attr:`~zckpt.io.checksums.ChunkSums.origin` and ``length`` say where it lies)."""
        if self._crcs is None:
            crcs = {name: dict(per) for name, per in self._chunk_records().items()}
            for name, key in list(self._run_texts()):
                crcs.setdefault(name, {}).update(self.records_in(name, key))
            self._crcs = crcs
        return self._crcs

    def _chunk_records(self) -> dict[str, dict[str, ChunkSums]]:
        """The records of unsharded chunks (the run records are kept as text until asked)."""
        if self._plain is None:
            plain: dict[str, dict[str, ChunkSums]] = {}
            texts: dict[tuple[str, str], list[str]] = {}
            for rank, attrs in self._progress_attributes():
                integrity.check_record(self.manifest, rank, attrs, self.record_where(rank),
                                       digest=False)  # digests: once per command, check_integrity
                blocks: Any = attrs.get("crc32c_blocks", {})
                if blocks:
                    size = int(blocks["block_bytes"])
                    for name, per in blocks.get("chunks", {}).items():
                        plain.setdefault(name, {}).update(
                            {k: ChunkSums("crc32c", tuple(int(x) for x in v), size) for k, v in per.items()})
                    for name, shards in blocks.get("runs", {}).items():
                        for key, text in shards.items():
                            texts.setdefault((name, key), []).append(f"{size} {text}")
                    for pack, chunks in blocks.get("packed", {}).items():  # runs of packed tensors
                        for key, text in chunks.items():
                            texts.setdefault((packed.record_owner(pack), key), []).append(f"{size} {text}")
                for algo in ("crc32c", "crc32"):
                    recorded: Any = attrs.get(algo, {})
                    for name, per in recorded.items():
                        plain.setdefault(name, {}).update({k: ChunkSums(algo, (int(v),)) for k, v in per.items()})
            self._plain, self._texts = plain, texts
        return self._plain

    def _run_texts(self) -> dict[tuple[str, str], list[str]]:
        self._chunk_records()
        assert self._texts is not None
        return self._texts

    def _progress_attributes(self) -> list[tuple[int, dict[str, Any]]]:
        """``(rank, attributes)`` of every progress record, in rank order: record files and
        format-4 groups, read as plain JSON on a local disk (opening hundreds of groups
        through zarr costs more than parsing them)."""
        if self._confined is not None:
            self._confined.folder(rank_records.FOLDER)
        found = (rank_records.read_local(self.path, self._record_files) if self.location is None
                 else self._remote_records(read=True))
        return [(r, found[r]) for r in sorted(found)]

    def record_where(self, rank: int) -> str:
        """The file holding source rank ``rank``'s progress record, as messages name it (a
        range file, a format-4 group's ``zarr.json``, or the rank's own file)."""
        return self.where(*self._record_files.get(rank, f"{rank_records.FOLDER}/{rank_records.file_name(rank)}")
                          .split("/"))

    def record_owner(self, name: str) -> str:
        """Under which name the checksum records of entry ``name`` are filed: a packed
        tensor's are its packed array's runs (:func:`zckpt.store.packed.record_owner`), shared with
        the tensors written together, unless its writer recorded one run per tensor. Blocks
        checked once per command are remembered under this name."""
        e = self._entry_map().get(name)
        if e is None or e.offset is None:
            return name
        owner = packed.record_owner(e.key)
        if self._owners is None:
            self._owners = {n for n, _ in self._run_texts()}
        # a tensor with a record of its own (a rank ingested by the first format-6 zckpt) keeps it
        return owner if owner in self._owners and name not in self._owners else name

    def records_in(self, name: str, file_key: str) -> list[tuple[str, ChunkSums]]:
        """``(record key, sums)`` of every checksum record of one chunk or shard file, in
        file order (a chunk file has one record covering it, a shard one per run)."""
        name = self.record_owner(name)
        per = self._chunk_records().get(name, {})
        if file_key in per:
            return [(file_key, per[file_key])]
        return self.records_over(name, file_key, 0, 2**63)

    def records_over(self, name: str, file_key: str, start: int, stop: int) -> list[tuple[str, ChunkSums]]:
        """The records of :meth:`records_in` that bytes ``[start, stop)`` of the file meet.
        A shard's run records stay text until a range needs them: each rank's text is placed
        by its first and last run (found without decoding it), and only the texts a range
        can meet are decoded, so a task reading a part of a shard written by hundreds of
        ranks decodes the few runs it reads."""
        name = self.record_owner(name)
        per = self._chunk_records().get(name, {})
        if file_key in per:
            return [(file_key, per[file_key])]
        index = self._text_index(name, file_key)
        if index is None:
            return []
        firsts, reach, texts = index
        out: list[tuple[str, ChunkSums]] = []
        k = bisect.bisect_left(firsts, stop) - 1
        while k >= 0 and reach[k] > start:
            for rec in self._decoded(name, file_key, k, texts[k]):
                if rec[1].covers(start, stop) is not None:
                    out.append(rec)
            k -= 1
        out.sort(key=lambda kv: kv[1].origin)
        return out

    def _text_index(self, name: str, file_key: str) -> tuple[list[int], list[int], list[str]] | None:
        """The run texts of a shard sorted by first offset, with the furthest end reached by
        any text up to each one (so a backward scan from a range's end can stop)."""
        key = (name, file_key)
        got = self._index.get(key)
        if got is None:
            texts = self._run_texts().get(key)
            if not texts:
                return None
            placed = []
            for text in texts:
                body = text.partition(" ")[2]
                first = body[: body.index(":")]
                o, n, _ = body.rpartition(" ")[2].split(":")
                placed.append((int(first), int(o) + int(n), text))
            placed.sort(key=lambda x: x[0])
            reach, far = [], 0
            for _, end, _ in placed:
                far = max(far, end)
                reach.append(far)
            got = self._index[key] = ([p[0] for p in placed], reach, [p[2] for p in placed])
        return got

    def _decoded(self, name: str, file_key: str, k: int, text: str) -> list[tuple[str, ChunkSums]]:
        got = self._records.get((name, file_key, k))
        if got is None:
            size, _, body = text.partition(" ")
            got = self._records[(name, file_key, k)] = [
                (f"{file_key}@{o}", ChunkSums("crc32c", v, int(size), o, n)) for o, n, v in decode_runs(body)]
        return got

    def verify_chunks(self, name: str, box: Box, done: Checked | None = None) -> int:
        """Check every recorded block of every chunk ``box`` touches; raise naming parameter
        and chunk. Returns the bytes checked. ``done`` (blocks already checked) avoids
        re-reading a chunk, and receives the blocks checked here."""
        if self.location is not None:
            return self._verify_remote_chunks(name, box, self.checksums().get(name, {}), done)
        checked = 0
        buffer: bytearray | None = None
        owner = self.record_owner(name)
        info = self.chunk_info(name)
        files = self.chunk_files(name, box) if info.at is None else [self._packed_file(info)]
        for file_key, path in files:
            for key, want in self._records_of(name, file_key):
                if _all_checked(done, owner, key, want):
                    continue
                buffer = buffer if buffer is not None else bytearray(1024 * 1024)
                try:
                    got, size = file_sums(path, want.block_bytes, want.algo, buffer, want.origin, want.length)
                except FileNotFoundError:
                    raise StoreError("chunk file is missing: the store is damaged", path=path, param=name) from None
                if done is not None:  # a damaged run is reported once, not for each tensor it holds
                    done.update((owner, key, i) for i in range(len(want.values)))
                self._raise_on(want.compare(got, 0, want.length if want.length is not None else size, whole=True),
                               file_key, str(path), name, want)
                checked += size
        return checked

    def _packed_file(self, info: ChunkInfo) -> tuple[str, Path]:
        """``(chunk key, file)`` of the packed chunk a packed tensor's :class:`ChunkInfo`
        places it in (one path per chunk file, not one per tensor)."""
        assert info.at is not None and info.folder is not None
        got = self._pack_files.get((info.folder, info.at[0]))
        if got is None:
            got = self._pack_files[(info.folder, info.at[0])] = info.folder / info.at[0]
        return info.at[0], got

    def _records_of(self, name: str, file_key: str) -> list[tuple[str, ChunkSums]]:
        """The records of a chunk file that hold ``name``'s bytes: a packed tensor's run
        only (its packed chunk holds thousands of others), else all of them."""
        info = self.chunk_info(name)
        if info.at is not None:
            return self.records_over(name, file_key, info.at[1], info.at[1] + info.inner_bytes)
        return self.records_in(name, file_key)

    @staticmethod
    def _raise_on(bad: Mismatch | None, key: str, where: str, name: str, want: ChunkSums | None = None) -> None:
        if bad is not None:
            place = want.where() if want is not None else ""
            raise StoreError(f"chunk {key} fails its checksum ({place}{bad}): the store is damaged", path=where,
                             param=name)

    def _verify_remote_chunks(
        self, name: str, box: Box, expected: Mapping[str, ChunkSums], done: Checked | None
    ) -> int:
        """:meth:`verify_chunks` on a remote store: each chunk's stored bytes are fetched through
        zarr's store API, a few at a time (concurrent requests, at most ~64 MiB in flight)."""
        from zckpt.io.zarr_local import default_buffer_prototype

        info = self.chunk_info(name)
        chunk_bytes = max(1, math.prod(info.chunks) * ms_dtype(self.entry(name).ms_type).storage.itemsize)
        per_batch = max(1, (64 * 1024 * 1024) // chunk_bytes)
        todo = [k for k in self.chunk_keys(name, box)
                if k in expected and not _all_checked(done, name, k, expected[k])]
        prefix = self.entry(name).key
        checked = 0
        for i in range(0, len(todo), per_batch):
            keys = todo[i : i + per_batch]
            proto = default_buffer_prototype()
            with self._io_errors("cannot read chunks"):
                bufs = _gather([self.group.store.get(f"{prefix}/{k}", prototype=proto) for k in keys])
            for key, buf in zip(keys, bufs, strict=True):
                where = f"{self.url.rstrip('/')}/{prefix}/{key}"
                if buf is None:
                    raise StoreError("chunk is missing: the store is damaged", path=where, param=name)
                data = buf.as_numpy_array()
                want = expected[key]
                self._raise_on(want.check_whole(data), key, where, name)
                checked += int(data.nbytes)
                if done is not None:
                    done.update((name, key, i) for i in range(len(want.values)))
        return checked

    def writers(self, name: str) -> list[tuple[int, Box]]:
        e = self.entry(name)
        if e.offset is not None:
            return [(int(e.writer or 0), Box.full(e.shape))]
        if name not in self._writers:
            meta: Any = self.array(name).attrs.get("zckpt", {})
            self._writers[name] = [(int(r), Box.from_json(b)) for r, b in meta.get("writers", [])]
        return self._writers[name]

    def missing_in(self, name: str, box: Box, done: Set[int] | None = None) -> list[int]:
        """Source ranks whose region of ``box`` is not in the store yet ([-1] = nobody has it);
        ``done``: the ranks ingested, when the caller has them."""
        done = self.ingested_ranks() if done is None else done
        covered = 0
        missing: list[int] = []
        for r, b in self.writers(name):
            part = b.overlap(box) if box.ndim else b.size
            if box.ndim and not part:
                continue
            if r in done:
                covered += part
            else:
                missing.append(r)
        if not missing and covered < box.size:
            return [-1]
        return missing

    def coverage_problems(self, names: Iterable[str] | None = None) -> list[str]:
        problems = []
        known, done = self._entry_map(), self.ingested_ranks()
        # only the entries asked for: verify asks entry by entry, 100 000s of them
        for e in known.values() if names is None else [known[n] for n in dict.fromkeys(names) if n in known]:
            if e.kind == "str" or (e.writer is not None and e.writer in done):  # a packed tensor: one writer
                continue
            miss = self.missing_in(e.name, Box.full(e.shape), done)
            if miss == [-1]:
                problems.append(f"{e.name}: part of the tensor is held by no source rank")
            elif miss:
                problems.append(f"{e.name}: not yet ingested from source rank(s) {miss}")
        return problems
