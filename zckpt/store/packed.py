"""Small tensors packed together: one byte range each in one array per data type.

A model's tail of biases, norms and scalars can be 100 000 tensors of a few hundred bytes:
one array each made one ``zarr.json`` and one chunk file per tensor (1.26 GB of disk for 84 MB
of values, and minutes of metadata work). A local store of format 5 instead packs every
small tensor that one source rank holds whole (an unsplit tensor, :func:`plan_packing`) into
``packed/<type>``, a 1-D Zarr array of that tensor's data type, at an element offset the
manifest records. Offsets follow from the plan alone (rank by rank, in file order, never
across a chunk border), so the chunk files are created at their final size when the store
is defined and each source rank then writes its tensors' byte ranges: one writer per byte
range, no read-modify-write.

Checksums: each write gathers the tensors that follow each other in a chunk file (up to
:data:`WRITE_BYTES`) and records the run it wrote, per block, as the shard runs of format 4
do, in the progress record's ``packed`` section (``{packed array key: {chunk key: runs}}``):
every byte of every packed tensor is covered, and 100 000 tensors make a few dozen records
instead of 100 000. A reader checks the blocks a tensor's bytes fall in (once per block per
command). Stores whose ingest recorded one run per tensor, under the tensor's name (the
first zckpt of format 6), are read as they are.

Tensors split over several source ranks keep an array of their own (each rank writes its
own chunk there), as do remote stores (object storage cannot write byte ranges).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import StoreError
from zckpt.core.layout import Box
from zckpt.io import safe_paths
from zckpt.io.checksums import block_sums
from zckpt.io.fileio import allocate, disk_full_named, write_at

PACK_BYTES = 64 * 1024
"""Default largest tensor packed (``IngestOptions.pack_bytes``)."""

PACK_COUNT = 1024
"""Default number of small tensors from which they are packed (``IngestOptions.pack_count``):
below it, an array each costs little and every tensor stays a Zarr array of its own."""

FOLDER = "packed"

WRITE_BYTES = 8 * 1024 * 1024
"""Consecutive packed tensors are gathered into one ``pwrite`` of at most this many bytes."""


def pack_key(ms_type: str) -> str:
    """The store key of the packed array holding tensors of ``ms_type`` (``packed/float32``)."""
    return f"{FOLDER}/{ms_type.lower()}"


@dataclass(frozen=True)
class Slot:
    """Where one packed tensor lives: its array, element offset and the rank that writes it."""

    key: str
    offset: int
    writer: int


@dataclass(frozen=True)
class PackedArray:
    """One packed array: ``length`` elements of ``ms_type`` in chunks of ``chunk`` elements."""

    key: str
    ms_type: str
    length: int
    chunk: int

    def to_json(self) -> list[Any]:
        return [self.key, self.ms_type, self.length, self.chunk]


@dataclass(frozen=True)
class PackPlan:
    """Which tensors are packed, where, and the arrays that hold them."""

    arrays: tuple[PackedArray, ...]
    slots: Mapping[str, Slot]
    rule: tuple[int, int, int] = (0, 0, 0)
    """``(limit, chunk_bytes, count)`` that :func:`plan_packing` placed them with."""

    def to_json(self) -> dict[str, Any]:
        """For the ingest fingerprint: the placement is a pure function of the tensors and
        writers (fingerprinted apart) and of this rule, so the rule and the arrays stand for
        the 100 000s of slots."""
        return {"placement": 1, "rule": list(self.rule), "arrays": [a.to_json() for a in self.arrays]}


class _Tensor(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def ms_type(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


def plan_packing(
    tensors: Sequence[_Tensor], writers: Mapping[str, Sequence[tuple[int, Box]]], limit: int, chunk_bytes: int,
    count: int = PACK_COUNT,
) -> PackPlan:
    """Pack every non-empty tensor of at most ``limit`` bytes that one source rank writes
    whole, when there are at least ``count`` of them (else none). Per data type, tensors
    are placed rank by rank in the given (file) order, each at the next free element; one
    that would cross a chunk border starts the next chunk.
    A chunk holds ``chunk_bytes`` (at least one tensor of ``limit`` bytes); a packed array
    that fits one chunk has a chunk exactly its length."""
    picked: dict[str, list[tuple[int, int, str, int]]] = {}
    itemsizes: dict[str, int] = {}
    for order, t in enumerate(tensors):
        ws = writers.get(t.name, ())
        if t.kind != "tensor" or len(ws) != 1 or not _whole(ws[0][1], t.shape):
            continue
        size = math.prod(t.shape)
        itemsize = itemsizes.get(t.ms_type) or itemsizes.setdefault(t.ms_type, ms_dtype(t.ms_type).storage.itemsize)
        if size == 0 or size * itemsize > limit:
            continue
        picked.setdefault(t.ms_type, []).append((ws[0][0], order, t.name, size))
    arrays: list[PackedArray] = []
    slots: dict[str, Slot] = {}
    rule = (limit, chunk_bytes, count)
    if sum(len(v) for v in picked.values()) < max(1, count):
        return PackPlan((), {}, rule)
    for ms_type in sorted(picked):
        itemsize = ms_dtype(ms_type).storage.itemsize
        chunk = max(1, chunk_bytes // itemsize, -(-limit // itemsize))
        key = pack_key(ms_type)
        at = 0
        for rank, _, name, size in sorted(picked[ms_type]):
            if at // chunk != (at + size - 1) // chunk:
                at = -(-at // chunk) * chunk
            slots[name] = Slot(key, at, rank)
            at += size
        arrays.append(PackedArray(key, ms_type, at, min(chunk, at)))
    return PackPlan(tuple(arrays), slots, rule)


def _whole(box: Box, shape: tuple[int, ...]) -> bool:
    return box.stop == shape and not any(box.start)


def chunk_files(array: PackedArray) -> list[tuple[str, int]]:
    """``(chunk key, bytes)`` of every chunk file of a packed array (all full size, as Zarr
    stores the edge chunk too)."""
    nbytes = array.chunk * ms_dtype(array.ms_type).storage.itemsize
    return [(f"c.{i}", nbytes) for i in range(-(-array.length // array.chunk))]


def preallocate(folder: Path, array: PackedArray) -> None:
    """Create every chunk file of ``array`` at its final size, its blocks reserved where the
    filesystem can (:func:`zckpt.io.fileio.allocate`; the gaps left at chunk ends read as the
    fill value 0)."""
    for key, nbytes in chunk_files(array):
        fd = safe_paths.open_write(folder / key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, StoreError)
        try:
            with disk_full_named(folder / key):
                if not allocate(fd, nbytes, folder / key):
                    os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)


def locate(offset: int, chunk: int, itemsize: int) -> tuple[str, int]:
    """``(chunk key, byte offset)`` of element ``offset`` of a packed array."""
    return f"c.{offset // chunk}", (offset % chunk) * itemsize


def read_chunk_length(folder: Path) -> int:
    """The chunk length (elements) recorded in a packed array's ``zarr.json``."""
    try:
        doc = json.loads(safe_paths.read_bytes(folder / "zarr.json", StoreError))
        (chunk,) = doc["chunk_grid"]["configuration"]["chunk_shape"]
        return int(chunk)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise StoreError(f"packed array metadata cannot be read ({err}): the store is damaged",
                         path=folder / "zarr.json") from None


