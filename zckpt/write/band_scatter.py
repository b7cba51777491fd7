"""The part of a band that each file of a source-major group receives.

A group (:mod:`zckpt.write.group_writer`) reads a region of a tensor once, band by band,
and hands every file its part of each band. At a scale-up to 512 ranks that is 144 000
parts of a few KiB: with a box intersection, a view, a copy and an offset per part in
Python, the parts cost more than the bytes. The parts of a region are nearly always
blocks of its rows (an optimizer or row split: whole rows; a column split: a range of the
second dimension in each row), so they are held as arrays (:class:`Blocks`) and a band's
share of all of them is found with a few array operations; what is left per part is one
slice and one gathered write (:class:`~zckpt.io.gathered_writes.GatheredWrites`). Any other
part goes through :func:`scatter_boxes`, box by box.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from zckpt.core.layout import Box
from zckpt.io import fileio
from zckpt.io.gathered_writes import GatheredWrites
from zckpt.io.new_files import NewFile
from zckpt.write.file_layouts import FileLayout, data_offset


@dataclass(frozen=True)
class Region:
    """A box of one tensor read once, and the files (by position) with the part of it they hold."""

    name: str
    box: Box
    parts: tuple[tuple[int, Box], ...]


@dataclass(frozen=True)
class Blocks:
    """A region's parts as row ranges and column ranges (region coordinates) of its rows,
    all of them spanning the region past the second dimension; ``base`` holds the file
    offset of each part's first byte where every part lies in one run of its file."""

    files: list[int]
    first: np.ndarray
    stop: np.ndarray
    col0: list[int]
    col1: list[int]
    cols: int
    inner: int
    itemsize: int
    base: np.ndarray | None = None

    def part_row_bytes(self, k: int) -> int:
        return (self.col1[k] - self.col0[k]) * self.inner * self.itemsize


def blocks(g: Region, itemsize: int, layouts: Sequence[FileLayout] = ()) -> Blocks | None:
    """The parts of ``g`` as :class:`Blocks`, or ``None`` where one is cut past the second
    dimension (or the tensor is a scalar). Given the files' ``layouts``, each part's file
    offset is kept where its tensor is one run of its file (one ``.ckpt`` Value)."""
    box = g.box
    if box.ndim == 0:
        return None
    rest = (box.start[2:], box.stop[2:])
    if any((b.start[2:], b.stop[2:]) != rest for _, b in g.parts):
        return None
    c = box.start[1] if box.ndim > 1 else 0
    files = [i for i, _ in g.parts]
    return Blocks(
        files=files,
        first=np.array([b.start[0] for _, b in g.parts], dtype=np.int64),
        stop=np.array([b.stop[0] for _, b in g.parts], dtype=np.int64),
        col0=[b.start[1] - c if box.ndim > 1 else 0 for _, b in g.parts],
        col1=[b.stop[1] - c if box.ndim > 1 else 1 for _, b in g.parts],
        cols=box.shape[1] if box.ndim > 1 else 1,
        inner=math.prod(box.shape[2:]),
        itemsize=itemsize,
        base=_bases(g.name, files, layouts) if layouts else None,
    )


def _bases(name: str, files: list[int], layouts: Sequence[FileLayout]) -> np.ndarray | None:
    """File offset of the tensor's data in each of ``files``, or ``None`` where one file
    holds it in several Values."""
    out = []
    for i in files:
        segments = layouts[i].segments[name]
        if len(segments) != 1:
            return None
        out.append(segments[0].offset)
    return np.array(out, dtype=np.int64)


def whole_rows(band: Box, region: Box) -> bool:
    """Whether ``band`` is whole rows of ``region`` (else it is part of one row)."""
    return band.ndim > 0 and band.start[1:] == region.start[1:] and band.stop[1:] == region.stop[1:]


