"""Boxes of global tensors read straight from the source shards (the direct path).

The ingest plan already says, for every entry, which source rank holds which box, one
replica per box (its ``Write``s). A destination slice is the union of its intersections
with those boxes, so :class:`SourceReader` serves the executor (:mod:`zckpt.rank_writer`)
from the shards themselves, the way :class:`zckpt.export.StoreReader` serves it from a
store: pieces that are whole rows of both the source shard and the destination slice are
handed out as byte ranges of the shard files (the kernel copies them), anything else is
read through the shard's mapping and cut into the slice, one band at a time.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from zckpt.dtypes import ms_dtype
from zckpt.errors import SourceError
from zckpt.formats.ckpt import CkptReader, EntryInfo, FileRange
from zckpt.formats.shards import SafetensorsSetReader, open_shard
from zckpt.layout import Box, c_order_pieces
from zckpt.plan import IngestPlan, TensorSpec, Write


@dataclass(frozen=True)
class SourceBoxes:
    """Where the entries one destination file holds live in the source shards: each
    entry's spec, the boxes the ingest plan gives source ranks (one replica per box) and
    those ranks' files. Plain data, so a task on any Dask worker can receive it."""

    specs: Mapping[str, TensorSpec]
    writes: Mapping[str, tuple[Write, ...]]
    files: Mapping[int, str]

    @classmethod
    def of(cls, plan: IngestPlan, names: Iterable[str]) -> SourceBoxes:
        wanted = set(names)
        specs = {t.name: t for t in plan.tensors if t.name in wanted}
        writes: dict[str, list[Write]] = {}
        for w in plan.writes:
            if w.name in wanted:
                writes.setdefault(w.name, []).append(w)
        ranks = {w.rank for ws in writes.values() for w in ws}
        return cls(specs, {n: tuple(ws) for n, ws in writes.items()},
                   {r: str(p) for r, p in plan.rank_files.items() if r in ranks})


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


