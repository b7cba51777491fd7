"""Boxes of global tensors read straight from the source shards (the direct path).

The ingest plan already says, for every entry, which source rank holds which box, one
replica per box (its ``Write``s), and planning indexed every shard: where each entry's
payload bytes lie. A destination slice is the union of its intersections with those boxes,
so :class:`SourceReader` serves the writers (:mod:`zckpt.write.writers`) from the shards
themselves, the way :class:`zckpt.store.reader.StoreReader` serves it from a store: pieces that
are whole rows of both the source shard and the destination slice are handed out as byte
ranges of the shard files (the writer copies them file to file), anything else is read with ``pread``
and cut into the slice, one band at a time. Tasks never parse a shard again: the indexes
travel with the plan.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import SourceError
from zckpt.core.layout import Box, c_order_pieces
from zckpt.formats.entries import EntryInfo, FileRange
from zckpt.formats.opener import open_remote, open_shard, shard_format
from zckpt.formats.remote_shard import RemoteShard
from zckpt.formats.shard_reader import ShardReader
from zckpt.io import remote
from zckpt.plan.values import Slice, TensorSpec, Write
from zckpt.write.boxes import BoxCorners, batch_bytes, batches_ahead


@dataclass(frozen=True)
class SourceBoxes:
    """Where the entries one destination file holds live in the source shards: each
    entry's spec, the boxes the ingest plan gives source ranks (one replica per box), those
    ranks' files and their index entries. Plain data, so a task on any Dask worker can
    receive it."""

    specs: Mapping[str, TensorSpec]
    writes: Mapping[str, tuple[Write, ...]]
    files: Mapping[int, str]
    entries: Mapping[int, Mapping[str, EntryInfo]]

    @classmethod
    def of(cls, specs: Mapping[str, TensorSpec], writes_by_name: Mapping[str, Sequence[Write]],
           slices: Iterable[Slice], indexes: Mapping[int, Mapping[str, EntryInfo]],
           rank_files: Mapping[int, str], corners: Corners | None = None) -> SourceBoxes:
        """What the file of ``slices`` needs: only the source boxes that meet them (a task
        ships this, so it stays proportional to the file, not to the job). ``corners``: the
        writes' boxes as arrays, made once for every destination file."""
        hits: dict[str, set[int]] = {}
        for s in slices:
            held = writes_by_name.get(s.name, ())
            if s.box.ndim == 0 or specs[s.name].kind != "tensor":
                hits[s.name] = set(range(min(1, len(held))))
            else:  # several slices of one entry (files written together) need the union
                hit = meeting(held, s.box, None if corners is None else corners.of(s.name, held))
                hits.setdefault(s.name, set()).update(hit)
        writes = {n: [writes_by_name[n][i] for i in sorted(idx)] for n, idx in hits.items()}
        entries: dict[int, dict[str, EntryInfo]] = {}
        for name, ws in writes.items():
            for w in ws:
                entries.setdefault(w.rank, {})[name] = indexes[w.rank][name]
        return cls({n: specs[n] for n in writes}, {n: tuple(ws) for n, ws in writes.items()},
                   {r: str(p) for r, p in rank_files.items() if r in entries}, entries)


class Corners:
    """The boxes of each entry's writes as two arrays (starts, stops), made on first use:
    every destination file asks which of the same writes meet its slice."""

    def __init__(self) -> None:
        self._arrays: dict[str, BoxCorners] = {}

    def of(self, name: str, writes: Sequence[Write]) -> BoxCorners:
        got = self._arrays.get(name)
        if got is None:
            got = self._arrays[name] = _corners(writes)
        return got


def _corners(writes: Sequence[Write]) -> BoxCorners:
    return (np.array([w.box.start for w in writes], dtype=np.int64),
            np.array([w.box.stop for w in writes], dtype=np.int64))


def meeting(writes: Sequence[Write], box: Box, corners: BoxCorners | None = None) -> list[int]:
    """Indices of the writes whose boxes overlap ``box``, in order: one vectorised test over
    all of them (a 512-rank job gives each parameter up to hundreds of source boxes, and a
    destination file meets a few). ``corners``: their boxes as arrays, when made already."""
    if not writes:
        return []
    starts, stops = corners if corners is not None else _corners(writes)
    hit = np.all((starts < np.array(box.stop)) & (stops > np.array(box.start)), axis=1)
    return np.flatnonzero(hit).tolist()


