"""The single-file safetensors writer: slices as exactly one MindSpore-style ``.safetensors`` file.

This is the file without any layout around it: a part of MindSpore's unified directory, the
``net.safetensors`` of ``load_distributed_checkpoint``, a converted file, and each part of
an export's split rank (:mod:`zckpt.write.safetensors_rank` builds on it). The slices' names,
types and shapes give the header before a byte is read; the tensors' bytes are then streamed
band by band from a :class:`~zckpt.write.boxes.BandSource` into a new file named when complete.

* dtypes map one to one (``BFloat16`` -> ``BF16`` with the exact bits the reader gives);
* metadata is MindSpore's ``{"format": "ms"}`` (plus ``crc_num`` with ``crc``, computed as
  MindSpore does); string entries go to ``__metadata__`` under ``"zckpt.str:" + name``;
* MapParameter entries have no safetensors form (MindSpore cannot save them either): refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from zckpt.core.errors import OutputError, ZckptError
from zckpt.formats.safetensors import MS_METADATA, STRING_PREFIX, SafetensorsWriter, TensorHeader
from zckpt.io.fileio import Publisher
from zckpt.io.new_files import Opener, local
from zckpt.plan.values import RankExport, Slice
from zckpt.run.progress import Ticker
from zckpt.write.boxes import BandSource, BoxReader, RankResult, WriterSettings, reading_ahead

SUFFIX = ".safetensors"


def no_safetensors_form(name: str, advice: str = "", error: type[ZckptError] = OutputError,
                        path: str | os.PathLike[str] | None = None) -> ZckptError:
    """The refusal of a MapParameter entry ``name`` bound for a safetensors file, whichever job
    meets it first (an export, a transform, a file conversion, the unified directory)."""
    return error("MapParameter entries have no safetensors form (MindSpore cannot save them as safetensors either)"
                 + (f"; {advice}" if advice else ""), path=path, param=name)


def refuse_maps(reader: BoxReader, slices: Sequence[Slice]) -> None:
    """Fail by name on a MapParameter entry, before any file is written."""
    for s in slices:
        if reader.kind(s.name) == "map":
            raise no_safetensors_form(s.name, "write this rank as .ckpt")


def tensor_headers(reader: BoxReader, slices: Sequence[Slice]) -> list[TensorHeader]:
    """The tensors among ``slices``, as a safetensors header declares them (in slice order)."""
    return [TensorHeader(s.name, reader.ms_type(s.name), s.box.shape) for s in slices
            if reader.kind(s.name) == "tensor"]


def file_metadata(reader: BoxReader, slices: Sequence[Slice]) -> dict[str, str]:
    """The header's ``__metadata__`` for ``slices``: MindSpore's, and their string entries."""
    return string_metadata({s.name: reader.string(s.name) for s in slices if reader.kind(s.name) == "str"})


def string_metadata(strings: Mapping[str, str]) -> dict[str, str]:
    """MindSpore's ``__metadata__`` with string entries under ``zckpt.str:<name>``."""
    return {**MS_METADATA, **{STRING_PREFIX + name: value for name, value in strings.items()}}


@dataclass(frozen=True)
class SafetensorsFileWriter:
    """Writes a rank's slices as the one file ``target`` (a :class:`~zckpt.write.writers.RankWriter`)."""

    settings: WriterSettings = WriterSettings()

    def write(self, reader: BoxReader, rank: RankExport, target: Path, ticker: Ticker | None = None,
              publisher: Publisher | None = None, files: Opener = local) -> RankResult:
        """Write ``rank``'s slices from ``reader`` into ``target``, opened by ``files``
        (``publisher`` is not used: the file is synced and renamed here)."""
        refuse_maps(reader, rank.slices)
        with reading_ahead(self.settings.overlap) as helper:
            tensors, size = self.write_file(reader, rank.slices, target, helper, ticker, files)
        if ticker is not None:
            ticker.close()
        return RankResult(rank.rank, str(target), tensors, size, reader.read_bytes, reader.checked_bytes)

    def write_file(self, reader: BoxReader, slices: Sequence[Slice], target: Path, helper: Executor | None,
                   ticker: Ticker | None = None, files: Opener = local) -> tuple[int, int]:
        """Write ``slices`` (tensors and strings; no maps) as ``target`` (opened by ``files``);
        the number of tensors and the file's size."""
        tensors = tensor_headers(reader, slices)
        boxes = {s.name: s.box for s in slices}
        meta = file_metadata(reader, slices)
        with SafetensorsWriter(target, tensors, meta, crc=self.settings.crc, fsync=self.settings.fsync,
                               files=files) as w:
            source = BandSource(reader, [(t.name, boxes[t.name]) for t in w.order], helper)
            for t in w.order:
                w.write_tensor(t.name, source.take(t.name))
                if ticker is not None:
                    ticker.add(t.name, t.nbytes)
        return len(tensors), w.bytes_written
