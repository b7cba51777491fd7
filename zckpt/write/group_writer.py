"""Source-major writing: several destination files filled from one pass over their sources.

Written one after another, destination files re-read what they share: a column split of
row-stored tensors reads every row once per destination file (16 files, 16 reads of each
row), and files replicated over data parallelism read the same weights once per replica.
Here a group of files is written at once: each region of a tensor the group needs is read
once, in bands of bounded size (:class:`~zckpt.write.boxes.BandSource`, with its read-ahead),
and every file's part of a band is written at the offset its layout gives
(:mod:`zckpt.write.file_layouts`). Each file is still one new file, unnamed or under a
temporary name, published only when complete; each of its byte ranges has one writer.

Whether a group pays is decided from what the reader says reading costs (:func:`costs`, used by
:func:`zckpt.write.writers.source_major`) and from the size of the files' parts: files that
share nothing, or that the reader hands out as whole file ranges of some size, are cheaper
front to back (kernel copies, no pass through memory); thousands of small parts are cheaper
gathered (:mod:`zckpt.write.band_scatter`).
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.layout import Box
from zckpt.io import fileio
from zckpt.io.fileio import OpenFiles, Publisher, WriteBehind
from zckpt.io.gathered_writes import GatheredWrites
from zckpt.io.new_files import NewFile
from zckpt.plan.values import RankExport
from zckpt.run.progress import Ticker
from zckpt.write.band_scatter import Region, blocks, scatter_blocks, scatter_boxes, whole_rows
from zckpt.write.boxes import BandSource, BoxCorners, BoxReader, RankResult, WriterSettings, reading_ahead
from zckpt.write.file_layouts import FileLayout, Layout

GAIN = 1.1
"""Group when writing the files one by one would read more than this many times the bytes
(zckpt reads at most 1.1x what a destination needs: pp4xtp8xdp16 -> tp16 one by one read 1.28x,
grouped 1.00x and less CPU)."""

SMALL_PIECE = 256 * 1024
"""Mean bytes of a file's part of a tensor below which a group pays already when it reads
no more than the files one by one: one pass over large bands and one gathered write per
part, instead of a read and a write call per part (a scale-up to 512 ranks: 144 000 parts of
15 KiB, 13.7 -> 6.2 s CPU)."""

SPLIT_COST = 1.25
"""Cut a group in two (one per process) only when the halves read at most this many times
what the whole group reads: halves of a column split each read every row."""

MAX_FILES = 1024
"""Files of one group at most (each holds an open descriptor and a gathering buffer while
the group is written): 1024 destination ranks cut into groups of 256 read the chunks at the
groups' borders in part, each part with a checksum block more (1.27x what was needed); fewer
where the process may not open that many files (:func:`max_files`)."""


class CostedReader(BoxReader, Protocol):
    """A reader that can say what reading a box costs before reading it."""

    def read_costs(self, name: str, boxes: Sequence[Box], corners: BoxCorners | None = None) -> int:
        """Bytes reading each of ``boxes`` of ``name`` apart takes from where the bytes live
        (one call per entry: a plan of 512 files asks it for 50 000 slices). ``corners``: the
        boxes' starts and stops as arrays, when the caller has them (every box non-empty)."""
        ...


def regions(ranks: Sequence[RankExport], kinds: dict[str, str]) -> list[Region]:
    """What a group reads, tensor by tensor in the files' order: the bounding box of the
    files' slices where they cover it (a split, or replicas), else runs of slices that
    follow each other along the first dimension (a group holding part of a row split), each
    read once."""
    return _regions(_columns(ranks, kinds))


@dataclass(frozen=True)
class _Column:
    """One tensor's non-empty slices in a list of files: (position of the file, box) in the
    files' order, and the boxes' corners as arrays, so that a group's prices and regions are
    worked out on arrays (a scale-up to 1 024 ranks: 150 000 slices) and any run of the
    files is a slice of them."""

    parts: list[tuple[int, Box]]
    pos: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def between(self, first: int, stop: int) -> _Column:
        """The slices of the files at positions ``[first, stop)``."""
        a, b = (int(x) for x in np.searchsorted(self.pos, [first, stop]))
        return _Column(self.parts[a:b], self.pos[a:b], self.lo[a:b], self.hi[a:b])


