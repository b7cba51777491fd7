"""Shards laid out alike: one ``.ckpt`` walked, the others recognised by their framing bytes.

The ranks of one pipeline stage of a data-parallel (or evenly split) job hold the same
parameters in the same order with the same dims: their files differ in payload bytes only.
Walking a file's headers is a Python loop over every ``Value`` (about 10 us each: the 44 544
Values of 256 data-parallel ranks took 0.45 s, with the files in the page cache, and the
plan waited for it). Comparing another file's framing with that of a file walked before is
one ``pread`` per gap between payloads (0.05 s for the same 255 files).

Why it is exact: the walk (:mod:`zckpt.formats.ckpt_index`) reads the bytes between payloads
and skips each payload by the length its header gives; the reader first looks for MindSpore's
CRC trailer in the file's last bytes, which decides where the walk ends. A file of the same
size, with a trailer where the walked file has one, whose bytes between payloads
(:func:`walked_spans`) equal the walked file's, is walked over the same bytes in the same
order, so its index is the same: its payloads lie at the same offsets (the checksum itself is
read only to verify it). A file that differs anywhere
there, or is of another size, is walked itself (and may become the pattern for others). A file
whose checksum is to be verified is always walked: verifying reads every byte.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from zckpt.formats.ckpt_encoding import CRC_MAGIC, CRC_TRAILER_LEN
from zckpt.formats.entries import EntryInfo


def walked_spans(index: Mapping[str, EntryInfo], end: int) -> tuple[tuple[int, int], ...]:
    """``(offset, length)`` of every byte before ``end`` (the end of the protobuf content: the
    file's size, or where the CRC trailer starts) that the walk of a ``.ckpt`` file indexed as
    ``index`` reads: all but the payloads; in file order."""
    spans: list[tuple[int, int]] = []
    pos = 0
    for start, stop in sorted((s.offset, s.offset + s.length) for e in index.values() for s in e.segments):
        if start > pos:
            spans.append((pos, start - pos))
        pos = max(pos, stop)
    if end > pos:
        spans.append((pos, end - pos))
    return tuple(spans)


def read_spans(path: Path, spans: tuple[tuple[int, int], ...]) -> bytes | None:
    """The bytes of ``path`` at ``spans``, joined; ``None`` where the file cannot be read so
    (its own walk then says what is wrong)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (OSError, ValueError):
        return None
    try:
        parts = [os.pread(fd, length, offset) for offset, length in spans]
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(parts)


def file_size(path: Path) -> int | None:
    """The size of ``path``; ``None`` where it cannot be looked at."""
    try:
        return path.stat().st_size
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Layout:
    """A walked file's index with what another file must share to have it too: its size,
    whether it ends in a CRC trailer, and its bytes at :func:`walked_spans`."""

    size: int
    trailer: bool
    spans: tuple[tuple[int, int], ...]
    framing: bytes
    index: Mapping[str, EntryInfo]


@dataclass
class Layouts:
    """The layouts walked so far in one job: the first file walked of each size and group
    (the caller's: a pipeline stage, whose ranks hold the same parameters)."""

    known: dict[tuple[int, Hashable], Layout] = field(default_factory=dict)
    matched: int = 0
    """How many files took a known layout instead of being walked."""

    def learn(self, path: Path, index: Mapping[str, EntryInfo], trailer: bool, group: Hashable = None) -> None:
        """Keep the layout of ``path``, walked as ``index`` (``trailer``: the reader found a CRC
        trailer, whose checksum was not verified), for files of its size and ``group``."""
        size = file_size(path)
        if size is None or (size, group) in self.known:
            return
        spans = walked_spans(index, size - CRC_TRAILER_LEN if trailer else size)
        framing = read_spans(path, spans)
        if framing is not None:
            self.known[(size, group)] = Layout(size, trailer, spans, framing, index)

    def index_of(self, path: Path, group: Hashable = None) -> Mapping[str, EntryInfo] | None:
        """The index of ``path`` where it is laid out as a file of ``group`` walked before; else ``None``."""
        size = file_size(path)
        known = self.known.get((size, group)) if size is not None else None
        if known is None:
            return None
        tail = ((known.size - CRC_TRAILER_LEN, len(CRC_MAGIC)),) if known.size >= CRC_TRAILER_LEN else ()
        got = read_spans(path, known.spans + tail)  # one file opened: its framing and where a trailer starts
        if got is None or got[: len(known.framing)] != known.framing \
                or (got[len(known.framing):] == CRC_MAGIC) != known.trailer:
            return None
        self.matched += 1
        return known.index
