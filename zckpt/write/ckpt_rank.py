"""The ``.ckpt`` writer: one destination rank's slices as one MindSpore checkpoint file.

Whatever the reader (the store, the source shards, one shard file, a read callable), a slice
the reader can hand out as file ranges is copied file to file
(:meth:`~zckpt.formats.ckpt_writer.CkptWriter.write_blocks`), any other is streamed band by band
from a :class:`~zckpt.write.boxes.BandSource`. String and MapParameter entries are written as
they are. The file is a new file (unnamed, or under a temporary name) named once complete (here, or
by a publisher on its thread while the caller writes the next file). The byte format itself is
:mod:`zckpt.formats.ckpt`'s; this module only decides what goes into the file, in which order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from zckpt.core.dtypes import ms_dtype
from zckpt.formats.ckpt_writer import CkptWriter
from zckpt.formats.entries import FileRange
from zckpt.io.fileio import Publisher
from zckpt.io.new_files import Opener, local
from zckpt.plan.values import RankExport
from zckpt.run.progress import Ticker
from zckpt.write.boxes import BandSource, BoxReader, RankResult, WriterSettings, reading_ahead

SUFFIX = ".ckpt"


@dataclass(frozen=True)
class CkptRankWriter:
    """Writes a rank as ``target`` (a :class:`~zckpt.write.writers.RankWriter`)."""

    settings: WriterSettings = WriterSettings()

    def write(self, reader: BoxReader, rank: RankExport, target: Path, ticker: Ticker | None = None,
              publisher: Publisher | None = None, files: Opener = local) -> RankResult:
        """Write ``rank``'s slices from ``reader`` into the ``.ckpt`` file ``target`` (opened by ``files``)."""
        tensors = 0
        direct: dict[str, list[FileRange]] = {}
        banded = []
        for s in rank.slices:
            if reader.kind(s.name) != "tensor":
                continue
            ranges = reader.file_ranges(s.name, s.box)
            if ranges is not None:
                direct[s.name] = ranges
            else:
                banded.append((s.name, s.box))
        with contextlib.ExitStack() as stack:
            source = BandSource(reader, banded, stack.enter_context(reading_ahead(self.settings.overlap)))
            w = stack.enter_context(CkptWriter(target, crc=self.settings.crc, fsync=self.settings.fsync,
                                               publisher=publisher, files=files))
            for s in rank.slices:
                kind = reader.kind(s.name)
                if kind == "str":
                    w.write_string(s.name, reader.string(s.name))
                elif kind == "map":
                    w.write_map(s.name, reader.map_bytes(s.name))
                else:
                    blocks = direct[s.name] if s.name in direct else source.take(s.name)
                    w.write_blocks(s.name, reader.ms_type(s.name), s.box.shape, blocks)
                    tensors += 1
                if ticker is not None and kind == "tensor":
                    ticker.add(s.name, s.box.size * ms_dtype(reader.ms_type(s.name)).storage.itemsize)
        if ticker is not None:
            ticker.close()
        return RankResult(rank.rank, str(target), tensors, w.size, reader.read_bytes, reader.checked_bytes)
