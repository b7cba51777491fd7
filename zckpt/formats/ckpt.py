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
import bisect
import collections
import contextlib
import functools
import itertools
import math
import mmap
import os
import stat
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, NamedTuple

import numpy as np

from zckpt.core.dtypes import MS_DTYPES, STRING_TYPE, MsDtype, ms_dtype
from zckpt.core.errors import CheckpointFormatError
from zckpt.formats import wire
from zckpt.io import fileio
from zckpt.io.checksums import RangeCheck, Sink
from zckpt.io.new_files import NewFile

CRC_MAGIC = b"crc_num"
CRC_TRAILER_LEN = len(CRC_MAGIC) + 10
MS_SLICE_BYTES = 512 * 1024 * 1024
"""MindSpore writes a tensor larger than this as several Values (np.array_split on axis 0)."""
INDEX_RELEASE_BYTES = 64 * 1024 * 1024
"""Reading the index or the CRC releases the mapped pages behind it every this many bytes."""
MAX_NDIM = 32
"""Most dims an entry may have: numpy's limit (32 before numpy 2), far above MindSpore's 8.
Checked while parsing, so a packed dims field of a million varints fails on the 33rd."""
MAX_NBYTES = 2**63 - 1
"""numpy refuses any shape whose non-zero dims times the item size exceed this (even when
another dim is 0, the array is empty), so the reader refuses such dims at index time."""


@dataclass(frozen=True)
class FileRange:
    """``length`` bytes at ``offset`` of the file ``path``: a block a writer copies file to
    file without holding the tensor in memory (through one reused buffer, or by the kernel).
    With ``check``, the writer passes the bytes to ``check`` on the way (parts share it).
    The ``verify`` checks read the recorded blocks the range lies in themselves: the writer
    hands them the bytes it copies and writes what they read of the range as they go (each
    byte read once), before the file is published."""

    path: Path
    offset: int
    length: int
    check: Sink | None = None
    verify: tuple[RangeCheck, ...] = ()

    def part(self, skip: int, take: int) -> FileRange:
        """Bytes ``[skip, skip + take)`` of the range; its checks go with the part that ends it
        (a range cut in two is still checked once, after its last byte is copied)."""
        return FileRange(self.path, self.offset + skip, take, self.check,
                         self.verify if skip + take == self.length else ())


Block = np.ndarray | FileRange
"""A piece of tensor data handed to :meth:`CkptWriter.write_blocks`."""


class Segment(NamedTuple):
    """Payload bytes of one ``Value`` of an entry: ``length`` bytes at file ``offset`` (a
    tuple, as :class:`EntryInfo`: the index of a 512-rank job is 30 000 of each, built four
    times faster than frozen dataclasses)."""

    offset: int
    length: int


