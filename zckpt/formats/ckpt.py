"""Streaming codec for MindSpore ``.ckpt`` files.

Reading maps the file and indexes it: for every entry the reader records its MindSpore
type, dims and where its payload bytes lie, so tensors come out as numpy views of the
mapping (zero copy) and only the pages actually used are read. A parameter that MindSpore
split over several consecutive ``Value`` messages of the same tag is presented as one
entry with several payload segments.

Writing streams entry by entry (and block by block inside an entry) to a temporary name
that is renamed when the file is complete, so a crash never leaves a file that looks
finished.
"""

from __future__ import annotations

import binascii
import contextlib
import math
import mmap
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

from zckpt.dtypes import STRING_TYPE, MsDtype, ms_dtype
from zckpt.errors import CheckpointFormatError
from zckpt.formats import wire

CRC_MAGIC = b"crc_num"
CRC_TRAILER_LEN = len(CRC_MAGIC) + 10
MS_SLICE_BYTES = 512 * 1024 * 1024
"""MindSpore writes a tensor larger than this as several Values (np.array_split on axis 0)."""


@dataclass(frozen=True)
class Segment:
    """Payload bytes of one ``Value`` of an entry: ``length`` bytes at file ``offset``."""

    offset: int
    length: int


@dataclass(frozen=True)
class EntryInfo:
    """One logical checkpoint entry (all ``Value``s sharing a tag).

    ``kind`` is ``"tensor"``, ``"str"`` (an ``append_dict`` string) or ``"map"``
    (a MapParameter, indexed but not interpreted).
    """

    name: str
    kind: str
    ms_type: str
    dims: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape; MindSpore stores a 0-d tensor either as ``[]`` or as ``[0]``."""
        if self.kind != "tensor":
            return ()
        if self.dims == (0,) and self.nbytes == ms_dtype(self.ms_type).storage.itemsize:
            return ()
        return self.dims


class CkptReader:
    """Index of one ``.ckpt`` file with zero-copy access to its tensors.

    Use as a context manager; views handed out must not outlive it.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify_crc: bool = True) -> None:
        self.path = Path(path)
        try:
            self._file: BinaryIO = open(self.path, "rb")  # noqa: SIM115
        except OSError as err:
            raise CheckpointFormatError(f"cannot open: {err.strerror}", path=self.path) from None
        size = os.fstat(self._file.fileno()).st_size
        self._map: mmap.mmap | None = None
        self._buf = memoryview(b"")
        if size:
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            self._buf = memoryview(self._map)
        self.has_crc = False
        self.crc_expected: int | None = None
        end = size
        if size >= CRC_TRAILER_LEN and bytes(self._buf[size - CRC_TRAILER_LEN : size - 10]) == CRC_MAGIC:
            self.has_crc = True
            self.crc_expected = int.from_bytes(self._buf[size - 10 : size], "big")
            end = size - CRC_TRAILER_LEN
        self.content_end = end
        try:
            self.entries: dict[str, EntryInfo] = self._index(end)
        except BaseException:
            self.close()
            raise
        if self.has_crc and verify_crc:
            self.verify_crc()

    def __enter__(self) -> CkptReader:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._buf.release()
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a view; it goes with the view
                self._map.close()
            self._map = None
        self._file.close()

    def _fail(self, message: str, param: str | None = None) -> CheckpointFormatError:
        return CheckpointFormatError(message, path=self.path, param=param)

    def release_pages(self) -> None:
        """Drop the mapped pages this process has touched (they stay in the page cache).

        File-backed pages count in the process's RSS until released; releasing them after
        each written batch keeps memory flat however large the shard is.
        """
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def verify_crc(self) -> None:
        """Check MindSpore's CRC32 trailer over the whole protobuf content."""
        crc = 0
        step = 64 * 1024 * 1024
        for start in range(0, self.content_end, step):
            crc = zlib.crc32(self._buf[start : min(start + step, self.content_end)], crc)
        if crc != self.crc_expected:
            raise self._fail(
                f"crc_num trailer mismatch: file says {self.crc_expected}, content gives {crc} (file damaged)"
            )

    def _index(self, end: int) -> dict[str, EntryInfo]:
        entries: dict[str, EntryInfo] = {}
        last: str | None = None
        try:
            for f in wire.iter_fields(self._buf, 0, end):
                if f.number != 1 or f.wire_type != wire.WIRE_LEN:
                    raise self._fail(f"unexpected top-level field {f.number} (wire type {f.wire_type})")
                entry = self._parse_value(f.value, f.value + f.length)
                prev = entries.get(entry.name)
                if prev is not None:
                    if last != entry.name:
                        raise self._fail("tag appears twice, not consecutively", entry.name)
                    if (prev.kind, prev.ms_type, prev.dims) != (entry.kind, entry.ms_type, entry.dims):
                        raise self._fail("continuation Value disagrees on type or dims", entry.name)
                    entry = EntryInfo(prev.name, prev.kind, prev.ms_type, prev.dims, prev.segments + entry.segments)
                entries[entry.name] = entry
                last = entry.name
        except wire.WireError as err:
            raise self._fail(f"corrupt or truncated protobuf: {err}", last) from None
        for e in entries.values():
            self._check_size(e)
        return entries

    def _parse_value(self, start: int, end: int) -> EntryInfo:
        tag: str | None = None
        body: tuple[str, int, int] | None = None
        for f in wire.iter_fields(self._buf, start, end):
            if f.number == 1 and f.wire_type == wire.WIRE_LEN:
                try:
                    tag = bytes(self._buf[f.value : f.value + f.length]).decode("utf-8")
                except UnicodeDecodeError:
                    raise self._fail(f"tag at byte {f.value} is not UTF-8") from None
            elif f.number in (2, 3) and f.wire_type == wire.WIRE_LEN:
                body = ("tensor" if f.number == 2 else "map", f.value, f.value + f.length)
        if tag is None:
            raise self._fail(f"Value at byte {start} has no tag")
        if body is None:
            raise self._fail("Value has neither tensor nor maptensor", tag)
        kind, bstart, bend = body
        if kind == "map":
            return EntryInfo(tag, "map", "map", (), (Segment(bstart, bend - bstart),))
        return self._parse_tensor(tag, bstart, bend)

    def _parse_tensor(self, tag: str, start: int, end: int) -> EntryInfo:
        dims: list[int] = []
        ms_type: str | None = None
        content: Segment | None = None
        for f in wire.iter_fields(self._buf, start, end):
            if f.number == 1 and f.wire_type == wire.WIRE_VARINT:
                dims.append(wire.as_int64(f.value))
            elif f.number == 1 and f.wire_type == wire.WIRE_LEN:
                pos, stop = f.value, f.value + f.length
                while pos < stop:
                    v, pos = wire.read_varint(self._buf, pos, stop)
                    dims.append(wire.as_int64(v))
            elif f.number == 2 and f.wire_type == wire.WIRE_LEN:
                try:
                    ms_type = bytes(self._buf[f.value : f.value + f.length]).decode("ascii")
                except UnicodeDecodeError:
                    raise self._fail("tensor_type is not ASCII", tag) from None
            elif f.number == 3 and f.wire_type == wire.WIRE_LEN:
                content = Segment(f.value, f.length)
        if ms_type is None:
            raise self._fail("tensor has no tensor_type", tag)
        if content is None:
            content = Segment(end, 0)
        if any(d < 0 for d in dims):
            raise self._fail(f"negative dimension in dims {dims}", tag)
        kind = "str" if ms_type == STRING_TYPE else "tensor"
        if kind == "tensor":
            ms_dtype(ms_type, path=str(self.path), param=tag)
        return EntryInfo(tag, kind, ms_type, tuple(dims), (content,))

    def _check_size(self, e: EntryInfo) -> None:
        if e.kind != "tensor":
            return
        item = ms_dtype(e.ms_type).storage.itemsize
        count = math.prod(e.dims) if e.dims != (0,) else 1
        if e.dims == (0,) and e.nbytes == 0:
            count = 0
        if count * item != e.nbytes:
            raise self._fail(
                f"payload is {e.nbytes} bytes but dims {list(e.dims)} x {e.ms_type} need {count * item}", e.name
            )
        for s in e.segments:
            if s.length % item:
                raise self._fail(f"a payload segment of {s.length} bytes splits an element", e.name)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def dtype(self, name: str) -> MsDtype:
        return ms_dtype(self.entries[name].ms_type)

    def string(self, name: str) -> str:
        """Value of a string entry (MindSpore stores numpy ``U`` data: UTF-32-LE)."""
        e = self.entries[name]
        raw = b"".join(bytes(self._buf[s.offset : s.offset + s.length]) for s in e.segments)
        try:
            return raw.decode("utf-32-le").rstrip("\x00")
        except UnicodeDecodeError:
            raise self._fail("string entry is not UTF-32", name) from None

    def map_bytes(self, name: str) -> bytes:
        e = self.entries[name]
        return b"".join(bytes(self._buf[s.offset : s.offset + s.length]) for s in e.segments)

    def array(self, name: str) -> np.ndarray:
        """The whole tensor: a read-only view when it is stored in one segment, else a copy."""
        e = self.entries[name]
        if e.kind != "tensor":
            raise self._fail(f"entry is a {e.kind}, not a tensor", name)
        dt = ms_dtype(e.ms_type).storage
        if len(e.segments) == 1:
            s = e.segments[0]
            flat = np.frombuffer(self._buf, dtype=dt, count=s.length // dt.itemsize, offset=s.offset)
        else:
            flat = np.concatenate(
                [np.frombuffer(self._buf, dtype=dt, count=s.length // dt.itemsize, offset=s.offset) for s in e.segments]
            )
        return flat.reshape(e.shape)

    def fileno(self) -> int:
        return self._file.fileno()

    def row_bytes_range(self, name: str, r0: int, r1: int) -> tuple[int, int] | None:
        """File offset and length of rows ``[r0, r1)`` when they lie in one payload segment
        (so they can be copied file to file without passing through memory)."""
        e = self.entries[name]
        shape = e.shape
        if not shape or not 0 <= r0 < r1 <= shape[0]:
            return None
        row_bytes = math.prod(shape[1:]) * ms_dtype(e.ms_type).storage.itemsize
        if row_bytes == 0:
            return None
        seg = _segment_holding(_segment_row_bounds(e, row_bytes), r0, r1)
        if seg is None:
            return None
        s, seg_row0 = seg
        return s.offset + (r0 - seg_row0) * row_bytes, (r1 - r0) * row_bytes

    def rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows ``[r0, r1)`` of a tensor along axis 0: a view when they lie in one segment."""
        e = self.entries[name]
        shape = e.shape
        if not shape:
            return self.array(name)
        dt = ms_dtype(e.ms_type).storage
        row_elems = math.prod(shape[1:])
        row_bytes = row_elems * dt.itemsize
        if not 0 <= r0 <= r1 <= shape[0]:
            raise self._fail(f"rows [{r0}, {r1}) outside {shape[0]} rows", name)
        if row_bytes == 0 or r0 == r1:
            return np.empty((r1 - r0,) + shape[1:], dtype=dt)
        seg = _segment_holding(_segment_row_bounds(e, row_bytes), r0, r1)
        if seg is not None:
            s, seg_row0 = seg
            off = s.offset + (r0 - seg_row0) * row_bytes
            flat = np.frombuffer(self._buf, dtype=dt, count=(r1 - r0) * row_elems, offset=off)
        else:
            flat = self._gather(e, r0 * row_bytes, r1 * row_bytes, dt)
        return flat.reshape((r1 - r0,) + shape[1:])

    def row_blocks(self, name: str, max_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(first_row, block)`` covering the tensor along axis 0, each at most
        ``max_bytes`` (but at least one row); blocks inside one segment are views."""
        e = self.entries[name]
        shape = e.shape
        if not shape:
            yield 0, self.array(name)
            return
        dt = ms_dtype(e.ms_type).storage
        row_elems = math.prod(shape[1:])
        row_bytes = row_elems * dt.itemsize
        if row_bytes == 0 or shape[0] == 0:
            yield 0, self.array(name)
            return
        rows_per = max(1, max_bytes // row_bytes)
        bounds = _segment_row_bounds(e, row_bytes)
        r = 0
        while r < shape[0]:
            r1 = min(shape[0], r + rows_per)
            seg = _segment_holding(bounds, r, r1)
            if seg is not None:
                s, seg_row0 = seg
                off = s.offset + (r - seg_row0) * row_bytes
                flat = np.frombuffer(self._buf, dtype=dt, count=(r1 - r) * row_elems, offset=off)
            else:
                flat = self._gather(e, r * row_bytes, r1 * row_bytes, dt)
            yield r, flat.reshape((r1 - r,) + shape[1:])
            r = r1

    def _gather(self, e: EntryInfo, start: int, stop: int, dt: np.dtype) -> np.ndarray:
        out = np.empty((stop - start) // dt.itemsize, dtype=dt)
        raw = out.view(np.uint8)
        pos = 0
        done = 0
        for s in e.segments:
            lo, hi = max(start, pos), min(stop, pos + s.length)
            if lo < hi:
                raw[done : done + hi - lo] = np.frombuffer(self._buf, np.uint8, hi - lo, s.offset + lo - pos)
                done += hi - lo
            pos += s.length
        return out


def _segment_row_bounds(e: EntryInfo, row_bytes: int) -> list[tuple[Segment, int, int] | None]:
    out: list[tuple[Segment, int, int] | None] = []
    pos = 0
    for s in e.segments:
        if pos % row_bytes or s.length % row_bytes:
            out.append(None)
        else:
            out.append((s, pos // row_bytes, (pos + s.length) // row_bytes))
        pos += s.length
    return out


def _segment_holding(
    bounds: list[tuple[Segment, int, int] | None], r0: int, r1: int
) -> tuple[Segment, int] | None:
    for b in bounds:
        if b is not None and b[1] <= r0 and r1 <= b[2]:
            return b[0], b[1]
    return None


def value_header(name: str, ms_type: str, dims: Iterable[int], content_len: int) -> bytes:
    """Bytes of a top-level ``Checkpoint.value`` field up to (not including) its content."""
    tag = name.encode("utf-8")
    dims_bytes = b"".join(wire.encode_key(1, wire.WIRE_VARINT) + wire.encode_varint(int(d)) for d in dims)
    type_bytes = ms_type.encode("ascii")
    tensor_prefix = (
        dims_bytes
        + wire.encode_len_field(2, len(type_bytes))
        + type_bytes
        + wire.encode_len_field(3, content_len)
    )
    tensor_len = len(tensor_prefix) + content_len
    value_prefix = wire.encode_len_field(1, len(tag)) + tag + wire.encode_len_field(2, tensor_len)
    value_len = len(value_prefix) + tensor_len
    return wire.encode_len_field(1, value_len) + value_prefix + tensor_prefix


class CkptWriter:
    """Writes a ``.ckpt`` entry by entry to ``<path>.tmp-zckpt`` and renames on :meth:`commit`.

    Leaving the context without committing (an exception) removes the temporary file.
    """

    def __init__(self, path: str | os.PathLike[str], *, crc: bool = False, fsync: bool = True) -> None:
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + ".tmp-zckpt")
        self._crc_enabled = crc
        self._fsync = fsync
        self._crc = 0
        self.bytes_written = 0
        self._names: set[str] = set()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: BinaryIO | None = open(self.tmp_path, "wb")  # noqa: SIM115

    def __enter__(self) -> CkptWriter:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is None and self._f is not None:
            self.commit()
        else:
            self.abort()

    def _write(self, data: bytes | memoryview) -> None:
        assert self._f is not None, "writer already closed"
        self._f.write(data)
        n = len(data) if isinstance(data, bytes) else data.nbytes
        self.bytes_written += n
        if self._crc_enabled:
            self._crc = binascii.crc32(data, self._crc)

    def _claim(self, name: str) -> None:
        if name in self._names:
            raise CheckpointFormatError("entry written twice", path=self.tmp_path, param=name)
        self._names.add(name)

    def write_array(self, name: str, ms_type: str, array: np.ndarray) -> None:
        """Write a whole in-memory tensor (a view is fine)."""
        self.write_blocks(name, ms_type, array.shape, iter([array]))

    def write_blocks(
        self, name: str, ms_type: str, shape: tuple[int, ...], blocks: Iterator[np.ndarray]
    ) -> None:
        """Stream a tensor given as consecutive row blocks along axis 0.

        Tensors above MindSpore's slice size are split into several Values exactly as
        MindSpore does (np.array_split of axis 0), so readers see familiar files.
        """
        self._claim(name)
        dt = ms_dtype(ms_type, path=str(self.path), param=name).storage
        total = math.prod(shape) * dt.itemsize
        dims = list(shape)
        if total > MS_SLICE_BYTES and shape and shape[0] > 1:
            parts = min(shape[0], math.ceil(total / 1024 / (MS_SLICE_BYTES / 1024)))
            base, extra = divmod(shape[0], parts)
            row_counts = [base + (1 if i < extra else 0) for i in range(parts)]
        else:
            row_counts = [shape[0] if shape else 1]
        row_bytes = (math.prod(shape[1:]) if shape else 1) * dt.itemsize
        pending: np.ndarray | None = None
        block_iter = iter(blocks)
        for rows in row_counts:
            need = rows * row_bytes
            self._write(value_header(name, ms_type, dims, need))
            while need > 0:
                if pending is None or pending.size == 0:
                    nxt = next(block_iter, None)
                    if nxt is None:
                        raise CheckpointFormatError(
                            f"tensor data ended {need} bytes early", path=self.tmp_path, param=name
                        )
                    pending = _as_le_bytes(nxt, dt)
                take = min(need, pending.size)
                self._write(pending[:take].data)
                pending = pending[take:]
                need -= take
        leftover = (0 if pending is None else pending.size) + sum(_as_le_bytes(b, dt).size for b in block_iter)
        if leftover:
            raise CheckpointFormatError(
                f"tensor data has {leftover} bytes more than shape {dims} needs", path=self.tmp_path, param=name
            )

    def write_string(self, name: str, value: str) -> None:
        """Write an ``append_dict`` string entry the way MindSpore does (dims [0], type "str")."""
        self._claim(name)
        payload = np.array(value).tobytes()
        self._write(value_header(name, STRING_TYPE, [0], len(payload)) + payload)

    def write_map(self, name: str, body: bytes) -> None:
        """Write a MapParameter entry from its encoded ``MapTensorProto`` body (passed through)."""
        self._claim(name)
        tag = name.encode("utf-8")
        value = wire.encode_len_field(1, len(tag)) + tag + wire.encode_len_field(3, len(body)) + body
        self._write(wire.encode_len_field(1, len(value)) + value)

    def commit(self) -> Path:
        """Finish the file: trailer, flush, fsync, atomic rename to the final name."""
        assert self._f is not None, "writer already closed"
        if self._crc_enabled:
            self._f.write(CRC_MAGIC + self._crc.to_bytes(10, "big"))
        self._f.flush()
        if self._fsync:
            os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        os.replace(self.tmp_path, self.path)
        return self.path

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        with contextlib.suppress(FileNotFoundError):
            self.tmp_path.unlink()


def _as_le_bytes(block: np.ndarray, dt: np.dtype) -> np.ndarray:
    arr = np.asarray(block)
    if arr.dtype != dt:
        if arr.dtype.itemsize != dt.itemsize or arr.dtype.kind not in "biuf":
            raise CheckpointFormatError(f"block dtype {arr.dtype} does not match {dt}")
        arr = arr.view(dt)
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
