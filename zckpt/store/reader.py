"""The store's box reader: destination slices read out of a store, checked against the
checksums recorded for every block they use (the :class:`zckpt.write.boxes.BoxReader` of a
store; the source shards' is :class:`zckpt.sources.reader.SourceReader`).

Raw chunk and shard files are read directly, with one call for ranges that follow each
other in a file, and a slice that is whole chunk rows is handed to the writer as file
ranges to copy; a remote store's raw chunks are the same ranges of its objects, fetched
together for a batch and checked as they arrive (:mod:`zckpt.store.remote_chunks`); other
chunks go through Zarr (or lazy Dask views with ``reader="dask"``).
Export (either format), loading into a network, segmented loading, unified output and
verify read stores through it, holding a local store shared while they read (:func:`reading`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, Protocol

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import StoreError
from zckpt.core.layout import Box, c_order_pieces, tiles
from zckpt.formats.entries import FileRange
from zckpt.io import locks, remote, safe_paths
from zckpt.io.checksums import BlockCheck, ChunkSums, Mismatch, ReadAt, Sink, SpanCheck, SpanChecks
from zckpt.plan.values import ExportPlan
from zckpt.run.engines import wants_overlap
from zckpt.store import read_costs
from zckpt.store.remote_chunks import ChunkRange
from zckpt.write.boxes import BoxCorners, batch_bytes, batches_ahead

if TYPE_CHECKING:
    from zckpt.store.chunk_records import Checked
    from zckpt.store.store import Store


class ReadOptions(Protocol):
    """What a :class:`StoreReader` reads from an export's options (:class:`zckpt.jobs.export_job.ExportOptions`)."""

    @property
    def block_bytes(self) -> int: ...
    @property
    def overlap(self) -> bool | None: ...
    @property
    def reader(self) -> str: ...
    @property
    def verify_checksums(self) -> bool: ...
    @property
    def dask_scheduler(self) -> str: ...


def reading(store_or_path: Store | str | os.PathLike[str]) -> contextlib.AbstractContextManager[None]:
    """Hold a local store shared while it is read (:mod:`zckpt.io.locks`: an ingest cannot
    rewrite it meanwhile, and a reader is refused while one does); remote stores: nothing."""
    from zckpt.store.store import Store  # the store's modules (~25 ms): transform imports this module, opens no store

    if isinstance(store_or_path, Store):
        local = store_or_path.path if store_or_path.location is None else None
    else:
        local = None if isinstance(store_or_path, str) and remote.is_remote(store_or_path) else \
            remote.local_path(store_or_path)
    return contextlib.nullcontext() if local is None else locks.store_reading(local)


def check_coverage(store: Store, plan: ExportPlan) -> None:
    """Refuse to export from a store that lacks any region a destination rank needs, or
    whose manifest or checksum records are damaged (:meth:`Store.check_integrity`)."""
    store.check_integrity()
    if store.complete:
        return
    kinds = {e.name: e.kind for e in store.entries()}
    for rank in plan.ranks:
        for s in rank.slices:
            if kinds[s.name] == "str":
                continue
            missing = store.missing_in(s.name, s.box)
            if missing == [-1]:
                raise StoreError(
                    f"store is incomplete: destination rank {rank.rank} needs region {s.box.to_json()} that "
                    "no source shard covered",
                    path=store.path,
                    param=s.name,
                )
            if missing:
                raise StoreError(
                    f"store is incomplete: destination rank {rank.rank} needs data of source rank(s) {missing}, "
                    "which were never ingested",
                    path=store.path,
                    param=s.name,
                )


PACKED_GAP = 64 * 1024
"""Packed tensors of one batch at most this many bytes apart in their chunk file are read
with one call (the bytes between them are read only to be skipped)."""