class EntryInfo(NamedTuple):
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

    def __init__(self, path: str | os.PathLike[str], *, verify_crc: bool = True, sparse: bool = False) -> None:
        """``sparse``: the file is opened for its index and its payloads are read elsewhere
        (planning a job larger than the page cache): each page the header walk faults in is
        read alone, not with the 8 MiB of payload the kernel's read-ahead brings around it,
        which the page cache would drop again before the payloads are copied (every byte of
        such a job read twice from the disk)."""
        size = self._map_file(path)
        self.has_crc = False
        self.crc_expected: int | None = None
        end = size
        if size >= CRC_TRAILER_LEN and bytes(self._buf[size - CRC_TRAILER_LEN : size - 10]) == CRC_MAGIC:
            self.has_crc = True
            self.crc_expected = int.from_bytes(self._buf[size - 10 : size], "big")
            end = size - CRC_TRAILER_LEN
        self.content_end = end
        if self.has_crc and verify_crc and self._map is not None and hasattr(mmap, "MADV_SEQUENTIAL"):
            self._map.madvise(mmap.MADV_SEQUENTIAL)  # the whole file is read: ahead in large steps, not per fault
        elif sparse and self._map is not None and hasattr(mmap, "MADV_RANDOM"):
            self._map.madvise(mmap.MADV_RANDOM)
        try:
            self.entries: dict[str, EntryInfo] = self._index(end)
        except BaseException:
            self.close()
            raise
        if self.has_crc and verify_crc:
            self.verify_crc()
        self.release_pages()

    @classmethod
    def indexed(cls, path: str | os.PathLike[str], entries: Mapping[str, EntryInfo]) -> CkptReader:
        """A reader over an index parsed before (by the plan of an ingest): the file is mapped,
        not walked again. Refused when the file no longer holds the payloads (it shrank)."""
        self = cls.__new__(cls)
        size = self._map_file(path)
        self.has_crc, self.crc_expected, self.content_end = False, None, size
        self.entries = dict(entries)
        end = max((s.offset + s.length for e in self.entries.values() for s in e.segments), default=0)
        if end > size:
            self.close()
            raise self._fail(f"is {size} bytes but its index reaches byte {end}: the file changed after planning")
        return self

    def _map_file(self, path: str | os.PathLike[str]) -> int:
        """Open and map ``path`` read-only (shared by every shard reader); returns its size."""
        self.path = Path(path)
        self._file: BinaryIO = _open_regular(self.path)
        size = os.fstat(self._file.fileno()).st_size
        self._map: mmap.mmap | None = None
        self._buf = memoryview(b"")
        if size:
            try:
                self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as err:
                self._file.close()
                raise CheckpointFormatError(f"cannot map: {err}", path=self.path) from None
            self._buf = memoryview(self._map)
        return size

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
        each written batch keeps memory flat however large the shard is. A page touched
        can map far more than itself: Linux 6.18 maps the whole large folio around it (up
        to 2 MiB with a file cached by big sequential reads), so walking the headers of
        773 Values mapped 515 MiB of a 1 GiB shard until they were released.
        """
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def _release_range(self, start: int, stop: int) -> None:
        """:meth:`release_pages` for the pages of ``[start, stop)`` only."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        lo, hi = start - start % mmap.PAGESIZE, min(len(self._map), stop)
        if hi > lo:
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def verify_crc(self) -> None:
        """Check MindSpore's CRC32 trailer over the whole protobuf content."""
        crc = 0
        step = INDEX_RELEASE_BYTES
        for start in range(0, self.content_end, step):
            crc = zlib.crc32(self._buf[start : min(start + step, self.content_end)], crc)
            self._release_range(start, start + step)
        if crc != self.crc_expected:
            raise self._fail(
                f"crc_num trailer mismatch: file says {self.crc_expected}, content gives {crc} (file damaged)"
            )

    def _index(self, end: int) -> dict[str, EntryInfo]:
        plain = self._index_plain(end)
        return plain if plain is not None else self._index_fields(end)

    def _index_plain(self, end: int) -> dict[str, EntryInfo] | None:
        """The index of a file laid out as MindSpore writes it, in one loop over its bytes:
        every ``Value`` a tag then a tensor (dims, type, content). 30 000 Values (512 ranks)
        take a third of the time of the field-by-field walk. ``None`` for anything else (maps,
        unknown or reordered fields, damage): :meth:`_index_fields` then reads the file and
        names what is wrong, so both accept and refuse the same files."""
        buf = self._buf
        read = wire.read_varint
        entries: dict[str, tuple[str, str, tuple[int, ...], list[Segment]]] = {}
        types_ok: set[str] = set()
        last: str | None = None
        released = pos = 0
        try:
            while pos < end:
                if buf[pos] != 0x0A:  # Checkpoint.value (field 1, length-delimited)
                    return None
                if pos - released >= INDEX_RELEASE_BYTES:  # bound what the walk keeps mapped
                    self._release_range(released, pos)
                    released = pos
                n, pos = read(buf, pos + 1, end)
                vend = pos + n
                if vend > end or pos >= vend or buf[pos] != 0x0A:  # Value.tag first
                    return None
                n = buf[pos + 1]  # small varints (lengths of names, dims) decoded here, without a call
                if n < 0x80:
                    pos += 2
                else:
                    n, pos = read(buf, pos + 1, vend)
                if pos + n > vend:
                    return None
                tag = bytes(buf[pos : pos + n]).decode("utf-8")
                pos += n
                if pos >= vend or buf[pos] != 0x12:  # then Value.tensor, ending the Value
                    return None
                n, pos = read(buf, pos + 1, vend)
                if pos + n != vend:
                    return None
                dims: list[int] = []
                ms_type: str | None = None
                content: Segment | None = None
                while pos < vend:
                    key = buf[pos]
                    if key == 0x08:  # dims, one varint each
                        v = buf[pos + 1]
                        if v < 0x80:
                            pos += 2
                        else:
                            v, pos = read(buf, pos + 1, vend)
                        dims.append(v)
                    elif key in (0x0A, 0x12, 0x1A):  # packed dims, tensor_type, tensor_content
                        n, pos = read(buf, pos + 1, vend)
                        if pos + n > vend:
                            return None
                        if key == 0x0A:
                            stop = pos
                            pos += n
                            while stop < pos and len(dims) <= MAX_NDIM:
                                v, stop = read(buf, stop, pos)
                                dims.append(v)
                        elif key == 0x12:
                            ms_type = bytes(buf[pos : pos + n]).decode("ascii")
                            pos += n
                        else:
                            content = Segment(pos, n)
                            pos += n
                    else:
                        return None
                    if len(dims) > MAX_NDIM:
                        return None
                if pos != vend or ms_type is None or any(d >= 1 << 63 for d in dims):  # overrun, no type, dims < 0
                    return None
                if ms_type not in types_ok:
                    if ms_type != STRING_TYPE and ms_type not in MS_DTYPES:
                        return None
                    types_ok.add(ms_type)
                seg = content if content is not None else Segment(vend, 0)
                shape = tuple(dims)
                prev = entries.get(tag)
                if prev is None:
                    entries[tag] = ("str" if ms_type == STRING_TYPE else "tensor", ms_type, shape, [seg])
                elif last != tag or prev[1:3] != (ms_type, shape):
                    return None
                else:
                    prev[3].append(seg)
                last = tag
        except (wire.WireError, UnicodeDecodeError, IndexError):
            return None
        out = {name: EntryInfo(name, kind, ms_type, shape, tuple(segs))
               for name, (kind, ms_type, shape, segs) in entries.items()}
        for e in out.values():
            self._check_size(e)
        return out

    def _index_fields(self, end: int) -> dict[str, EntryInfo]:
        # Segments of an entry are collected in a list and the EntryInfo built once at the
        # end: rebuilding it per continuation Value was quadratic (a 1 MB file of one-byte
        # Values took seconds, a hostile 100 MB one hours).
        first: dict[str, EntryInfo] = {}
        segments: dict[str, list[Segment]] = {}
        last: str | None = None
        top: wire.Field | None = None
        released = 0
        try:
            for f in wire.iter_fields(self._buf, 0, end):
                top = f
                if f.value - released >= INDEX_RELEASE_BYTES:  # bound what the walk keeps mapped
                    self._release_range(released, f.value)
                    released = f.value
                if f.number != 1 or f.wire_type != wire.WIRE_LEN:
                    raise self._fail(f"unexpected top-level field {f.number} (wire type {f.wire_type})")
                entry = self._parse_value(f.value, f.value + f.length)
                prev = first.get(entry.name)
                if prev is None:
                    first[entry.name] = entry
                    segments[entry.name] = list(entry.segments)
                else:
                    if last != entry.name:
                        raise self._fail("tag appears twice, not consecutively", entry.name)
                    if (prev.kind, prev.ms_type, prev.dims) != (entry.kind, entry.ms_type, entry.dims):
                        raise self._fail("continuation Value disagrees on type or dims", entry.name)
                    segments[entry.name].extend(entry.segments)
                last = entry.name
                top = None
        except wire.WireError as err:
            # name the entry that is broken, not the last good one: its tag usually survives
            # (a cut mid-tensor leaves the Value's header intact)
            broken = self._tag_of_value(top.value, top.value + top.length) if top is not None else (
                self._tag_after_key(err.offset, end))
            after = f" (the entry after {last!r})" if broken is None and last is not None else ""
            raise self._fail(f"corrupt or truncated protobuf: {err}{after}", broken) from None
        entries = {
            name: EntryInfo(e.name, e.kind, e.ms_type, e.dims, tuple(segments[name])) for name, e in first.items()
        }
        for e in entries.values():
            self._check_size(e)
        return entries

    def _tag_after_key(self, key_at: int, end: int) -> str | None:
        """Best-effort tag of a top-level Value whose own length runs past the end of the file."""
        try:
            key, pos = wire.read_varint(self._buf, key_at, end)
            if key != (1 << 3) | wire.WIRE_LEN:
                return None
            _, pos = wire.read_varint(self._buf, pos, end)
        except wire.WireError:
            return None
        return self._tag_of_value(pos, end)

    def _tag_of_value(self, start: int, end: int) -> str | None:
        """Best-effort tag of a damaged Value: its first field, when that is a readable tag."""
        try:
            key, pos = wire.read_varint(self._buf, start, end)
            if key != (1 << 3) | wire.WIRE_LEN:
                return None
            n, pos = wire.read_varint(self._buf, pos, end)
        except wire.WireError:
            return None
        if n > min(end - pos, 64 * 1024):
            return None
        try:
            return bytes(self._buf[pos : pos + n]).decode("utf-8")
        except UnicodeDecodeError:
            return None

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
                if body is not None:  # protobuf would merge two tensors into one (their dims joined)
                    raise self._fail(f"Value at byte {start} holds its tensor twice", tag)
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
            if f.number == 1 and f.wire_type in (wire.WIRE_VARINT, wire.WIRE_LEN):
                if f.wire_type == wire.WIRE_VARINT:
                    dims.append(wire.as_int64(f.value))
                else:  # packed
                    pos, stop = f.value, f.value + f.length
                    while pos < stop and len(dims) <= MAX_NDIM:
                        v, pos = wire.read_varint(self._buf, pos, stop)
                        dims.append(wire.as_int64(v))
                if len(dims) > MAX_NDIM:
                    raise self._fail(f"more than {MAX_NDIM} dims", tag)
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
        if math.prod(d for d in e.dims if d) * item > MAX_NBYTES:
            raise self._fail(f"dims {list(e.dims)} x {e.ms_type} overflow int64 (no such tensor can exist)", e.name)
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

    def entry(self, name: str) -> EntryInfo:
        """The index entry of ``name``; an unknown name is a format error naming file and entry."""
        e = self.entries.get(name)
        if e is None:
            raise self._fail("no such entry in the checkpoint", name)
        return e

    def names(self) -> list[str]:
        return list(self.entries)

    def dtype(self, name: str) -> MsDtype:
        e = self.entry(name)
        if e.kind != "tensor":
            raise self._fail(f"entry is a {e.kind}, not a tensor", name)
        return ms_dtype(e.ms_type)

    def string(self, name: str) -> str:
        """Value of a string entry (MindSpore stores numpy ``U`` data: UTF-32-LE)."""
        e = self.entry(name)
        raw = b"".join(bytes(self._buf[s.offset : s.offset + s.length]) for s in e.segments)
        try:
            return raw.decode("utf-32-le").rstrip("\x00")
        except UnicodeDecodeError:
            raise self._fail("string entry is not UTF-32", name) from None

    def map_bytes(self, name: str) -> bytes:
        e = self.entry(name)
        return b"".join(bytes(self._buf[s.offset : s.offset + s.length]) for s in e.segments)

    def array(self, name: str) -> np.ndarray:
        """The whole tensor: a read-only view when it is stored in one segment, else a copy."""
        e = self.entry(name)
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

    def byte_range(self, offset: int, length: int) -> memoryview:
        """The mapped bytes ``[offset, offset + length)`` of the file (no copy)."""
        if offset < 0 or length < 0 or offset + length > len(self._buf):
            raise self._fail(f"byte range {offset}+{length} lies outside the file")
        return self._buf[offset : offset + length]

    def _segment_map(self, e: EntryInfo) -> _SegmentMap:
        # created on first use: subclasses with their own __init__ (safetensors) need no setup
        maps: dict[str, _SegmentMap] = self.__dict__.setdefault("_segmaps", {})
        m = maps.get(e.name)
        if m is None:
            m = maps[e.name] = _SegmentMap(e.segments)
        return m

    def row_bytes_range(self, name: str, r0: int, r1: int) -> tuple[int, int] | None:
        """File offset and length of rows ``[r0, r1)`` when they lie in one payload segment
        (so they can be copied file to file without passing through memory)."""
        e = self.entry(name)
        shape = e.shape
        if not shape or not 0 <= r0 < r1 <= shape[0]:
            return None
        row_bytes = math.prod(shape[1:]) * ms_dtype(e.ms_type).storage.itemsize
        if row_bytes == 0:
            return None
        if len(e.segments) == 1:  # most entries: no segment map (a 512-rank ingest asks this 28 800 times)
            seg = e.segments[0]
            return (seg.offset + r0 * row_bytes, (r1 - r0) * row_bytes) if r1 * row_bytes <= seg.length else None
        off = self._segment_map(e).offset_within_one(r0 * row_bytes, r1 * row_bytes)
        if off is None:
            return None
        return off, (r1 - r0) * row_bytes

    def rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows ``[r0, r1)`` of a tensor along axis 0: a view when they lie in one segment."""
        e = self.entry(name)
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
        return self._rows(e, r0, r1, dt, row_elems).reshape((r1 - r0,) + shape[1:])

    def _rows(self, e: EntryInfo, r0: int, r1: int, dt: np.dtype, row_elems: int) -> np.ndarray:
        """Rows as a flat array: a view of the mapping when they lie in one segment, else a copy."""
        start, stop = r0 * row_elems * dt.itemsize, r1 * row_elems * dt.itemsize
        segs = self._segment_map(e)
        off = segs.offset_within_one(start, stop)
        if off is not None:
            return np.frombuffer(self._buf, dtype=dt, count=(r1 - r0) * row_elems, offset=off)
        out = np.empty((stop - start) // dt.itemsize, dtype=dt)
        segs.gather(self._buf, start, stop, out.view(np.uint8))
        return out

    def row_blocks(self, name: str, max_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(first_row, block)`` covering the tensor along axis 0, each at most
        ``max_bytes`` (but at least one row); blocks inside one segment are views."""
        e = self.entry(name)
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
        r = 0
        while r < shape[0]:
            r1 = min(shape[0], r + rows_per)
            yield r, self._rows(e, r, r1, dt, row_elems).reshape((r1 - r,) + shape[1:])
            r = r1


