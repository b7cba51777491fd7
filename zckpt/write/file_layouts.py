"""Where every byte of a destination file goes, known before a byte of its data is read.

A file written front to back (:mod:`zckpt.write.ckpt_rank`, :mod:`zckpt.write.safetensors_file`)
never needs this. A file filled source-major (:mod:`zckpt.write.group_writer`) receives its
tensors' bytes in the order the sources are read, several files at a time, so each file's
framing (``.ckpt`` Value headers, string and map entries; the safetensors header) and the
file offset of every tensor byte are worked out here first, from the same encoders the
front-to-back writers use: the two ways give the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from zckpt.core.layout import Box
from zckpt.formats.ckpt_encoding import map_value, string_value, tensor_values
from zckpt.formats.safetensors import header_bytes
from zckpt.plan.values import Slice
from zckpt.write.boxes import BoxReader
from zckpt.write.safetensors_file import file_metadata, tensor_headers


class Segment(NamedTuple):
    """``length`` bytes of a tensor's C-order data, from byte ``at`` of it, lie at ``offset`` of the file."""

    at: int
    offset: int
    length: int


@dataclass(frozen=True)
class FileLayout:
    """One destination file: its size, the framing bytes at their offsets, and where each
    tensor's data goes."""

    size: int
    framing: tuple[tuple[int, bytes], ...]
    segments: Mapping[str, tuple[Segment, ...]]
    tensors: int

    def places(self, name: str, at: int, length: int) -> list[tuple[int, int, int]]:
        """Bytes ``[at, at + length)`` of tensor ``name``'s data as ``(file offset, start
        within those bytes, length)`` pieces (more than one where a ``.ckpt`` Value ends)."""
        segments = self.segments[name]
        if len(segments) == 1 and segments[0].at == 0 and at + length <= segments[0].length:
            return [(segments[0].offset + at, 0, length)]
        return list(self._places(segments, at, length))

    @staticmethod
    def _places(segments: tuple[Segment, ...], at: int, length: int) -> Iterator[tuple[int, int, int]]:
        stop = at + length
        for seg in segments:
            lo, hi = max(at, seg.at), min(stop, seg.at + seg.length)
            if lo < hi:
                yield seg.offset + lo - seg.at, lo - at, hi - lo


Layout = Callable[[BoxReader, Sequence[Slice]], FileLayout]
"""How a format lays out a file of slices."""


def ckpt_layout(reader: BoxReader, slices: Sequence[Slice]) -> FileLayout:
    """The ``.ckpt`` file :class:`~zckpt.write.ckpt_rank.CkptRankWriter` writes for ``slices``
    (without the CRC trailer: a file with one is written front to back)."""
    pos = 0
    framing: list[tuple[int, bytes]] = []
    segments: dict[str, tuple[Segment, ...]] = {}
    for s in slices:
        kind = reader.kind(s.name)
        if kind != "tensor":
            data = string_value(s.name, reader.string(s.name)) if kind == "str" else \
                map_value(s.name, reader.map_bytes(s.name))
            framing.append((pos, data))
            pos += len(data)
            continue
        parts, at = [], 0
        for header, length in tensor_values(s.name, reader.ms_type(s.name), s.box.shape):
            framing.append((pos, header))
            pos += len(header)
            parts.append(Segment(at, pos, length))
            pos += length
            at += length
        segments[s.name] = tuple(parts)
    return FileLayout(pos, tuple(framing), segments, len(segments))


def safetensors_layout(reader: BoxReader, slices: Sequence[Slice]) -> FileLayout:
    """The one ``.safetensors`` file :class:`~zckpt.write.safetensors_file.SafetensorsFileWriter`
    writes for ``slices`` (without ``crc_num``: a file with one is written front to back)."""
    header, order = header_bytes(tensor_headers(reader, slices), file_metadata(reader, slices))
    pos = len(header)
    segments: dict[str, tuple[Segment, ...]] = {}
    for t in order:
        segments[t.name] = (Segment(0, pos, t.nbytes),)
        pos += t.nbytes
    return FileLayout(pos, ((0, header),), segments, len(order))


def data_offset(inner: Box, outer: Box, itemsize: int) -> int:
    """Byte offset of ``inner``'s first element in ``outer``'s C-order data."""
    offset, stride = 0, 1
    for a, o, n in zip(reversed(inner.start), reversed(outer.start), reversed(outer.shape), strict=True):
        offset += (a - o) * stride
        stride *= n
    return offset * itemsize