def scatter_blocks(name: str, parts: Blocks, band: Box, data: np.ndarray, news: list[NewFile],
                   fills: list[GatheredWrites], layouts: list[FileLayout]) -> None:
    """Give each file its part of ``band`` (whole rows of the region): a run of the band's
    bytes where the part spans the row, else one strided copy of its columns."""
    b0, b1 = band.start[0], band.stop[0]
    lo = np.maximum(parts.first, b0)
    hi = np.minimum(parts.stop, b1)
    hit = np.flatnonzero(lo < hi)
    if not hit.size:
        return
    grid = np.ascontiguousarray(data).reshape(b1 - b0, parts.cols, parts.inner)
    flat = grid.reshape(-1).view(np.uint8).data
    full_row = parts.cols * parts.inner * parts.itemsize
    row_bytes = (np.array(parts.col1)[hit] - np.array(parts.col0)[hit]) * (parts.inner * parts.itemsize)
    at = (lo[hit] - parts.first[hit]) * row_bytes
    i = -1
    try:
        if parts.base is not None:
            for i, part in _runs(parts, hit, (lo[hit] - b0).tolist(), (hi[hit] - b0).tolist(),
                                 (parts.base[hit] + at).tolist(), grid, flat, full_row):
                fills[i].add(*part)
            return
        for k, r0, r1, start in zip(hit.tolist(), (lo[hit] - b0).tolist(), (hi[hit] - b0).tolist(), at.tolist(),
                                    strict=True):
            i = parts.files[k]
            raw = _rows(parts, k, r0, r1, grid, flat, full_row)
            fill = fills[i]
            for offset, s0, length in layouts[i].places(name, start, len(raw)):
                fill.add(offset, raw[s0 : s0 + length])
    except OSError as err:
        full = fileio.as_disk_full(err, news[i].path) if i >= 0 else None
        if full is None:
            raise
        raise full from None


def _runs(parts: Blocks, hit: np.ndarray, r0s: list[int], r1s: list[int], offsets: list[int], grid: np.ndarray,
          flat: memoryview, full_row: int) -> Iterator[tuple[int, tuple[int, memoryview]]]:
    """Each hit part's file and ``(file offset, bytes)``, the offsets worked out on arrays:
    one slice per part (the common case, where each part is one run of its file)."""
    files, col0, col1, cols = parts.files, parts.col0, parts.col1, parts.cols
    for k, r0, r1, offset in zip(hit.tolist(), r0s, r1s, offsets, strict=True):
        if col1[k] - col0[k] == cols:
            yield files[k], (offset, flat[r0 * full_row : r1 * full_row])
        else:
            yield files[k], (offset, _rows(parts, k, r0, r1, grid, flat, full_row))


def _rows(parts: Blocks, k: int, r0: int, r1: int, grid: np.ndarray, flat: memoryview, full_row: int) -> memoryview:
    """Part ``k``'s bytes in rows ``[r0, r1)`` of the band."""
    c0, c1 = parts.col0[k], parts.col1[k]
    if c1 - c0 == parts.cols:
        return flat[r0 * full_row : r1 * full_row]
    return np.ascontiguousarray(grid[r0:r1, c0:c1]).reshape(-1).view(np.uint8).data


def scatter_boxes(g: Region, band: Box, data: np.ndarray, itemsize: int, news: list[NewFile],
                  fills: list[GatheredWrites], layouts: list[FileLayout]) -> None:
    """Give each file its part of ``band``, box by box (its bytes are contiguous in the file:
    a band is a C-order piece of the region, and the region spans each part's trailing extents)."""
    for i, box in g.parts:
        inter = band.intersect(box)
        if inter is None or (inter.ndim and not inter.size):
            continue
        piece = np.ascontiguousarray(data[inter.relative_to(band).slices()] if band.ndim else data)
        raw = piece.reshape(-1).view(np.uint8)
        fill = fills[i]
        with fileio.disk_full_named(news[i].path):
            for offset, start, n in layouts[i].places(g.name, data_offset(inter, box, itemsize), raw.nbytes):
                fill.add(offset, raw[start : start + n].data)
