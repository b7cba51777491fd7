"""What reading boxes of an array costs in bytes taken from the store, from its chunk layout alone.

Writers choose between writing files one by one and writing a group source-major from what
a reader says reading would cost (:func:`zckpt.write.writers.source_major`), and a plan of 512
destination files prices 144 000 slices: so the price is layout maths here, vectorised for
many boxes, apart from the reader that reads them (:class:`zckpt.store.reader.StoreReader`).
Raw chunks, local or remote, are read by chunk rows (and checked one checksum block beyond a
range at most), encoded ones whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from zckpt.core.layout import Box
from zckpt.io.checksums import BLOCK_BYTES
from zckpt.store.geometry import ChunkInfo
from zckpt.write.boxes import BoxCorners


def box_cost(info: ChunkInfo, box: Box, by_rows: bool, verify: bool) -> int:
    """Bytes reading ``box`` (not empty, not a scalar) takes: whole chunk rows of every chunk
    it touches (raw chunks read ``by_rows``), whole chunks (encoded ones); with checksum checks
    (``verify``), about one checksum block more per chunk it takes part of."""
    row = math.prod(info.chunks[1:]) * info.itemsize
    touched = math.prod(len(range(a // c, (b - 1) // c + 1))
                        for a, b, c in zip(box.start[1:], box.stop[1:], info.chunks[1:], strict=True))
    rows = len(range(box.start[0] // info.chunks[0], (box.stop[0] - 1) // info.chunks[0] + 1))
    if not info.raw or not by_rows:
        return rows * info.chunks[0] * row * touched
    span = box.shape[0] * row * touched
    if not verify:
        return span
    part = max(0, rows * touched * info.chunks[0] * row - span)  # rows of those chunks not read
    return span + min(part, rows * touched * BLOCK_BYTES)


def boxes_cost(info: ChunkInfo, boxes: Sequence[Box], by_rows: bool, verify: bool,
               corners: BoxCorners | None = None) -> int:
    """:func:`box_cost` of each box, summed, in a few array operations (``corners``: the
    boxes' starts and stops as arrays, when the caller has them)."""
    if corners is not None:
        start, stop = corners
    else:
        start = np.array([b.start for b in boxes], dtype=np.int64).reshape(len(boxes), -1)
        stop = np.array([b.stop for b in boxes], dtype=np.int64).reshape(len(boxes), -1)
    if not (stop > start).all():
        return sum(box_cost(info, b, by_rows, verify) for b in boxes if b.size)
    chunks = np.array(info.chunks, dtype=np.int64)
    counts = (stop - 1) // chunks - start // chunks + 1
    rows, touched = counts[:, 0], counts[:, 1:].prod(axis=1)
    row = math.prod(info.chunks[1:]) * info.itemsize
    if not info.raw or not by_rows:
        return int((rows * info.chunks[0] * row * touched).sum())
    span = (stop[:, 0] - start[:, 0]) * row * touched
    if not verify:
        return int(span.sum())
    part = np.maximum(0, rows * touched * info.chunks[0] * row - span)
    return int((span + np.minimum(part, rows * touched * BLOCK_BYTES)).sum())
