"""Where an entry's bytes lie in a shard file, as values every format shares.

Each reader (``.ckpt``, safetensors, the formats built on them) indexes a file into
:class:`EntryInfo` values, each with its payload segments (:class:`Segment`), and every
reader of boxes hands a writer the bytes it can copy file to file as :class:`FileRange`
values. These are plain values with no reading or writing of their own, kept below the
format modules so that planning, the sources and the store can name them without
importing a codec.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from zckpt.core.dtypes import ms_dtype
from zckpt.io.checksums import RangeCheck, Sink


@dataclass(frozen=True)
class FileRange:
    """``length`` bytes at ``offset`` of the file ``path``: a block a writer copies file to
    file without holding the tensor in memory (through one reused buffer, or by the kernel).
    With ``check``, the writer passes the bytes to ``check`` on the way (parts share it).
    The ``verify`` checks read the recorded blocks the range lies in themselves: the writer
    hands them the bytes it copies and writes what they read of the range as they go (each
    byte read once), before the file is published."""

    path: Path
    offset: int
    length: int
    check: Sink | None = None
    verify: tuple[RangeCheck, ...] = ()

    def part(self, skip: int, take: int) -> FileRange:
        """Bytes ``[skip, skip + take)`` of the range; its checks go with the part that ends it
        (a range cut in two is still checked once, after its last byte is copied)."""
        return FileRange(self.path, self.offset + skip, take, self.check,
                         self.verify if skip + take == self.length else ())


class Segment(NamedTuple):
    """Payload bytes of one ``Value`` of an entry: ``length`` bytes at file ``offset`` (a
    tuple, as :class:`EntryInfo`: the index of a 512-rank job is 30 000 of each, built four
    times faster than frozen dataclasses)."""

    offset: int
    length: int


class EntryInfo(NamedTuple):
    """One logical checkpoint entry (all ``Value``s sharing a tag).

    ``kind`` is ``"tensor"``, ``"str"`` (an ``append_dict`` string) or ``"map"``
    (a MapParameter, indexed but not interpreted).
    """

    name: str
    kind: str
    ms_type: str
    dims: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape; MindSpore stores a 0-d tensor either as ``[]`` or as ``[0]``."""
        if self.kind != "tensor":
            return ()
        if self.dims == (0,) and self.nbytes == ms_dtype(self.ms_type).storage.itemsize:
            return ()
        return self.dims