class _SegmentMap:
    """Where each byte of an entry's logical payload lies in the file.

    Lookups bisect the cumulative segment sizes, so a tensor split over many ``Value``s
    costs O(log n) per request: a linear scan per block made ``row_blocks`` quadratic (a
    1 MB file of 60 000 one-byte Values took half a minute).
    """

    def __init__(self, segments: tuple[Segment, ...]) -> None:
        self.segments = segments
        self.starts = list(itertools.accumulate((s.length for s in segments), initial=0))

    def _first(self, pos: int) -> int:
        """Index of the segment holding logical byte ``pos`` (skipping empty segments)."""
        return bisect.bisect_right(self.starts, pos) - 1

    def offset_within_one(self, start: int, stop: int) -> int | None:
        """File offset of logical byte ``start`` when ``[start, stop)`` lies in one segment."""
        i = self._first(start)
        if 0 <= i < len(self.segments) and stop <= self.starts[i + 1]:
            return self.segments[i].offset + start - self.starts[i]
        return None

    def gather(self, buf: memoryview, start: int, stop: int, out: np.ndarray) -> None:
        """Copy logical bytes ``[start, stop)`` into ``out`` (uint8, ``stop - start`` long)."""
        done = 0
        i = max(0, self._first(start))
        while i < len(self.segments) and self.starts[i] < stop:
            s, pos = self.segments[i], self.starts[i]
            lo, hi = max(start, pos), min(stop, pos + s.length)
            if lo < hi:
                out[done : done + hi - lo] = np.frombuffer(buf, np.uint8, hi - lo, s.offset + lo - pos)
                done += hi - lo
            i += 1