class StoreReader:
    """Reads destination slices out of a store as lazy Dask arrays."""

    def __init__(self, store: Store, options: ReadOptions) -> None:
        self.store = store
        self.options = options
        self._entries = {e.name: e for e in store.entries()}
        self._lazy: dict[str, Any] = {}
        self._checked: Checked = set()
        local = store.location is None
        self.band_bytes = batch_bytes(options.block_bytes, wants_overlap(options.overlap), local=local)
        """Largest batch of slices read at once (more are in flight when reading ahead)."""
        self.batches_ahead = batches_ahead(local)
        self.read_bytes = 0
        self.checked_bytes = 0
        self._rows = bytearray()
        self._fetched: dict[_Span, memoryview] = {}
        """A remote store's ranges of the batch being read, fetched and checked together."""
        self._sizes: dict[Path, int] = {}
        """Sizes of the chunk and shard files this task copies ranges of."""
        """Chunk rows being cut (one band is read at a time): reused, so that each tile does
        not fault in fresh memory."""

    def kind(self, name: str) -> str:
        return self._entries[name].kind

    def ms_type(self, name: str) -> str:
        return self._entries[name].ms_type

    def string(self, name: str) -> str:
        return self._entries[name].value or ""

    def map_bytes(self, name: str) -> bytes:
        return np.asarray(self.store.array(name)[...]).tobytes()

    def lazy(self, name: str) -> Any:
        """``name`` as a lazy ``dask.array`` over its Zarr array (Dask is imported only here)."""
        import dask.array as da

        if name not in self._lazy:
            self._lazy[name] = da.from_zarr(self.store.array(name))  # type: ignore[no-untyped-call]
        return self._lazy[name]

    def bands(self, name: str, box: Box) -> list[Box]:
        """The slice cut into C-order pieces of at most ``band_bytes`` (rows, or parts of a row)."""
        if box.ndim == 0 or box.size == 0 or self._packed_whole(name, box):
            return [box]
        itemsize = ms_dtype(self._entries[name].ms_type).storage.itemsize
        return c_order_pieces(box, max(1, self.band_bytes // itemsize))

    def read_costs(self, name: str, boxes: Sequence[Box], corners: BoxCorners | None = None) -> int:
        """:meth:`read_cost` of each box, summed (:func:`zckpt.store.read_costs.boxes_cost`)."""
        e = self._entries[name]
        if len(boxes) < 8 or not e.shape or e.offset is not None:
            return sum(self.read_cost(name, b) for b in boxes)
        return read_costs.boxes_cost(self.store.chunk_info(name), boxes, self.options.reader == "zarr",
                                     self.options.verify_checksums, corners)

    def read_cost(self, name: str, box: Box) -> int:
        """Bytes reading ``box`` takes from the store (:func:`zckpt.store.read_costs.box_cost`;
        a packed tensor: its own bytes)."""
        if box.ndim == 0 or box.size == 0 or self._packed_whole(name, box):
            return box.size * ms_dtype(self._entries[name].ms_type).storage.itemsize
        return read_costs.box_cost(self.store.chunk_info(name), box, self.options.reader == "zarr",
                                   self.options.verify_checksums)

    def materialise(self, items: list[tuple[str, Box]]) -> list[np.ndarray]:
        """Read a batch of slices: raw chunk files directly, else concurrent Zarr reads, or
        one Dask computation of lazy views. Every chunk used is checked against its recorded
        checksum first (a chunk read whole is checked on the bytes just read)."""
        verify = self.options.verify_checksums
        if self.options.reader == "zarr":
            packed_ones = self._read_packed(items)
            try:
                self._fetch_ahead(items)
                direct = [packed_ones[i] if i in packed_ones else self._read_raw(name, box)
                          for i, (name, box) in enumerate(items)]
            finally:
                self._fetched.clear()
            rest = [(name, box) for (name, box), got in zip(items, direct, strict=True) if got is None]
            if verify:
                for name, box in rest:
                    self.checked_bytes += self.store.verify_chunks(name, box, self._checked)
            fetched = iter(self.store.read_many([(name, box.slices()) for name, box in rest]))
            result = [got if got is not None else next(fetched) for got in direct]
            self.read_bytes += sum(a.nbytes for a in result)
            return result
        if verify:
            for name, box in items:
                self.checked_bytes += self.store.verify_chunks(name, box, self._checked)
        lazy = [self.lazy(name)[box.slices()] if box.ndim else self.lazy(name) for name, box in items]
        import dask

        computed = dask.compute(*lazy, scheduler=self.options.dask_scheduler)  # type: ignore[attr-defined,no-untyped-call]
        arrays = [np.asarray(x) for x in computed]
        self.read_bytes += sum(a.nbytes for a in arrays)
        return arrays

    def _packed_whole(self, name: str, box: Box) -> bool:
        """Whether the slice is a whole packed tensor (:mod:`zckpt.store.packed`): such tensors
        are read together, many per call, instead of one file range each."""
        e = self._entries[name]
        return e.offset is not None and box.stop == e.shape and not any(box.start)

    def _read_packed(self, items: list[tuple[str, Box]]) -> dict[int, np.ndarray]:
        """The whole packed tensors of a batch (by position in ``items``): those that lie
        close together in one packed chunk file are read with one call and checked once per
        recorded block; each tensor is a view of the bytes read. A 100 000-tensor shard is
        then a few hundred reads, not 100 000 copies."""
        found: list[tuple[Path, str, int, int, int, int]] = []
        for i, (name, box) in enumerate(items):
            # a run's records cover its neighbours too: stores with a record per tensor read each alone
            if self._packed_whole(name, box) and box.size and self.store.record_owner(name) != name:
                info = self.store.chunk_info(name)
                if info.at is not None and info.folder is not None:
                    found.append((info.folder, info.at[0], info.at[1], info.inner_bytes, info.at[2], i))
        found.sort(key=lambda p: (str(p[0]), p[1], p[2]))
        out: dict[int, np.ndarray] = {}
        group: list[tuple[Path, str, int, int, int, int]] = []
        for place in [*found, None]:
            if (place is not None and group and place[:2] == group[-1][:2]
                    and place[2] - (group[-1][2] + group[-1][3]) <= PACKED_GAP):
                group.append(place)
                continue
            if group:
                self._read_packed_run(items, group, out)
            group = [place] if place is not None else []
        return out

    def _read_packed_run(self, items: list[tuple[str, Box]], group: list[tuple[Path, str, int, int, int, int]],
                         out: dict[int, np.ndarray]) -> None:
        folder, key, start, _, file_bytes, first = group[0]
        stop = max(at + n for _, _, at, n, _, _ in group)
        raw = np.empty(stop - start, dtype=np.uint8)
        self._read_span(items[first][0], _Span(key, folder / key, start, stop - start, file_bytes), raw)
        self.checked_bytes += raw.nbytes - sum(n for _, _, _, n, _, _ in group)
        for _, _, at, n, _, i in group:
            name, box = items[i]
            dtype = ms_dtype(self._entries[name].ms_type).storage
            out[i] = raw[at - start : at - start + n].view(dtype).reshape(box.shape)

    def _read_raw(self, name: str, box: Box) -> np.ndarray | None:
        """Read a slice straight from raw chunk (or shard) files when chunks span the array's
        full width: each chunk then holds whole rows, so the slice's rows are one byte range
        per chunk, and chunks that follow each other in a shard one range together.
        ``None`` when that does not hold (zarr reads it instead)."""
        arr = self.store.chunk_info(name)
        if box.size == 0 or not arr.raw:
            return None
        dtype = ms_dtype(self._entries[name].ms_type).storage
        if tuple(arr.chunks[1:]) != tuple(arr.shape[1:]):
            return self._read_tiles(name, box, dtype)
        spans = self._row_spans(name, _whole_rows(box, arr.shape), dtype.itemsize)
        if spans is None:
            return None
        if box.ndim == 0:
            out = np.empty((), dtype=dtype)
            self._read_spans(name, spans, out.reshape(-1).view(np.uint8))
            return out
        out = np.empty((box.shape[0],) + tuple(arr.shape[1:]), dtype=dtype)
        self._read_spans(name, spans, out.reshape(-1).view(np.uint8))
        if box.shape[1:] == tuple(arr.shape[1:]):
            return out
        self.checked_bytes += out.nbytes - box.size * dtype.itemsize
        return np.ascontiguousarray(out[(slice(None),) + box.slices()[1:]])

    def _row_spans(self, name: str, box: Box, itemsize: int) -> list[_Span] | None:
        """The byte ranges holding ``box``, whose trailing dimensions are exactly one chunk
        column: per chunk along dimension 0 the rows ``box`` takes, merged where they follow
        each other in one file. ``None`` when chunks are not raw local files."""
        info = self.store.chunk_info(name)
        if box.ndim == 0:
            at = self.store.chunk_at(name, ())
            return None if at is None else [_Span(at[0], at[1], at[2], itemsize, at[3])]
        rows = info.chunks[0]
        row_bytes = math.prod(info.chunks[1:]) * itemsize
        column = tuple(s // c for s, c in zip(box.start[1:], info.chunks[1:], strict=True))
        spans: list[_Span] = []
        first, stop = box.start[0], box.stop[0]
        for k in range(first // rows, (stop - 1) // rows + 1):
            at = self.store.chunk_at(name, (k, *column))
            if at is None:
                return None
            lo, hi = max(first, k * rows), min(stop, (k + 1) * rows)
            offset, length = at[2] + (lo - k * rows) * row_bytes, (hi - lo) * row_bytes
            last = spans[-1] if spans else None
            if last is not None and last.path == at[1] and last.offset + last.length == offset:
                spans[-1] = last._replace(length=last.length + length)  # the next chunk of the same shard
            else:
                spans.append(_Span(at[0], at[1], offset, length, at[3]))
        return spans

    def _read_spans(self, name: str, spans: list[_Span], dest: np.ndarray) -> None:
        """Fill ``dest`` (bytes) with ``spans`` one after another, each read with one call
        and checked on the bytes read."""
        pos = 0
        for sp in spans:
            self._read_span(name, sp, dest[pos : pos + sp.length])
            pos += sp.length
        if pos != len(dest):
            raise AssertionError(f"{name}: spans cover {pos} of {len(dest)} bytes")

    def _raw_spans(self, name: str, box: Box) -> list[_Span]:
        """The byte ranges :meth:`_read_raw` reads for ``box`` (none when it reads none)."""
        arr = self.store.chunk_info(name)
        if box.size == 0 or not arr.raw:
            return []
        itemsize = ms_dtype(self._entries[name].ms_type).storage.itemsize
        if tuple(arr.chunks[1:]) != tuple(arr.shape[1:]):
            parts = self._tile_parts(name, box, itemsize)
            return [] if parts is None else [_joined(group) for group in _runs(parts)]
        return self._row_spans(name, _whole_rows(box, arr.shape), itemsize) or []

    def _fetch_ahead(self, items: list[tuple[str, Box]]) -> None:
        """A remote store: fetch every raw chunk range the batch reads, together (coalesced,
        concurrent, retried) and checked, for :meth:`_read_span` to take."""
        if self.store.objects is None:
            return
        wanted: dict[_Span, str] = {}
        for name, box in items:
            for sp in self._raw_spans(name, box):
                if sp not in self._fetched:
                    wanted.setdefault(sp, name)  # two bands of one chunk's rows: fetched once
        if wanted:
            self._fetch([(name, sp) for sp, name in wanted.items()])

    def _fetch(self, wanted: list[tuple[str, _Span]]) -> None:
        assert self.store.objects is not None
        ranges = [ChunkRange(name, sp.key, sp.path, sp.offset, sp.length, sp.file_bytes,
                             self._block_checks(name, sp.key, sp.path, sp.file_bytes, sp.offset, sp.length))
                  for name, sp in wanted]
        self._fetched.update(zip((sp for _, sp in wanted), self.store.objects.read(ranges), strict=True))

    def _read_span(self, name: str, sp: _Span, dest: np.ndarray) -> None:
        if self.store.objects is not None:  # checked when fetched
            if sp not in self._fetched:
                self._fetch([(name, sp)])
            dest[:] = np.frombuffer(self._fetched[sp], dtype=np.uint8)
            return
        with self._open_chunk(name, sp.key, sp.path, sp.file_bytes) as f:
            got = os.preadv(f.fileno(), [dest.data], sp.offset)
        if got != sp.length:
            raise StoreError(f"chunk {sp.key} ended early: the store is damaged", path=sp.path, param=name)
        check = self._span_check(name, sp.key, sp.path, sp.file_bytes, sp.offset, sp.length)
        if check is not None:
            check(sp.offset, dest.data)

    def _read_tiles(self, name: str, box: Box, dtype: np.dtype) -> np.ndarray | None:
        """Read a slice from raw chunks of any shape: from each chunk, the rows the slice
        touches (one range; ranges that follow each other in a shard file are read as one)
        are read and checked, and the slice's part of them copied."""
        info = self.store.chunk_info(name)
        parts = self._tile_parts(name, box, dtype.itemsize)
        if parts is None:
            return None
        out = np.empty(box.shape, dtype=dtype)
        for group in _runs(parts):
            self._cut_group(name, group, box, out, info.chunks, dtype)
        return out

    def _tile_parts(self, name: str, box: Box, itemsize: int) -> list[_Part] | None:
        """Per chunk ``box`` touches, the chunk rows it takes, with the tile and the chunk's
        origin; ``None`` when chunks are not raw."""
        info = self.store.chunk_info(name)
        row_bytes = math.prod(info.chunks[1:]) * itemsize
        parts: list[_Part] = []
        for t in tiles(box, info.chunks):
            coords = tuple(a // c for a, c in zip(t.start, info.chunks, strict=True))
            at = self.store.chunk_at(name, coords)
            if at is None:
                return None
            origin = tuple(c * k for c, k in zip(coords, info.chunks, strict=True))
            r0, r1 = t.start[0] - origin[0], t.stop[0] - origin[0]
            parts.append((_Span(at[0], at[1], at[2] + r0 * row_bytes, (r1 - r0) * row_bytes, at[3]), t, origin))
        return parts

    def _cut_group(self, name: str, group: list[_Part], box: Box, out: np.ndarray,
                   chunks: tuple[int, ...], dtype: np.dtype) -> None:
        """Read chunk rows that follow each other in one file with one call, then copy each
        tile's part of its chunk rows into ``out``."""
        whole = _joined(group)
        raw = self._scratch_rows((whole.length,), np.dtype(np.uint8))
        self._read_span(name, whole, raw)
        pos = 0
        for sp, t, origin in group:
            rows = raw[pos : pos + sp.length].view(dtype).reshape((t.stop[0] - t.start[0], *chunks[1:]))
            pos += sp.length
            self.checked_bytes += rows.nbytes - t.size * dtype.itemsize
            local = tuple(slice(a - o, b - o) for a, b, o in zip(t.start[1:], t.stop[1:], origin[1:], strict=True))
            out[t.relative_to(box).slices()] = rows[(slice(None), *local)]

    def _scratch_rows(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = math.prod(shape) * dtype.itemsize
        if len(self._rows) < nbytes:
            self._rows = bytearray(nbytes)
        return np.frombuffer(self._rows, dtype=np.uint8, count=nbytes).view(dtype).reshape(shape)

    @staticmethod
    def _open_chunk(name: str, key: str, path: Path, chunk_bytes: int) -> BinaryIO:
        """A raw chunk (or shard) file, open for reading, refused by name when missing or of
        the wrong size."""
        try:
            f = safe_paths.open_binary(path, StoreError, name)
        except FileNotFoundError:
            raise _chunk_missing(name, key, path) from None
        try:
            _check_chunk_size(name, key, path, os.fstat(f.fileno()).st_size, chunk_bytes)
        except StoreError:
            f.close()
            raise
        return f

    def _span_check(self, name: str, key: str, path: Path, file_bytes: int, offset: int,
                    length: int) -> Sink | None:
        """How the bytes ``[offset, offset + length)`` of a chunk or shard file are checked as
        they are read or copied: a :class:`SpanCheck` over the recorded blocks they touch of
        each record (a chunk's, or the runs of a shard the range crosses), fed as one sink
        (``None`` when checks are off, nothing is recorded or those blocks were checked
        already). The parts of edge blocks outside the range count as read only to check."""
        if not self.options.verify_checksums:
            return None
        checks = []
        owner = self.store.record_owner(name)  # packed tensors share their run's blocks
        for rkey, want in self.store.records_over(name, key, offset, offset + length):
            part = want.covers(offset, offset + length)
            if part is None:
                continue
            size = want.length if want.length is not None else file_bytes
            blocks = want.blocks_in(part[0], part[1], size)
            if all((owner, rkey, i) in self._checked for i in blocks):
                continue
            self._checked.update((owner, rkey, i) for i in blocks)  # a failure aborts this file

            def fail(bad: Mismatch, want: ChunkSums = want) -> StoreError:
                return StoreError(f"chunk {key} fails its checksum ({want.where()}{bad}): the store is damaged",
                                  path=path, param=name)

            check = SpanCheck(path, want, size, part[0], part[1] - part[0], fail, base=want.origin)
            self.checked_bytes += check.extra
            checks.append(check)
        if not checks:
            return None
        return SpanChecks(checks).feed

    def _block_checks(self, name: str, key: str, path: Path, file_bytes: int, offset: int,
                      length: int) -> tuple[BlockCheck, ...]:
        """The checks of the recorded blocks that bytes ``[offset, offset + length)`` of a
        chunk or shard file touch, leaving out blocks this task checked already (at either
        end of the range: ranges that follow each other share their edge blocks), to run
        once the writer has copied the range. The parts of those blocks outside the range
        count as read only to check."""
        if not self.options.verify_checksums:
            return ()
        done = self._checked
        stop = offset + length
        parts = []
        for rkey, want in self.store.records_over(name, key, offset, stop):
            part = want.covers(offset, stop)
            if part is None:
                continue
            size = want.length if want.length is not None else file_bytes
            blocks = want.blocks_in(part[0], part[1], size)
            first, end = blocks.start, blocks.stop
            while first < end and (name, rkey, first) in done:
                first += 1
            while end > first and (name, rkey, end - 1) in done:
                end -= 1
            if first == end:
                continue
            done.update((name, rkey, i) for i in range(first, end))  # a failure aborts this file
            b = want.block_size(size)
            self.checked_bytes += max(0, part[0] - first * b) + max(0, min(size, end * b) - part[1])
            parts.append((want, size, first, end))
        if not parts:
            return ()

        def fail(want: ChunkSums, bad: Mismatch) -> StoreError:
            return StoreError(f"chunk {key} fails its checksum ({want.where()}{bad}): the store is damaged",
                              path=path, param=name)

        return (BlockCheck(path, tuple(parts), fail),)

    def file_ranges(self, name: str, box: Box) -> list[FileRange] | None:
        """The slice as byte ranges of raw chunk or shard files, when it is one: its
        trailing dimensions are exactly one chunk's (whole rows of the array, or one column
        block of a tensor-parallel split stored as its own chunks), so its rows are
        contiguous in each chunk, and chunks that follow each other in a shard give one
        range. The writer then copies them file to file, checking the blocks they cover in
        the same pass."""
        if self.options.reader != "zarr" or box.size == 0 or self._packed_whole(name, box) or self.store.is_remote:
            return None  # a whole packed tensor is read with its neighbours (_read_packed); no file remotely
        arr = self.store.chunk_info(name)
        if not arr.raw or not _one_chunk_column(box, arr.chunks):
            return None
        spans = self._row_spans(name, box, ms_dtype(self._entries[name].ms_type).storage.itemsize)
        if spans is None:
            return None
        out = []
        for sp in spans:
            size = self._sizes.get(sp.path)
            if size is None:  # once per shard file, not per range (a shard gives a file hundreds)
                size = safe_paths.regular_size(sp.path, StoreError, name)  # the writer opens it by name
                if size is None:
                    raise _chunk_missing(name, sp.key, sp.path)
                self._sizes[sp.path] = size
            _check_chunk_size(name, sp.key, sp.path, size, sp.file_bytes)
            checks = (_StoreCheck(self, name, sp),) if self.options.verify_checksums else ()
            out.append(FileRange(sp.path, sp.offset, sp.length, None, checks))
        self.read_bytes += sum(r.length for r in out)
        return out


class _Span(NamedTuple):
    """``length`` bytes at ``offset`` of the chunk or shard file ``path`` (key ``key``,
    ``file_bytes`` long when intact). A tuple: a 512-rank export makes tens of thousands."""

    key: str
    path: Path
    offset: int
    length: int
    file_bytes: int


@dataclass(frozen=True)
class _StoreCheck:
    """The checks of one copied range, worked out when the writer copies it (it reads the
    range's bytes through the blocks these checks read: :meth:`CkptWriter._copy_range`).
    Checks run in the order of the ranges, so blocks shared by ranges that follow each
    other are checked once."""

    reader: StoreReader
    name: str
    span: _Span

    @property
    def nbytes(self) -> int:
        return self.span.length

    def run(self, read_at: ReadAt) -> None:
        sp = self.span
        for check in self.reader._block_checks(self.name, sp.key, sp.path, sp.file_bytes, sp.offset, sp.length):
            check.run(read_at)


_Part = tuple[_Span, Box, tuple[int, ...]]
"""A tile of a slice: the chunk rows it takes, the tile, the chunk's origin."""


def _runs(parts: list[_Part]) -> list[list[_Part]]:
    """Parts whose chunk rows follow each other in one file, grouped (each group one read)."""
    groups: list[list[_Part]] = []
    for part in parts:
        if groups and _follows(groups[-1][-1][0], part[0]):
            groups[-1].append(part)
        else:
            groups.append([part])
    return groups


def _joined(group: list[_Part]) -> _Span:
    """The one range of a group of :func:`_runs`."""
    first = group[0][0]
    return _Span(first.key, first.path, first.offset, sum(sp.length for sp, _, _ in group), first.file_bytes)


def _whole_rows(box: Box, shape: tuple[int, ...]) -> Box:
    """The rows of ``box`` across the whole width of the array (a scalar: itself)."""
    if box.ndim == 0:
        return box
    return Box((box.start[0], *([0] * (box.ndim - 1))), (box.stop[0], *shape[1:]))


def _follows(a: _Span, b: _Span) -> bool:
    return a.path == b.path and a.offset + a.length == b.offset


def _chunk_missing(name: str, key: str, path: Path) -> StoreError:
    return StoreError(f"chunk {key} is missing: the store is damaged", path=path, param=name)


def _check_chunk_size(name: str, key: str, path: Path, size: int, chunk_bytes: int) -> None:
    """A raw chunk file holds exactly its chunk's values (a shard file its inner chunks and
    index); any other size means damage."""
    if size != chunk_bytes:
        raise StoreError(f"chunk {key} holds {size} bytes, not the {chunk_bytes} of its values: "
                         "the store is damaged", path=path, param=name)


def _one_chunk_column(box: Box, chunks: tuple[int, ...]) -> bool:
    """Whether ``box`` spans exactly one chunk in every dimension but the first (chunks
    are stored full size, edge chunks padded, so a narrower box would not be contiguous)."""
    return all(
        b - a == c and a % c == 0 for a, b, c in zip(box.start[1:], box.stop[1:], chunks[1:], strict=True)
    )
