"""Readers of source shards in object storage, read by byte range (no local copy).

The local readers map their file and walk it; these walk the same bytes through
:class:`~zckpt.io.ranged.BlockBytes` (a ``.ckpt`` header walk touches each ``Value``'s framing,
a few blocks of it, and steps over the payloads; a safetensors file its 8-byte length and its
header) and fetch payload bytes only when a tensor, rows of it or a string is asked for, the
segments of one request together (:class:`~zckpt.io.ranged.RangedObject`: coalesced, in
parallel, retried). They are the local readers with another :meth:`_span`: everything else
(the index, the checks, rows and blocks) is shared, so both accept and refuse the same files.

A remote shard's CRC is not checked: MindSpore's checksum covers every byte, and fetching
every byte of a shard to check it is what range reads avoid.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import CheckpointFormatError, SourceError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.entries import EntryInfo, Segment
from zckpt.formats.safetensors import SafetensorsReader
from zckpt.formats.shard_reader import INDEX_SUFFIX, SafetensorsSetReader
from zckpt.io import remote
from zckpt.io.ranged import BlockBytes, ObjectPath, RangedObject


class RemoteShard:
    """The remote half shared by both readers: the object, its blocks, fetched spans."""

    url: str
    path: Path
    entries: dict[str, EntryInfo]
    _obj: RangedObject
    _buf: Any
    _map: Any

    def _attach(self, obj: RangedObject) -> int:
        self._obj = obj
        self.url = obj.url
        self.path = ObjectPath(obj.url)
        self._map = None
        self._buf = BlockBytes(obj)
        return obj.size

    def _fail(self, message: str, param: str | None = None) -> CheckpointFormatError:
        return CheckpointFormatError(message, path=self.url, param=param)

    def _span(self, offset: int, length: int) -> memoryview | bytes:
        return self._spans([(offset, length)])[0]

    def read_spans(self, ranges: list[tuple[int, int]]) -> list[memoryview | bytes]:
        """The bytes of each ``(offset, length)`` of the object, fetched together."""
        return self._spans(ranges)

    def _spans(self, ranges: list[tuple[int, int]]) -> list[memoryview | bytes]:
        held = [self._buf.held(o, n) for o, n in ranges]
        missing = [r for r, h in zip(ranges, held, strict=True) if h is None]
        fetched = iter(self._obj.read_many(missing) if missing else [])
        return [h if h is not None else next(fetched) for h in held]

    def close(self) -> None:
        self._obj.close()

    def release_pages(self) -> None:
        """Nothing mapped: fetched bytes go with the arrays made of them."""

    def _release_range(self, start: int, stop: int) -> None:
        """Nothing mapped (see :meth:`release_pages`)."""

    def fileno(self) -> int:
        raise SourceError("a remote shard has no local file (its ranges are read through memory)", path=self.url)

    def row_bytes_range(self, name: str, r0: int, r1: int) -> tuple[int, int] | None:
        """``None``: no file to copy from, the rows are read through memory."""
        return None

    @property
    def fetched_bytes(self) -> int:
        return self._obj.fetched_bytes

    def read_region(self, name: str, start: tuple[int, ...], stop: tuple[int, ...]) -> np.ndarray:
        """The box ``[start, stop)`` (the shard's own coordinates) of tensor ``name``: only its
        C-order runs are fetched (together: coalesced, in parallel), not the rows around them."""
        e = self.entries.get(name)
        if e is None or e.kind != "tensor":
            raise self._fail("no such tensor in the checkpoint", name)
        dt = ms_dtype(e.ms_type).storage
        shape = tuple(b - a for a, b in zip(start, stop, strict=True))
        runs = box_runs(e.shape, start, stop, dt.itemsize)
        out = np.empty(shape, dtype=dt)
        flat = out.reshape(-1).view(np.uint8)
        spans = [sp for off, n in runs for sp in _file_spans(e.segments, off, n)]
        pos = 0
        for (_, n), got in zip(spans, self._spans(spans), strict=True):
            flat[pos : pos + n] = np.frombuffer(got, np.uint8)
            pos += n
        return out


class RemoteCkptReader(RemoteShard, CkptReader):
    """A remote ``.ckpt`` shard (see the module doc)."""

    def __init__(self, obj: RangedObject, *, sparse: bool = False) -> None:
        self._pending = obj
        super().__init__(obj.url, verify_crc=False, sparse=sparse)

    def _map_file(self, path: str | os.PathLike[str]) -> int:
        return self._attach(self._pending)

    @classmethod
    def indexed_object(cls, obj: RangedObject, entries: Mapping[str, EntryInfo]) -> RemoteCkptReader:
        """A reader over an index parsed before (not walked again)."""
        self = cls.__new__(cls)
        self._adopt(self._attach(obj), entries)
        return self


class RemoteSafetensorsReader(RemoteShard, SafetensorsReader):
    """A remote ``.safetensors`` shard (see the module doc)."""

    def __init__(self, obj: RangedObject) -> None:
        self._pending = obj
        super().__init__(obj.url, verify_crc=False)

    def _map_file(self, path: str | os.PathLike[str]) -> int:
        return self._attach(self._pending)


class RemoteSafetensorsSetReader(SafetensorsSetReader):
    """A remote split safetensors rank: its index read whole (a small JSON), its parts by range."""

    def __init__(self, url: str, storage_options: remote.StorageOptions) -> None:
        self.url = url
        self._loc = remote.locate(url, storage_options, SourceError)
        super().__init__(ObjectPath(url), verify_crc=False)

    def _index_text(self) -> str:
        return remote.read_bytes(self._loc, SourceError).decode("utf-8")

    def _open_part(self, fname: str, verify_crc: bool) -> SafetensorsReader:
        return RemoteSafetensorsReader(RangedObject(self._loc.sibling(fname), SourceError))


MAX_RUNS = 1 << 16
"""A region cut in more runs than this is read as whole rows (fewer, longer requests)."""


def box_runs(shape: tuple[int, ...], start: tuple[int, ...], stop: tuple[int, ...],
             itemsize: int) -> list[tuple[int, int]]:
    """``(byte offset, length)`` of the C-order runs of the box ``[start, stop)`` of an array of
    ``shape``, in order (one per index of the dimensions before the last one the box cuts);
    whole rows of the box's first dimension when that would be more than :data:`MAX_RUNS`."""
    if not shape:
        return [(0, itemsize)]
    if any(b <= a for a, b in zip(start, stop, strict=True)):
        return []
    cut = max((d for d in range(len(shape)) if (start[d], stop[d]) != (0, shape[d])), default=0)
    inner = math.prod(shape[cut + 1:])
    run = (stop[cut] - start[cut]) * inner * itemsize
    outer = [range(start[d], stop[d]) for d in range(cut)]
    if math.prod(len(r) for r in outer) > MAX_RUNS:
        row = math.prod(shape[1:]) * itemsize
        return [(start[0] * row, (stop[0] - start[0]) * row)]
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    base = start[cut] * strides[cut]
    return [((base + sum(i * st for i, st in zip(idx, strides, strict=False))) * itemsize, run)
            for idx in itertools.product(*outer)]


def _file_spans(segments: tuple[Segment, ...], offset: int, length: int) -> list[tuple[int, int]]:
    """File ranges of the logical payload bytes ``[offset, offset + length)`` of an entry."""
    if len(segments) == 1:
        return [(segments[0].offset + offset, length)]
    out, pos, stop = [], 0, offset + length
    for seg in segments:
        lo, hi = max(offset, pos), min(stop, pos + seg.length)
        if lo < hi:
            out.append((seg.offset + lo - pos, hi - lo))
        pos += seg.length
    return out


def open_remote(url: str, storage_options: remote.StorageOptions, *,
                index: Mapping[str, EntryInfo] | None = None, sparse: bool = False) -> CkptReader:
    """The reader of a remote ``.ckpt``, ``.safetensors`` or split safetensors rank, by its
    name (by its first bytes when the name says neither); ``index``: its entries as planning
    parsed them (a ``.ckpt`` is not walked again)."""
    if url.endswith(INDEX_SUFFIX):
        return RemoteSafetensorsSetReader(url, storage_options)
    obj = RangedObject(remote.locate(url, storage_options, SourceError), SourceError)
    try:
        if _is_safetensors(url, obj):
            return RemoteSafetensorsReader(obj)
        if index is not None:
            return RemoteCkptReader.indexed_object(obj, index)
        return RemoteCkptReader(obj, sparse=sparse)
    except BaseException:
        obj.close()
        raise


def _is_safetensors(url: str, obj: RangedObject) -> bool:
    """As :func:`zckpt.formats.opener._is_safetensors`, on the object's first bytes."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    if name.endswith((".safetensors", ".ckpt")):
        return name.endswith(".safetensors")
    if obj.size < 9:
        return False
    head = obj.read(0, 9)
    return head[8:9] == b"{" and int.from_bytes(head[:8], "little") < obj.size