def _open_regular(path: Path) -> BinaryIO:
    """Open a regular file for reading; anything else is a format error naming the file.

    The type is checked before opening because opening a FIFO blocks until a writer
    appears (a hang, not an error) and a device has no size to map.
    """
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
        if regular:
            return open(path, "rb")  # noqa: SIM115
    except OSError as err:
        raise CheckpointFormatError(f"cannot open: {err.strerror}", path=path) from None
    except ValueError as err:  # e.g. a NUL byte in the path
        raise CheckpointFormatError(f"cannot open: {err}", path=path) from None
    raise CheckpointFormatError("not a regular file", path=path)


def value_header(name: str, ms_type: str, dims: Iterable[int], content_len: int) -> bytes:
    """Bytes of a top-level ``Checkpoint.value`` field up to (not including) its content."""
    tag = name.encode("utf-8")
    tensor_prefix = _tensor_prefix(tuple(int(d) for d in dims), ms_type, content_len)
    tensor_len = len(tensor_prefix) + content_len
    value_prefix = wire.encode_len_field(1, len(tag)) + tag + wire.encode_len_field(2, tensor_len)
    value_len = len(value_prefix) + tensor_len
    return wire.encode_len_field(1, value_len) + value_prefix + tensor_prefix


def value_rows(shape: tuple[int, ...], itemsize: int) -> list[int]:
    """Rows of axis 0 in each ``Value`` of a tensor: one Value, or above MindSpore's slice
    size as many as MindSpore makes (``np.array_split`` of axis 0)."""
    total = math.prod(shape) * itemsize
    if total > MS_SLICE_BYTES and shape and shape[0] > 1:
        parts = min(shape[0], math.ceil(total / 1024 / (MS_SLICE_BYTES / 1024)))
        base, extra = divmod(shape[0], parts)
        return [base + (1 if i < extra else 0) for i in range(parts)]
    return [shape[0] if shape else 1]