class _Source(Protocol):
    def array(self, name: str) -> np.ndarray: ...
    def release_pages(self) -> None: ...


Target = tuple[str, str, Path, int, int]
"""``(tensor name, chunk key, chunk file, byte offset, bytes)`` of a packed tensor to write."""

Written = tuple[str, str, int, int, list[int]]
"""``(packed array key, chunk key, byte offset, bytes, block sums)``: one run record."""


def record_owner(key: str) -> str:
    """The name a store reader files the run records of packed array ``key`` under, beside
    the tensors' own records (a NUL no checkpoint name holds keeps the two apart)."""
    return f"\x00{key}"


def write_tensors(source: _Source, targets: Iterable[Target], block_bytes: int) -> list[Written]:
    """Copy packed tensors from a source file into their chunk files, in file and offset
    order: tensors that follow each other in one file are gathered into one write of at most
    :data:`WRITE_BYTES`, whose blocks are summed from the bytes written (one run record)."""
    out: list[Written] = []
    pending = bytearray()
    start = 0
    path: Path | None = None
    chunk = ""
    fds: dict[Path, int] = {}

    def flush() -> None:
        if pending and path is not None:
            write_at(fds[path], memoryview(pending), start)
            out.append((f"{FOLDER}/{path.parent.name}", chunk, start, len(pending), block_sums(pending, block_bytes)))
        pending.clear()
        source.release_pages()

    try:
        for name, key, file, offset, nbytes in sorted(targets, key=lambda t: (str(t[2]), t[3])):
            data = np.ascontiguousarray(source.array(name)).reshape(-1).view(np.uint8)
            if data.size != nbytes:
                raise StoreError(f"holds {data.size} bytes, its packed place {nbytes}", path=file, param=name)
            if (file is not path and file != path) or offset != start + len(pending) \
                    or len(pending) + nbytes > WRITE_BYTES:
                flush()
                path, start, chunk = file, offset, key
                if file not in fds:
                    fds[file] = _open(file)
            pending += data.data
        flush()
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _open(path: Path) -> int:
    try:
        return safe_paths.open_write(path, os.O_WRONLY, StoreError)
    except FileNotFoundError:
        raise StoreError("packed chunk file is missing: the store is damaged", path=path) from None