def _column(parts: list[tuple[int, Box]]) -> _Column | None:
    """The :class:`_Column` of ``parts`` (ascending positions), empty boxes left out."""
    nd = parts[0][1].ndim
    corners = np.array([b.start + b.stop for _, b in parts], dtype=np.int64).reshape(len(parts), 2 * nd)
    pos = np.array([i for i, _ in parts], dtype=np.int64)
    lo, hi = corners[:, :nd], corners[:, nd:]
    if nd:
        keep = (hi > lo).all(axis=1)
        if not keep.all():
            idx = np.flatnonzero(keep)
            parts, pos, lo, hi = [parts[i] for i in idx], pos[idx], lo[idx], hi[idx]
    return _Column(parts, pos, lo, hi) if parts else None


def _columns(ranks: Sequence[RankExport], kinds: dict[str, str]) -> dict[str, _Column]:
    """Each tensor's :class:`_Column`, in the files' order. Ranks that list the same names
    (data-parallel replicas of one layout: all 512 of a scale-up) are read column by
    column, a name at a time."""
    by_name: dict[str, list[tuple[int, Box]]] = {}
    first = ranks[0].names if ranks else ()
    if all(r.names == first for r in ranks):
        for name, column in zip(first, zip(*(r.slices for r in ranks), strict=True), strict=True):
            if kinds[name] == "tensor":
                by_name[name] = list(enumerate(s.box for s in column))
    else:
        for i, r in enumerate(ranks):
            for s in r.slices:
                if kinds[s.name] == "tensor":
                    by_name.setdefault(s.name, []).append((i, s.box))
    out: dict[str, _Column] = {}
    for name, parts in by_name.items():
        col = _column(parts)
        if col is not None:
            out[name] = col
    return out


def _regions(columns: dict[str, _Column]) -> list[Region]:
    out: list[Region] = []
    for name, col in columns.items():
        parts, nd = col.parts, col.lo.shape[1]
        if nd == 0:
            out.append(Region(name, parts[0][1], tuple(parts)))
            continue
        distinct, first, inverse = np.unique(np.concatenate([col.lo, col.hi], axis=1), axis=0,
                                             return_index=True, return_inverse=True)
        lo, hi = distinct[:, :nd], distinct[:, nd:]
        whole = Box(tuple(col.lo.min(axis=0).tolist()), tuple(col.hi.max(axis=0).tolist()))
        if whole.size <= int((hi - lo).prod(axis=1).sum()):
            out.append(Region(name, whole, tuple(parts), (col.pos, col.lo, col.hi)))
            continue
        run = _row_runs(lo, hi, first)[inverse.reshape(-1)]  # each part's run
        order = np.argsort(run, kind="stable")
        cuts = np.flatnonzero(np.diff(run[order])) + 1
        for members in np.split(order, cuts):
            lo_m, hi_m = col.lo[members], col.hi[members]
            box = Box(tuple(lo_m.min(axis=0).tolist()), tuple(hi_m.max(axis=0).tolist()))
            out.append(Region(name, box, tuple(parts[i] for i in members.tolist()), (col.pos[members], lo_m, hi_m)))
    return out


