"""The index of a ``.ckpt`` file: the file mapped read-only and walked for every entry.

For every entry the walk records its MindSpore type, dims and where its payload bytes lie,
without touching a payload: one loop over MindSpore's usual layout, and a field-by-field walk
that reads anything else and names what is wrong. A parameter that MindSpore split over
several consecutive ``Value`` messages of the same tag becomes one entry with several payload
segments. Names and type names are interned: 256 shards of one model name each parameter 256
times, and a plan shipped to another process then carries each name once. This is the half
of :class:`~zckpt.formats.ckpt.CkptReader` that reads the file's structure (it is the
reader's base class); the reader adds the CRC check and the values.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import stat
import sys
from pathlib import Path
from typing import BinaryIO

from zckpt.core.dtypes import MS_DTYPES, STRING_TYPE, ms_dtype
from zckpt.core.errors import CheckpointFormatError
from zckpt.formats import wire
from zckpt.formats.entries import EntryInfo, Segment

INDEX_RELEASE_BYTES = 64 * 1024 * 1024
"""Reading the index or the CRC releases the mapped pages behind it every this many bytes."""
MAX_NDIM = 32
"""Most dims an entry may have: numpy's limit (32 before numpy 2), far above MindSpore's 8.
Checked while parsing, so a packed dims field of a million varints fails on the 33rd."""
MAX_NBYTES = 2**63 - 1
"""numpy refuses any shape whose non-zero dims times the item size exceed this (even when
another dim is 0, the array is empty), so the reader refuses such dims at index time."""


class CkptIndex:
    """A ``.ckpt`` file mapped read-only, and the walk that indexes it (see the module doc)."""

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

    def close(self) -> None:
        self._buf.release()
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a view; it goes with the view
                self._map.close()
            self._map = None
        self._file.close()

    def _fail(self, message: str, param: str | None = None) -> CheckpointFormatError:
        return CheckpointFormatError(message, path=self.path, param=param)

    def _span(self, offset: int, length: int) -> memoryview | bytes:
        """Bytes ``[offset, offset + length)`` of the file: a view of the mapping here, fetched
        bytes in a reader of a remote object (:mod:`zckpt.formats.remote_shard`)."""
        return self._buf[offset : offset + length]

    def _spans(self, ranges: list[tuple[int, int]]) -> list[memoryview | bytes]:
        """:meth:`_span` of each ``(offset, length)`` (a remote reader fetches them together)."""
        return [self._buf[o : o + n] for o, n in ranges]

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
                tag = sys.intern(bytes(buf[pos : pos + n]).decode("utf-8"))
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
                            ms_type = sys.intern(bytes(buf[pos : pos + n]).decode("ascii"))
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

    def _field_one(self, start: int, end: int) -> tuple[int, int] | None:
        """Length and start of the length-delimited field 1 whose key is at ``start``, if it is one."""
        try:
            key, pos = wire.read_varint(self._buf, start, end)
            if key != (1 << 3) | wire.WIRE_LEN:
                return None
            return wire.read_varint(self._buf, pos, end)
        except wire.WireError:
            return None

    def _tag_after_key(self, key_at: int, end: int) -> str | None:
        """Best-effort tag of a top-level Value whose own length runs past the end of the file."""
        got = self._field_one(key_at, end)
        return None if got is None else self._tag_of_value(got[1], end)

    def _tag_of_value(self, start: int, end: int) -> str | None:
        """Best-effort tag of a damaged Value: its first field, when that is a readable tag."""
        got = self._field_one(start, end)
        if got is None:
            return None
        n, pos = got
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
                    tag = sys.intern(bytes(self._buf[f.value : f.value + f.length]).decode("utf-8"))
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
                    ms_type = sys.intern(bytes(self._buf[f.value : f.value + f.length]).decode("ascii"))
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
