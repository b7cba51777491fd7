"""Reading MindSpore ``.ckpt`` files: :class:`CkptReader`.

The reader maps the file and indexes it (:mod:`zckpt.formats.ckpt_index`), checks MindSpore's
CRC trailer, and hands tensors out as numpy views of the mapping (zero copy), so only the
pages actually used are read; an entry split over several ``Value`` messages is read across
its segments. Writing is :mod:`zckpt.formats.ckpt_writer`.
"""

from __future__ import annotations

import bisect
import itertools
import math
import mmap
import os
import zlib
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType

import numpy as np

from zckpt.core.dtypes import MsDtype, ms_dtype
from zckpt.formats.ckpt_encoding import CRC_MAGIC, CRC_TRAILER_LEN
from zckpt.formats.ckpt_index import INDEX_RELEASE_BYTES, CkptIndex
from zckpt.formats.entries import EntryInfo, Segment


class CkptReader(CkptIndex):
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
        self._adopt(self._map_file(path), entries)
        return self

    def _adopt(self, size: int, entries: Mapping[str, EntryInfo]) -> None:
        """Take ``entries`` as the index of the file of ``size`` bytes just opened (closed and
        refused when they reach past its end)."""
        self.has_crc, self.crc_expected, self.content_end = False, None, size
        self.entries = dict(entries)
        end = max((s.offset + s.length for e in self.entries.values() for s in e.segments), default=0)
        if end > size:
            self.close()
            raise self._fail(f"is {size} bytes but its index reaches byte {end}: the file changed after planning")

    def __enter__(self) -> CkptReader:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

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
        raw = b"".join(bytes(b) for b in self._spans([(s.offset, s.length) for s in e.segments]))
        try:
            return raw.decode("utf-32-le").rstrip("\x00")
        except UnicodeDecodeError:
            raise self._fail("string entry is not UTF-32", name) from None

    def map_bytes(self, name: str) -> bytes:
        e = self.entry(name)
        return b"".join(bytes(b) for b in self._spans([(s.offset, s.length) for s in e.segments]))

    def array(self, name: str) -> np.ndarray:
        """The whole tensor: a read-only view when it is stored in one segment, else a copy."""
        e = self.entry(name)
        if e.kind != "tensor":
            raise self._fail(f"entry is a {e.kind}, not a tensor", name)
        dt = ms_dtype(e.ms_type).storage
        spans = self._spans([(s.offset, s.length) for s in e.segments])
        if len(spans) == 1:
            flat = np.frombuffer(spans[0], dtype=dt)
        else:
            flat = np.concatenate([np.frombuffer(b, dtype=dt) for b in spans])
        return flat.reshape(e.shape)

    def fileno(self) -> int:
        return self._file.fileno()

    def byte_range(self, offset: int, length: int) -> memoryview:
        """The mapped bytes ``[offset, offset + length)`` of the file (no copy)."""
        if offset < 0 or length < 0 or offset + length > len(self._buf):
            raise self._fail(f"byte range {offset}+{length} lies outside the file")
        return memoryview(self._span(offset, length))

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
            return np.frombuffer(self._span(off, stop - start), dtype=dt)
        out = np.empty((stop - start) // dt.itemsize, dtype=dt)
        segs.gather(self._spans, start, stop, out.view(np.uint8))
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

    def gather(self, read: Callable[[list[tuple[int, int]]], list[memoryview | bytes]], start: int, stop: int,
               out: np.ndarray) -> None:
        """Copy logical bytes ``[start, stop)`` into ``out`` (uint8, ``stop - start`` long);
        ``read`` gives the bytes of file ranges."""
        ranges = []
        i = max(0, self._first(start))
        while i < len(self.segments) and self.starts[i] < stop:
            s, pos = self.segments[i], self.starts[i]
            lo, hi = max(start, pos), min(stop, pos + s.length)
            if lo < hi:
                ranges.append((s.offset + lo - pos, hi - lo))
            i += 1
        done = 0
        for (_, n), b in zip(ranges, read(ranges), strict=True):
            out[done : done + n] = np.frombuffer(b, np.uint8)
            done += n