@functools.lru_cache(maxsize=4096)
def _tensor_prefix(dims: tuple[int, ...], ms_type: str, content_len: int) -> bytes:
    """A ``TensorProto``'s fields before its content: the same for every tensor of one shape
    and type (100 000 small tensors share a few dozen), so encoded once each."""
    dims_bytes = b"".join(wire.encode_key(1, wire.WIRE_VARINT) + wire.encode_varint(d) for d in dims)
    type_bytes = ms_type.encode("ascii")
    return dims_bytes + wire.encode_len_field(2, len(type_bytes)) + type_bytes + wire.encode_len_field(3, content_len)


class CkptWriter:
    """Writes a ``.ckpt`` entry by entry to a new file beside it (:class:`~zckpt.io.new_files.NewFile`:
    unnamed where the system allows) and gives it its name on :meth:`commit`.

    Leaving the context without committing (an exception) drops the new file. A
    file range that carries checks is checked in the pass that copies it, so a failed check
    raises before the file is committed and leaves nothing under the final name.
    """

    def __init__(self, path: str | os.PathLike[str], *, crc: bool = False, fsync: bool = True,
                 publisher: fileio.Publisher | None = None) -> None:
        self.path = Path(path)
        self._publisher = publisher
        """Where a committed file is synced and renamed (on its thread), else here."""
        self.size = 0
        """The file's size once committed."""
        self._unflushed = False
        self._crc_enabled = crc
        self._fsync = fsync
        self._crc = 0
        self.bytes_written = 0
        self._buffer: bytearray | None = None
        self._names: set[str] = set()
        self._sources: collections.OrderedDict[Path, tuple[int, int]] = collections.OrderedDict()
        """Open source files of recent file ranges with their sizes (a job of hundreds of ranks
        copies thousands of ranges out of each file: one open and fstat per file, not per range)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._new = NewFile(self.path)  # unnamed until published where the system allows
        self._f: BinaryIO | None = self._new.file

    def __enter__(self) -> CkptWriter:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is None and self._f is not None:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()

    def _write(self, data: bytes | memoryview) -> None:
        assert self._f is not None, "writer already closed"
        self._f.write(data)
        self._unflushed = True
        n = len(data) if isinstance(data, bytes) else data.nbytes
        self.bytes_written += n
        if self._crc_enabled:
            self._crc = binascii.crc32(data, self._crc)

    def _claim(self, name: str) -> None:
        if name in self._names:
            raise CheckpointFormatError("entry written twice", path=self.path, param=name)
        self._names.add(name)

    def write_array(self, name: str, ms_type: str, array: np.ndarray) -> None:
        """Write a whole in-memory tensor (a view is fine)."""
        self.write_blocks(name, ms_type, array.shape, iter([array]))

    def write_blocks(
        self, name: str, ms_type: str, shape: tuple[int, ...], blocks: Iterable[Block]
    ) -> None:
        """Stream a tensor given as consecutive blocks of its C-order bytes: arrays (row
        blocks), or ranges of other files (:meth:`_copy_range`).

        Tensors above MindSpore's slice size are split into several Values exactly as
        MindSpore does (np.array_split of axis 0), so readers see familiar files.
        """
        self._claim(name)
        dt = ms_dtype(ms_type, path=str(self.path), param=name).storage
        dims = list(shape)
        row_counts = value_rows(shape, dt.itemsize)
        row_bytes = (math.prod(shape[1:]) if shape else 1) * dt.itemsize
        pending: np.ndarray | FileRange | None = None
        block_iter = coalesce(blocks)
        for rows in row_counts:
            need = rows * row_bytes
            self._write(value_header(name, ms_type, dims, need))
            while need > 0:
                if pending is None or _block_size(pending) == 0:
                    nxt = next(block_iter, None)
                    if nxt is None:
                        raise CheckpointFormatError(
                            f"tensor data ended {need} bytes early", path=self.path, param=name
                        )
                    pending = nxt if isinstance(nxt, FileRange) else _as_le_bytes(nxt, dt)
                take = min(need, _block_size(pending))
                if isinstance(pending, FileRange):
                    if take == pending.length:  # the usual case: a whole range
                        self._copy_range(pending)
                        pending = None
                        need -= take
                        continue
                    self._copy_range(pending.part(0, take))
                    pending = pending.part(take, pending.length - take)
                else:
                    self._write(pending[:take].data)
                    pending = pending[take:]
                need -= take
        leftover = (0 if pending is None else _block_size(pending)) + sum(
            b.length if isinstance(b, FileRange) else _as_le_bytes(b, dt).size for b in block_iter
        )
        if leftover:
            raise CheckpointFormatError(
                f"tensor data has {leftover} bytes more than shape {dims} needs", path=self.path, param=name
            )

    def _copy_range(self, block: FileRange) -> None:
        """Append a file range: through the writer's buffer in one pass (each byte read once,
        passed to the range's checks and the CRC trailer while in the CPU cache, then
        written), or by the kernel when nothing needs the bytes and the range's pages line
        up with the file's (:meth:`_kernel_copies`)."""
        assert self._f is not None, "writer already closed"
        src, size = self._source(block.path)
        if size < block.offset + block.length:
            raise CheckpointFormatError(
                f"block {block.offset}+{block.length} lies past the end of the file", path=block.path
            )
        if block.verify:
            self._copy_verified(block, src)
        else:
            self._copy_bytes(block.path, src, block.offset, block.length, block.check)

    def _kernel_copies(self, offset: int) -> bool:
        """Whether ``copy_file_range`` is the cheaper copy of source bytes at ``offset`` to the
        file's end: only when they fall at the same place in a page. Otherwise ext4 splices
        each source page into two destination pages and costs more than a read and a write
        through the buffer (bench/bench_copy.py)."""
        return not self._crc_enabled and (offset - self.bytes_written) % mmap.PAGESIZE == 0

    def _copy_bytes(self, path: Path, src: int, offset: int, length: int, check: Sink | None) -> None:
        """Append ``length`` bytes of ``src`` at ``offset``, passing them to ``check``."""
        assert self._f is not None, "writer already closed"
        done = 0
        if check is None and self._kernel_copies(offset):
            if self._unflushed:  # the kernel writes at the file's position: what Python buffers goes first
                self._f.flush()
                self._unflushed = False
            done = fileio.kernel_copy(src, self._f.fileno(), offset, length)
            self.bytes_written += done
        view = self._view()
        while done < length:
            n = os.preadv(src, [view[: min(len(view), length - done)]], offset + done)
            if not n:
                raise CheckpointFormatError(f"file ended after {done} of {length} bytes", path=path)
            if check is not None:
                check(offset + done, view[:n])
            self._write(view[:n])
            done += n

    def _copy_verified(self, block: FileRange, src: int) -> None:
        """Copy a range while its checks read the recorded blocks it lies in: the bytes they
        read from the range are written on the way (read once, checked while in the CPU
        cache); the parts they do not read (blocks checked already for an earlier range) are
        copied plainly, in order. A ``check`` of the range receives its bytes as written."""
        stop = block.offset + block.length
        pos = block.offset
        check = block.check
        view = self._view()

        def read_at(path: Path, offset: int, length: int) -> memoryview:
            nonlocal pos
            if path != block.path:
                raise AssertionError(f"a check of a range of {block.path} reads {path}")
            if pos < min(offset, stop):  # bytes of the range before these: copied first
                self._copy_bytes(block.path, src, pos, min(offset, stop) - pos, check)
                pos = min(offset, stop)
            data = view[: os.preadv(src, [view[: min(length, len(view))]], offset)]
            lo, hi = max(offset, pos), min(offset + len(data), stop)
            if lo == pos and lo < hi:
                if check is not None:
                    check(lo, data[lo - offset : hi - offset])
                self._write(data[lo - offset : hi - offset])
                pos = hi
            return data

        for c in block.verify:
            c.run(read_at)
        if pos < stop:
            self._copy_bytes(block.path, src, pos, stop - pos, check)

    def _view(self) -> memoryview:
        if self._buffer is None:
            self._buffer = bytearray(fileio.BLOCK)
        return memoryview(self._buffer)

    def _source(self, path: Path) -> tuple[int, int]:
        """``(fd, size)`` of a range's source file, kept open for the next ranges from it."""
        got = self._sources.get(path)
        if got is not None:
            self._sources.move_to_end(path)
            return got
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointFormatError("block source file is missing", path=path) from None
        got = self._sources[path] = (fd, os.fstat(fd).st_size)
        if len(self._sources) > OPEN_SOURCES:
            os.close(self._sources.popitem(last=False)[1][0])
        return got

    def _close_sources(self) -> None:
        while self._sources:
            os.close(self._sources.popitem()[1][0])

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
        """Finish the file: trailer, flush, fsync, atomic rename to the final name (with a
        publisher: handed to it, which syncs and renames it on its thread)."""
        assert self._f is not None, "writer already closed"
        if self._crc_enabled:
            self._f.write(CRC_MAGIC + self._crc.to_bytes(10, "big"))
        f, self._f = self._f, None
        self._close_sources()
        f.flush()
        self.size = f.tell()
        if self._publisher is not None:
            self._publisher.submit(self._new)
        else:
            self._new.publish(self._fsync)
        return self.path

    def abort(self) -> None:
        self._close_sources()
        self._f = None
        self._new.discard()


OPEN_SOURCES = 64
"""Source files a writer keeps open at once (least recently used closed first)."""


def coalesce(blocks: Iterable[Block]) -> Iterator[Block]:
    """Merge consecutive file ranges that continue each other in the same file (with the same
    check): a destination slice over many small source chunks becomes one copy per run."""
    run: FileRange | None = None
    for b in blocks:
        if isinstance(b, FileRange):
            if run is not None and b.path == run.path and b.offset == run.offset + run.length and b.check is run.check:
                run = FileRange(run.path, run.offset, run.length + b.length, run.check, run.verify + b.verify)
                continue
            if run is not None:
                yield run
            run = b
            continue
        if run is not None:
            yield run
            run = None
        yield b
    if run is not None:
        yield run


def _block_size(block: np.ndarray | FileRange) -> int:
    return block.length if isinstance(block, FileRange) else int(block.size)


def _as_le_bytes(block: np.ndarray, dt: np.dtype) -> np.ndarray:
    arr = np.asarray(block)
    if arr.dtype != dt:
        if arr.dtype.itemsize != dt.itemsize or arr.dtype.kind not in "biuf":
            raise CheckpointFormatError(f"block dtype {arr.dtype} does not match {dt}")
        arr = arr.view(dt)
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