class SourceReader:
    """A :class:`~zckpt.rank_writer.BoxReader` over source shards (use as a context manager:
    the shards it opens are closed on leaving)."""

    def __init__(self, boxes: SourceBoxes, block_bytes: int, *, overlap: bool = False) -> None:
        self.boxes = boxes
        self.band_bytes = max(1, block_bytes // (2 if overlap else 1))
        """Largest batch of bands read at once (two are in flight when reading ahead)."""
        self.read_bytes = 0
        self.checked_bytes = 0
        self._open: dict[int, CkptReader] = {}
        self._proven: set[tuple[int, str]] = set()
        self._lock = threading.Lock()
        self._scratch = bytearray()
        """Source rows a piece is cut from (one batch is read at a time): reused."""

    def __enter__(self) -> SourceReader:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            readers, self._open = list(self._open.values()), {}
        for r in readers:
            r.close()

    def _shard(self, name: str, w: Write) -> CkptReader:
        """The shard of ``w``'s rank, open, once shown to hold ``name`` as the plan says
        (the plan was made from the same files' indexes; a file changed since is refused)."""
        with self._lock:
            reader = self._open.get(w.rank)
            if reader is None:
                reader = self._open[w.rank] = open_shard(self.boxes.files[w.rank], verify_crc=False)
            if (w.rank, name) not in self._proven:
                spec = self.boxes.specs[name]
                e = reader.entries.get(name)
                if e is None or e.kind != spec.kind or (spec.kind == "tensor" and (
                        e.ms_type != spec.ms_type or e.shape != w.box.shape)):
                    held = "nothing" if e is None else f"{e.kind} {e.ms_type}{list(e.shape)}"
                    raise SourceError(f"holds {held} but the plan expects {spec.kind} {spec.ms_type}"
                                      f"{list(w.box.shape)} (did the file change?)", path=reader.path, param=name)
                self._proven.add((w.rank, name))
            return reader

    def _itemsize(self, name: str) -> int:
        return int(ms_dtype(self.boxes.specs[name].ms_type).storage.itemsize)

    def _pieces(self, name: str, box: Box) -> list[tuple[Write, Box]]:
        """The source boxes that hold parts of ``box``, with those parts, in C order of
        their first rows; refuses a box that they do not cover whole."""
        found = []
        for w in self.boxes.writes.get(name, ()):
            inter = w.box if box.ndim == 0 else w.box.intersect(box)
            if inter is not None:
                found.append((w, inter))
        if sum(inter.size for _, inter in found) != box.size or (box.ndim == 0 and not found):
            raise SourceError(f"no source file holds part of region {box.to_json()} (its source rank is missing)",
                              param=name)
        return sorted(found, key=lambda p: p[1].start)

    def kind(self, name: str) -> str:
        return self.boxes.specs[name].kind

    def ms_type(self, name: str) -> str:
        return self.boxes.specs[name].ms_type

    def _holder(self, name: str) -> CkptReader:
        writes = self.boxes.writes.get(name)
        if not writes:
            raise SourceError("no source file holds it", param=name)
        return self._shard(name, writes[0])

    def string(self, name: str) -> str:
        return self._holder(name).string(name)

    def map_bytes(self, name: str) -> bytes:
        return self._holder(name).map_bytes(name)

    def bands(self, name: str, box: Box) -> list[Box]:
        if box.ndim == 0 or box.size == 0:
            return [box]
        return c_order_pieces(box, max(1, self.band_bytes // self._itemsize(name)))

    def file_ranges(self, name: str, box: Box) -> list[FileRange] | None:
        """The slice as byte ranges of shard files, when every piece of it is whole rows of
        its source shard and spans the slice's full width (so the pieces, stacked along the
        first axis, are the slice's C-order bytes); ``None`` otherwise."""
        if box.size == 0:
            return None
        out: list[FileRange] = []
        for w, inter in self._pieces(name, box):
            if inter.shape[1:] != box.shape[1:] or inter.shape[1:] != w.box.shape[1:]:
                return None
            reader = self._shard(name, w)
            if isinstance(reader, SafetensorsSetReader):
                return None  # parts in several files; read through memory
            entry = reader.entries[name]
            row_bytes = (int(np.prod(w.box.shape[1:])) if box.ndim else 1) * self._itemsize(name)
            r0 = inter.start[0] - w.box.start[0] if box.ndim else 0
            r1 = inter.stop[0] - w.box.start[0] if box.ndim else 1
            out.extend(FileRange(Path(reader.path), off, n) for off, n in segment_spans(entry, r0 * row_bytes,
                                                                                        r1 * row_bytes))
        self.read_bytes += sum(r.length for r in out)
        return out

    def materialise(self, items: list[tuple[str, Box]]) -> list[np.ndarray]:
        """Read each box from the shards holding its pieces: the source rows a piece lies in
        are read with ``pread`` (straight into the box when the piece is whole rows of both,
        else into a reused buffer it is cut from), so no mapped page stays resident."""
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
        reader = self._shard(name, w)
        dest = arr[inter.relative_to(box).slices()] if box.ndim else arr
        if isinstance(reader, SafetensorsSetReader):  # parts in several files: through their mappings
            local = inter.relative_to(w.box)
            dest[...] = (reader.array(name) if box.ndim == 0 else
                         reader.rows(name, local.start[0], local.stop[0])[(slice(None), *local.slices()[1:])])
            reader.release_pages()
            return
        item = arr.dtype.itemsize
        row_bytes = math.prod(w.box.shape[1:]) * item
        r0 = inter.start[0] - w.box.start[0] if box.ndim else 0
        r1 = inter.stop[0] - w.box.start[0] if box.ndim else 1
        if inter.shape[1:] == w.box.shape[1:] and dest.flags.c_contiguous:
            self._pread(reader, name, r0 * row_bytes, r1 * row_bytes, dest.reshape(-1).view(np.uint8))
            return
        cut = (slice(None), *inter.relative_to(w.box).slices()[1:])
        step = max(1, self.band_bytes // max(1, row_bytes))  # the buffer stays within one band
        for a in range(r0, r1, step):
            b = min(r1, a + step)
            if len(self._scratch) < (b - a) * row_bytes:
                self._scratch = bytearray((b - a) * row_bytes)
            rows = np.frombuffer(self._scratch, dtype=np.uint8, count=(b - a) * row_bytes)
            self._pread(reader, name, a * row_bytes, b * row_bytes, rows)
            dest[a - r0 : b - r0] = rows.view(arr.dtype).reshape((b - a, *w.box.shape[1:]))[cut]

    @staticmethod
    def _pread(reader: CkptReader, name: str, start: int, stop: int, target: np.ndarray) -> None:
        """The logical payload bytes ``[start, stop)`` of ``name`` into ``target`` (uint8)."""
        pos = 0
        for off, n in segment_spans(reader.entries[name], start, stop):
            if os.preadv(reader.fileno(), [target[pos : pos + n].data], off) != n:
                raise SourceError(f"file ended inside the payload (byte {off + n} needed)", path=reader.path,
                                  param=name)
            pos += n