def _row_runs(lo: np.ndarray, hi: np.ndarray, first: np.ndarray) -> np.ndarray:
    """The run of each of the distinct boxes ``lo``, ``hi`` (``first``: where each first
    appears among the parts), runs numbered in the order they are read: runs whose union is
    a box, of boxes with the same extent past the first dimension and rows that touch or
    overlap, ordered by that extent, then by first row (then by first appearance)."""
    n, nd = lo.shape
    keys = [first, lo[:, 0], *(hi[:, d] for d in range(nd - 1, 0, -1)), *(lo[:, d] for d in range(nd - 1, 0, -1))]
    order = np.lexsort(keys)
    slo, shi = lo[order], hi[order]
    new = np.ones(n, dtype=bool)
    new[1:] = (slo[1:, 1:] != slo[:-1, 1:]).any(axis=1) | (shi[1:, 1:] != shi[:-1, 1:]).any(axis=1)
    extent = np.cumsum(new) - 1
    span = int(shi[:, 0].max()) + 1
    reach = np.maximum.accumulate(extent * span + shi[:, 0])  # furthest row so far, per extent
    new[1:] |= extent[1:] * span + slo[1:, 0] > reach[:-1]
    out = np.empty(n, dtype=np.int64)
    out[order] = np.cumsum(new) - 1
    return out


def small_pieces(reader: BoxReader, ranks: Sequence[RankExport]) -> bool:
    """Whether the files' parts of their tensors are below :data:`SMALL_PIECE` on average."""
    itemsizes: dict[str, int] = {}  # 0: not a tensor
    count = total = 0
    for r in ranks:
        for s in r.slices:
            itemsize = itemsizes.get(s.name)
            if itemsize is None:
                itemsize = itemsizes[s.name] = (ms_dtype(reader.ms_type(s.name)).storage.itemsize
                                                if reader.kind(s.name) == "tensor" else 0)
            if itemsize:
                count += 1
                total += s.box.size * itemsize
    return count > 0 and total < SMALL_PIECE * count


class Prices:
    """What reading groups of ``ranks`` costs, each group a run of their positions: each
    tensor's slices are taken from the files once, whatever the groups asked about."""

    def __init__(self, reader: CostedReader, ranks: Sequence[RankExport]) -> None:
        self.reader = reader
        self.columns = _columns(ranks, _kinds(reader, ranks))

    def _of(self, first: int, stop: int) -> dict[str, _Column]:
        cut = {name: col.between(first, stop) for name, col in self.columns.items()}
        return {name: col for name, col in cut.items() if col.parts}

    def alone(self, first: int, stop: int) -> int:
        """Bytes read to write the files at ``[first, stop)`` one by one."""
        return sum(self.reader.read_costs(name, [b for _, b in col.parts],
                                          (col.lo, col.hi) if col.lo.shape[1] else None)
                   for name, col in self._of(first, stop).items())

    def together(self, first: int, stop: int) -> int:
        """Bytes read to write the files at ``[first, stop)`` as one group."""
        return _read_cost(self.reader, _regions(self._of(first, stop)))


def _read_cost(reader: CostedReader, todo: Sequence[Region]) -> int:
    read: dict[str, list[Box]] = {}
    for g in todo:
        read.setdefault(g.name, []).append(g.box)
    return sum(reader.read_costs(name, boxes) for name, boxes in read.items())


def _kinds(reader: BoxReader, ranks: Sequence[RankExport]) -> dict[str, str]:
    return {name: reader.kind(name) for name in dict.fromkeys(n for r in ranks for n in r.names)}