def segment_spans(entry: EntryInfo, start: int, stop: int) -> Iterator[tuple[int, int]]:
    """``(file offset, length)`` of the logical payload bytes ``[start, stop)`` of an entry,
    one span per payload segment they touch (MindSpore splits tensors above 512 MiB into
    several Values)."""
    pos = 0
    for seg in entry.segments:
        lo, hi = max(start, pos), min(stop, pos + seg.length)
        if lo < hi:
            yield seg.offset + lo - pos, hi - lo
        pos += seg.length
        if pos >= stop:
            return


class ShardFiles:
    """Payload bytes of source shards read by their index entries: one file descriptor per
    shard, ``pread`` at the offsets planning found. A rank whose payloads live elsewhere (a
    split safetensors rank, a unified directory, a MindFormers rank) is read through its
    reader instead. Thread safe."""

    def __init__(self, files: Mapping[int, str], entries: Mapping[int, Mapping[str, EntryInfo]],
                 storage_options: remote.StorageOptions = None) -> None:
        self.files = files
        self.entries = entries
        self.storage_options = storage_options
        self._fds: dict[int, int] = {}
        self._readers: dict[int, ShardReader] = {}
        self._split: dict[int, bool] = {}
        self._paths: dict[int, Path] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
            readers, self._readers = list(self._readers.values()), {}
        for fd in fds:
            os.close(fd)
        for r in readers:
            r.close()

    def split(self, rank: int) -> bool:
        """Whether the rank's payloads are not in its own file at the offsets of its index
        (a split safetensors rank, a unified directory, a MindFormers rank): then they are
        read through its reader, never copied from the file."""
        with self._lock:
            got = self._split.get(rank)
            if got is None:
                got = self._split[rank] = remote.is_remote(self.files[rank]) or \
                    shard_format(self.files[rank]) not in ("ckpt", "safetensors")
            return got

    def path(self, rank: int) -> Path:
        """The rank's file as one ``Path`` object (a file gives hundreds of ranges, and the
        writer compares their paths to merge ranges that continue each other)."""
        got = self._paths.get(rank)
        if got is None:
            got = self._paths[rank] = Path(self.files[rank])
        return got

    def reader(self, rank: int) -> ShardReader:
        """The rank's shard reader (strings, MapParameters, split safetensors ranks)."""
        with self._lock:
            r = self._readers.get(rank)
            if r is None:
                path = self.files[rank]
                r = self._readers[rank] = open_remote(path, self.storage_options, index=self.entries[rank]) \
                    if remote.is_remote(path) else open_shard(path, verify_crc=False)
            return r

    def _fd(self, rank: int) -> int:
        with self._lock:
            fd = self._fds.get(rank)
            if fd is None:
                try:
                    fd = self._fds[rank] = os.open(self.files[rank], os.O_RDONLY)
                except OSError as err:
                    raise SourceError(f"cannot open: {err.strerror}", path=self.files[rank]) from None
            return fd

    def read(self, rank: int, name: str, start: int, stop: int, target: np.ndarray) -> None:
        """The logical payload bytes ``[start, stop)`` of ``name`` in the rank's shard into
        ``target`` (uint8, ``stop - start`` long)."""
        if self.split(rank):
            reader = self.reader(rank)
            if isinstance(reader, RemoteShard):  # only the spans asked for, fetched together
                pos = 0
                spans = list(segment_spans(self.entries[rank][name], start, stop))
                for (_, n), got in zip(spans, reader.read_spans(spans), strict=True):
                    target[pos : pos + n] = np.frombuffer(got, np.uint8)
                    pos += n
                return
            target[...] = reader.array(name).reshape(-1).view(np.uint8)[start:stop]
            reader.release_pages()
            return
        fd, pos = self._fd(rank), 0
        for off, n in segment_spans(self.entries[rank][name], start, stop):
            if os.preadv(fd, [target[pos : pos + n].data], off) != n:
                raise SourceError(f"file ended inside the payload (byte {off + n} needed): did it change?",
                                  path=self.files[rank], param=name)
            pos += n

    def rows(self, rank: int, name: str, holder: Box, part: Box, buffer: bytearray | None = None) -> np.ndarray:
        """The values of ``part`` (global coordinates) of ``name`` in the rank's shard, which
        holds ``holder``: the shard rows it lies in are read (into ``buffer`` when given and
        large enough) and the part cut from them (a view of the rows)."""
        dt = ms_dtype(self.entries[rank][name].ms_type).storage
        if holder.ndim and remote.is_remote(self.files[rank]):
            reader = self.reader(rank)
            assert isinstance(reader, RemoteShard)
            local = part.relative_to(holder)
            return reader.read_region(name, local.start, local.stop)  # its runs only, not whole rows
        if holder.ndim == 0:
            out = np.empty((), dtype=dt)
            self.read(rank, name, 0, dt.itemsize, out.reshape(-1).view(np.uint8))
            return out
        local = part.relative_to(holder)
        row_bytes = math.prod(holder.shape[1:]) * dt.itemsize
        need = local.shape[0] * row_bytes
        raw = (np.frombuffer(buffer, dtype=np.uint8, count=need) if buffer is not None and len(buffer) >= need
               else np.empty(need, dtype=np.uint8))
        self.read(rank, name, local.start[0] * row_bytes, local.stop[0] * row_bytes, raw)
        return raw.view(dt).reshape((local.shape[0], *holder.shape[1:]))[(slice(None), *local.slices()[1:])]


