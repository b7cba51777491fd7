"""The part of a band that each file of a source-major group receives.

A group (:mod:`zckpt.write.group_writer`) reads a region of a tensor once, band by band,
and hands every file its part of each band. At a scale-up to 512 ranks that is 144 000
parts of a few KiB: with a box intersection, a view, a copy and an offset per part in
Python, the parts cost more than the bytes. The parts of a region are nearly always
blocks of its rows (an optimizer or row split: whole rows; a column split: a range of the
second dimension in each row), so they are held as arrays (:class:`Blocks`) and a band's
share of all of them is found with a few array operations. Where the parts of one size tile
the band on a grid (row blocks x column blocks, replicas sharing one), they are cut out
with one strided copy and handed to all their files at once
(:class:`~zckpt.io.gathered_writes.GatheredWrites`): a band costs a few array operations,
whatever its number of parts. Other parts go one by one; parts cut past the second
dimension through :func:`scatter_boxes`, box by box.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import as_strided

from zckpt.core.layout import Box
from zckpt.io.gathered_writes import GatheredWrites
from zckpt.write.file_layouts import FileLayout, data_offset


@dataclass(frozen=True)
class Region:
    """A box of one tensor read once, and the files (by position) with the part of it they hold."""

    name: str
    box: Box
    parts: tuple[tuple[int, Box], ...]
    corners: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, compare=False)
    """The parts as arrays where the caller has them: positions, starts, stops (a scale-up
    to 1 024 ranks: 150 000 parts, each a box that :func:`blocks` would take apart again)."""


@dataclass(frozen=True)
class Blocks:
    """A region's parts as row ranges and column ranges (region coordinates) of its rows,
    all of them spanning the region past the second dimension; ``base`` holds the file
    offset of each part's first byte where every part lies in one run of its file."""

    files: np.ndarray
    first: np.ndarray
    stop: np.ndarray
    col0: np.ndarray
    col1: np.ndarray
    cols: int
    inner: int
    itemsize: int
    base: np.ndarray | None = None

    def nbytes(self) -> int:
        """Bytes of all the parts together (replicas each counted)."""
        return int(((self.stop - self.first) * (self.col1 - self.col0)).sum()) * self.inner * self.itemsize


def blocks(g: Region, itemsize: int, layouts: Sequence[FileLayout] = ()) -> Blocks | None:
    """The parts of ``g`` as :class:`Blocks`, or ``None`` where one is cut past the second
    dimension (or the tensor is a scalar). Given the files' ``layouts``, each part's file
    offset is kept where its tensor is one run of its file (one ``.ckpt`` Value)."""
    box = g.box
    n = box.ndim
    if n == 0:
        return None
    if g.corners is not None:
        files, lo, hi = g.corners
    else:
        corners = np.array([b.start + b.stop for _, b in g.parts], dtype=np.int64).reshape(len(g.parts), 2 * n)
        files, lo, hi = np.array([i for i, _ in g.parts], dtype=np.int64), corners[:, :n], corners[:, n:]
    if n > 2 and not ((lo[:, 2:] == box.start[2:]).all() and (hi[:, 2:] == box.stop[2:]).all()):
        return None
    return Blocks(
        files=files,
        first=lo[:, 0],
        stop=hi[:, 0],
        col0=lo[:, 1] - box.start[1] if n > 1 else np.zeros(len(files), dtype=np.int64),
        col1=hi[:, 1] - box.start[1] if n > 1 else np.ones(len(files), dtype=np.int64),
        cols=box.shape[1] if n > 1 else 1,
        inner=math.prod(box.shape[2:]),
        itemsize=itemsize,
        base=_bases(g.name, files, layouts) if layouts else None,
    )


def _bases(name: str, files: np.ndarray, layouts: Sequence[FileLayout]) -> np.ndarray | None:
    """File offset of the tensor's data in each of ``files``, or ``None`` where one file
    holds it in several Values. Files share their layout objects (one per distinct list of
    entries), so each distinct layout is asked once."""
    offsets: dict[int, int] = {}
    out = np.empty(len(files), dtype=np.int64)
    for j, i in enumerate(files.tolist()):
        layout = layouts[i]
        at = offsets.get(id(layout))
        if at is None:
            segments = layout.segments[name]
            if len(segments) != 1:
                return None
            at = offsets[id(layout)] = segments[0].offset
        out[j] = at
    return out


def whole_rows(band: Box, region: Box) -> bool:
    """Whether ``band`` is whole rows of ``region`` (else it is part of one row)."""
    return band.ndim > 0 and band.start[1:] == region.start[1:] and band.stop[1:] == region.stop[1:]