def max_files() -> int:
    """:data:`MAX_FILES`, or half the descriptors this process may open where that is fewer."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return min(MAX_FILES, 256)
    if soft == resource.RLIM_INFINITY:
        return MAX_FILES
    return max(16, min(MAX_FILES, (soft - 128) // 2))


def groups(ranks: Sequence[RankExport], count: int = 1) -> list[list[int]]:
    """Positions of ``ranks`` cut into ``count`` (or more, of at most :data:`MAX_FILES`) runs
    of neighbours: neighbouring ranks share the most."""
    n = len(ranks)
    parts = max(count, -(-n // max_files()), 1)
    size = -(-n // parts)
    return [list(range(a, min(n, a + size))) for a in range(0, n, size)]


@dataclass(frozen=True)
class GroupWriter:
    """Writes a group of destination files of one format from one pass over ``reader``."""

    layout: Layout
    settings: WriterSettings = WriterSettings()

    def write(self, reader: BoxReader, files: Sequence[tuple[RankExport, Path]], ticker: Ticker | None = None,
              publisher: Publisher | None = None) -> list[RankResult]:
        ranks = [r for r, _ in files]
        distinct, kinds_of_files = shared_layouts(self.layout, reader, ranks)
        layouts = [distinct[k] for k in kinds_of_files]
        kinds = {s.name: reader.kind(s.name) for r in ranks for s in r.slices}
        with contextlib.ExitStack() as stack:
            news: list[NewFile] = []
            for (_, path), layout in zip(files, layouts, strict=True):
                path.parent.mkdir(parents=True, exist_ok=True)
                new = NewFile(path)
                news.append(new)
                stack.callback(new.discard)
                _size(new, layout, path)
            behind = stack.enter_context(WriteBehind(OpenFiles({str(p): n.file.fileno()
                                                                for (_, p), n in zip(files, news, strict=True)})))
            out = GatheredWrites([n.file.fileno() for n in news], [p for _, p in files],
                                 [x.framing for x in distinct], kinds_of_files, behind=behind)
            todo = regions(ranks, kinds)
            helper = stack.enter_context(reading_ahead(self.settings.overlap))
            source = BandSource(reader, [(g.name, g.box) for g in todo], helper)
            for g in todo:
                itemsize = ms_dtype(reader.ms_type(g.name)).storage.itemsize
                parts = blocks(g, itemsize, layouts)
                for band in reader.bands(g.name, g.box):
                    data = source.next(g.name)
                    if parts is None or not whole_rows(band, g.box):
                        scatter_boxes(g, band, data, itemsize, out, layouts)
                    else:
                        scatter_blocks(g.name, parts, band, data, out, layouts)
                if ticker is not None:
                    done = parts.nbytes() if parts is not None else sum(b.size for _, b in g.parts) * itemsize
                    ticker.add(g.name, done)
            out.close()
            behind.close()
            stack.pop_all()
            if publisher is not None:
                publisher.submit_all(news)
            else:
                fileio.publish_all(news, self.settings.fsync)
        if ticker is not None:
            ticker.close()
        return _results(files, layouts, reader)


def shared_layouts(layout: Layout, reader: BoxReader,
                   ranks: Sequence[RankExport]) -> tuple[list[FileLayout], list[int]]:
    """The distinct file layouts of ``ranks``, each worked out once per distinct list of
    (name, shape) (a layout depends on nothing else: 512 data-parallel ranks hold a few
    distinct lists), and for each rank the position of its own."""
    seen: dict[tuple[tuple[str, tuple[int, ...]], ...], int] = {}
    distinct: list[FileLayout] = []
    kinds: list[int] = []
    for r in ranks:
        key = tuple((s.name, s.box.shape) for s in r.slices)
        k = seen.get(key)
        if k is None:
            k = seen[key] = len(distinct)
            distinct.append(layout(reader, r.slices))
        kinds.append(k)
    return distinct, kinds


def _size(new: NewFile, layout: FileLayout, path: Path) -> None:
    """Size the new file; its framing is written with its data, as the data reach it."""
    fd = new.file.fileno()
    if not fileio.allocate(fd, layout.size, path):
        with fileio.disk_full_named(path):
            os.ftruncate(fd, layout.size)


def _results(files: Sequence[tuple[RankExport, Path]], layouts: list[FileLayout],
             reader: BoxReader) -> list[RankResult]:
    """One result per file; the group's bytes read are shared out in proportion to size
    (whole bytes that add up to the group's)."""
    total = sum(x.size for x in layouts) or 1
    out, before = [], 0
    for (rank, path), layout in zip(files, layouts, strict=True):
        after = before + layout.size
        read = reader.read_bytes * after // total - reader.read_bytes * before // total
        checked = reader.checked_bytes * after // total - reader.checked_bytes * before // total
        out.append(RankResult(rank.rank, str(path), layout.tensors, layout.size, read, checked))
        before = after
    return out