class SourceReader:
    """A :class:`~zckpt.write.boxes.BoxReader` over source shards (use as a context manager:
    the files it opens are closed on leaving)."""

    def __init__(self, boxes: SourceBoxes, block_bytes: int, *, overlap: bool = False,
                 storage_options: remote.StorageOptions = None) -> None:
        self.boxes = boxes
        self.shards = ShardFiles(boxes.files, boxes.entries, storage_options)
        self.band_bytes = batch_bytes(block_bytes, overlap)
        """Largest batch of bands read at once (more are in flight when reading ahead)."""
        self.batches_ahead = batches_ahead(True)
        self.read_bytes = 0
        self.checked_bytes = 0
        self._scratch = bytearray()
        """Source rows a piece is cut from (one batch is read at a time): reused."""
        self._corners = Corners()
        """Each entry's source boxes as arrays, made on first use."""

    def __enter__(self) -> SourceReader:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.shards.close()

    def _itemsize(self, name: str) -> int:
        return int(ms_dtype(self.boxes.specs[name].ms_type).storage.itemsize)

    def _pieces(self, name: str, box: Box) -> list[tuple[Write, Box]]:
        """The source boxes that hold parts of ``box``, with those parts, in C order of
        their first rows; refuses a box that they do not cover whole."""
        found = []
        writes = self.boxes.writes.get(name, ())
        covered = 0
        if box.ndim == 0:
            found = [(w, w.box) for w in writes]
        else:
            lo, hi = box.start, box.stop
            for i in meeting(writes, box, self._corners.of(name, writes)):  # one vectorised test: hundreds of writes
                w = writes[i]
                start, stop = tuple(map(max, w.box.start, lo)), tuple(map(min, w.box.stop, hi))
                found.append((w, Box(start, stop)))
                covered += math.prod(map(int.__sub__, stop, start))
        if (box.ndim and covered != box.size) or (box.ndim == 0 and not found):
            raise _uncovered(name, box)
        return sorted(found, key=lambda p: p[1].start)

    def kind(self, name: str) -> str:
        return self.boxes.specs[name].kind

    def ms_type(self, name: str) -> str:
        return self.boxes.specs[name].ms_type

    def _holder(self, name: str) -> ShardReader:
        writes = self.boxes.writes.get(name)
        if not writes:
            raise SourceError("no source file holds it", param=name)
        return self.shards.reader(writes[0].rank)

    def string(self, name: str) -> str:
        return self._holder(name).string(name)

    def map_bytes(self, name: str) -> bytes:
        return self._holder(name).map_bytes(name)

    def bands(self, name: str, box: Box) -> list[Box]:
        if box.ndim == 0 or box.size == 0:
            return [box]
        return c_order_pieces(box, max(1, self.band_bytes // self._itemsize(name)))

    def read_costs(self, name: str, boxes: Sequence[Box], corners: BoxCorners | None = None) -> int:
        """Bytes reading each of ``boxes`` apart takes from the shards: each piece's whole
        source rows, worked out on all boxes and all source boxes at once (a plan of 512
        files asks it for every slice)."""
        itemsize = self._itemsize(name)
        cost = 0
        if corners is None:
            flat = [b for b in boxes if b.ndim and b.size]
            cost = sum(b.size for b in boxes if not (b.ndim and b.size)) * itemsize
            if not flat:
                return cost
            corners = np.array([b.start for b in flat]), np.array([b.stop for b in flat])
        writes = self.boxes.writes.get(name, ())
        if not writes:
            return cost
        starts, stops = self._corners.of(name, writes)
        lo = corners[0][:, None, :]
        hi = corners[1][:, None, :]
        inter = np.minimum(stops[None], hi) - np.maximum(starts[None], lo)
        meets = np.all(inter > 0, axis=2)
        rows = (stops[:, 1:] - starts[:, 1:]).prod(axis=1)
        return cost + int((np.where(meets, inter[:, :, 0], 0) * rows[None]).sum()) * itemsize

    def file_ranges(self, name: str, box: Box) -> list[FileRange] | None:
        """The slice as byte ranges of shard files, when every piece of it is whole rows of
        its source shard and spans the slice's full width (so the pieces, stacked along the
        first axis, are the slice's C-order bytes); ``None`` otherwise. Worked out on the
        boxes' corners (no :class:`Box` per piece): a 512-rank job asks it for tens of
        thousands of pieces."""
        if box.size == 0:
            return None
        if box.ndim == 0:
            return self._scalar_ranges(name, box)
        lo, hi = box.start, box.stop
        rows: list[tuple[int, int, Write]] = []
        for w in self.boxes.writes.get(name, ()):
            ws, we = w.box.start, w.box.stop
            if not all(map(int.__lt__, map(max, ws, lo), map(min, we, hi))):
                continue  # does not meet the slice
            if ws[1:] != lo[1:] or we[1:] != hi[1:] or self.shards.split(w.rank):
                return None  # not whole rows of both: read through memory
            rows.append((max(ws[0], lo[0]), min(we[0], hi[0]), w))
        if sum(b - a for a, b, _ in rows) != hi[0] - lo[0]:
            raise _uncovered(name, box)
        rows.sort(key=lambda r: r[0])
        row_bytes = math.prod(box.shape[1:]) * self._itemsize(name)
        out: list[FileRange] = []
        for a, b, w in rows:
            r0, r1 = (a - w.box.start[0]) * row_bytes, (b - w.box.start[0]) * row_bytes
            entry = self.boxes.entries[w.rank][name]
            path = self.shards.path(w.rank)
            if len(entry.segments) == 1 and r1 <= entry.segments[0].length:  # one Value: one range
                out.append(FileRange(path, entry.segments[0].offset + r0, r1 - r0))
            else:
                out.extend(FileRange(path, off, n) for off, n in segment_spans(entry, r0, r1))
        self.read_bytes += (hi[0] - lo[0]) * row_bytes
        return out

    def _scalar_ranges(self, name: str, box: Box) -> list[FileRange] | None:
        """A 0-d slice: its one value's bytes in the shard holding it."""
        (w, _), *_ = self._pieces(name, box)
        if self.shards.split(w.rank):
            return None
        out = [FileRange(self.shards.path(w.rank), off, n)
               for off, n in segment_spans(self.boxes.entries[w.rank][name], 0, self._itemsize(name))]
        self.read_bytes += sum(r.length for r in out)
        return out

    def materialise(self, items: list[tuple[str, Box]]) -> list[np.ndarray]:
        """Read each box from the shards holding its pieces with ``pread``: straight into the
        box when a piece is whole rows of both, else the shard rows it lies in through a
        reused buffer of at most one band, cut from it."""
        out = []
        for name, box in items:
            arr = np.empty(box.shape, dtype=ms_dtype(self.boxes.specs[name].ms_type).storage)
            if box.size:
                for w, inter in self._pieces(name, box):
                    self._read_piece(name, w, inter, box, arr)
            out.append(arr)
            self.read_bytes += arr.nbytes
        return out

    def _read_piece(self, name: str, w: Write, inter: Box, box: Box, arr: np.ndarray) -> None:
        """Fill ``arr``'s part ``inter`` (global coordinates; ``arr`` holds ``box``) from the
        shard of ``w``, which holds it."""
        dest = arr[inter.relative_to(box).slices()] if box.ndim else arr
        row_bytes = math.prod(w.box.shape[1:]) * arr.dtype.itemsize
        if inter.shape[1:] == w.box.shape[1:] and dest.flags.c_contiguous:
            r0 = inter.start[0] - w.box.start[0] if box.ndim else 0
            self.shards.read(w.rank, name, r0 * row_bytes, r0 * row_bytes + dest.nbytes,
                             dest.reshape(-1).view(np.uint8))
            return
        self.checked_bytes += inter.shape[0] * row_bytes - dest.nbytes  # the source rows' other columns
        step = max(1, self.band_bytes // max(1, row_bytes))  # the buffer stays within one band
        for a in range(inter.start[0], inter.stop[0], step):
            part = Box((a, *inter.start[1:]), (min(inter.stop[0], a + step), *inter.stop[1:]))
            need = part.shape[0] * row_bytes
            if len(self._scratch) < need:
                self._scratch = bytearray(need)
            dest[a - inter.start[0] : part.stop[0] - inter.start[0]] = self.shards.rows(
                w.rank, name, w.box, part, self._scratch)


def _uncovered(name: str, box: Box) -> SourceError:
    return SourceError(f"no source file holds part of region {box.to_json()} (its source rank is missing)",
                       param=name)