def scatter_blocks(name: str, parts: Blocks, band: Box, data: np.ndarray, out: GatheredWrites,
                   layouts: Sequence[FileLayout]) -> None:
    """Give each file its part of ``band`` (whole rows of the region). Parts of one size
    that tile the band on a grid (a row split, a column split, both) are cut out with one
    strided copy and handed to their files with one gathered write; any other part alone."""
    b0, b1 = band.start[0], band.stop[0]
    lo = np.maximum(parts.first, b0)
    hi = np.minimum(parts.stop, b1)
    hit = np.flatnonzero(lo < hi)
    if not hit.size:
        return
    item = parts.inner * parts.itemsize
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape(b1 - b0, parts.cols * item)
    r0, rows = lo[hit] - b0, hi[hit] - lo[hit]
    c0, width = parts.col0[hit], parts.col1[hit] - parts.col0[hit]
    at = (lo[hit] - parts.first[hit]) * width * item
    files = parts.files[hit]
    if parts.base is None:
        for j in range(hit.size):
            piece = raw[r0[j] : r0[j] + rows[j], c0[j] * item : (c0[j] + width[j]) * item].reshape(-1)
            i = int(files[j])
            for offset, s0, length in layouts[i].places(name, int(at[j]), piece.size):
                out.put_one(i, offset, piece[s0 : s0 + length])
        return
    offsets = parts.base[hit] + at
    for sel in _same(rows, width):
        n, w = int(rows[sel[0]]), int(width[sel[0]])
        cut = _grid(raw, r0[sel], c0[sel], n, w * item, item)
        if cut is not None:
            pieces, order, shared = cut
            out.put(files[sel][order], offsets[sel][order], pieces, shared)
            continue
        for j in sel.tolist():
            out.put_one(int(files[j]), int(offsets[j]), raw[r0[j] : r0[j] + n, c0[j] * item : (c0[j] + w) * item])


def _same(rows: np.ndarray, width: np.ndarray) -> list[np.ndarray]:
    """Positions split by equal ``(rows, width)``."""
    if bool((rows == rows[0]).all()) and bool((width == width[0]).all()):
        return [np.arange(rows.size)]
    key = rows * (int(width.max()) + 1) + width
    order = np.argsort(key, kind="stable")
    return list(np.split(order, np.flatnonzero(np.diff(key[order])) + 1))


def _grid(raw: np.ndarray, r0: np.ndarray, c0: np.ndarray, rows: int, width: int,
          item: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """The parts of ``rows`` rows and ``width`` bytes at band rows ``r0`` and columns ``c0``
    cut out of ``raw`` on a regular grid, one distinct part per row of the result; the order
    of the parts that matches, and where parts repeat (replicas) which row each one is;
    ``None`` where the parts are not on a grid."""
    key = r0 * (int(c0.max()) + 1) + c0
    order = np.argsort(key, kind="stable")
    key, r0, c0 = key[order], r0[order], c0[order]
    first = np.ones(key.size, dtype=bool)
    first[1:] = key[1:] != key[:-1]
    if not first.all():  # replicas: one part for several files
        cut = _grid(raw, r0[first], c0[first], rows, width, item)
        if cut is None:
            return None
        return cut[0], order, np.cumsum(first) - 1
    cs = np.flatnonzero(r0 == r0[0]).size
    if r0.size % cs:
        return None
    grid_r, grid_c = r0.reshape(-1, cs), c0.reshape(-1, cs)
    dr = int(grid_r[1, 0] - grid_r[0, 0]) if grid_r.shape[0] > 1 else 0
    dc = int(grid_c[0, 1] - grid_c[0, 0]) if cs > 1 else 0
    if (grid_r != grid_r[0, 0] + dr * np.arange(grid_r.shape[0])[:, None]).any() or \
            (grid_c != grid_c[0, 0] + dc * np.arange(cs)[None, :]).any():
        return None
    line = raw.strides[0]
    origin = raw.reshape(-1)[int(r0[0]) * line + int(c0[0]) * item :]
    if cs == 1 and width == line:
        pieces = as_strided(origin, (r0.size, rows * line), (dr * line, 1), writeable=False)
    else:
        grid = as_strided(origin, (grid_r.shape[0], cs, rows, width), (dr * line, dc * item, line, 1),
                          writeable=False)
        pieces = np.ascontiguousarray(grid).reshape(r0.size, rows * width)
    return pieces, order, None


def scatter_boxes(g: Region, band: Box, data: np.ndarray, itemsize: int, out: GatheredWrites,
                  layouts: Sequence[FileLayout]) -> None:
    """Give each file its part of ``band``, box by box (its bytes are contiguous in the file:
    a band is a C-order piece of the region, and the region spans each part's trailing extents)."""
    for i, box in g.parts:
        inter = band.intersect(box)
        if inter is None or (inter.ndim and not inter.size):
            continue
        piece = np.ascontiguousarray(data[inter.relative_to(band).slices()] if band.ndim else data)
        raw = piece.reshape(-1).view(np.uint8)
        for offset, start, n in layouts[i].places(g.name, data_offset(inter, box, itemsize), raw.nbytes):
            out.put_one(i, offset, raw[start : start + n])
