"""Which writer writes an output format: the :class:`RankWriter` protocol and the one table.

Every job that writes checkpoint files (export, transform, ``load_distributed_checkpoint``
saving ranks, the unified directory, file conversion) gives a writer the slices of one
output and a :class:`~zckpt.write.boxes.BoxReader` for their bytes, and takes the writer's
class from :data:`OUTPUTS` by format name, so no job writes a format itself. Each row names
two classes: ``rank`` writes a destination rank in the export layout (a safetensors rank may
become parts and an index), ``file`` writes exactly the one file named (a unified part, a
loaded rank's ``net.<format>``, a converted file); with a ``layout`` (where each byte of a
file goes), several files are written source-major (:mod:`zckpt.write.group_writer`). Adding
an output format is one writer class beside :mod:`zckpt.write.ckpt_rank` and one row here.
What still differs by format in the commands is policy, not writing: safetensors refuses
MapParameter entries and keeps its own record of a finished directory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from zckpt.core.errors import OutputError
from zckpt.io.fileio import Publisher
from zckpt.io.new_files import Opener, local
from zckpt.plan.values import RankExport
from zckpt.run.progress import Ticker
from zckpt.write import ckpt_rank, safetensors_file
from zckpt.write import group_writer as grouping
from zckpt.write.boxes import BoxReader, RankResult, WriteOptions, WriterSettings
from zckpt.write.ckpt_rank import CkptRankWriter
from zckpt.write.destinations import OutputFile
from zckpt.write.file_layouts import Layout, ckpt_layout, safetensors_layout
from zckpt.write.group_writer import CostedReader, GroupWriter, groups
from zckpt.write.safetensors_file import SafetensorsFileWriter
from zckpt.write.safetensors_rank import SafetensorsRankWriter


class RankWriter(Protocol):
    """Writes one output from a destination rank's slices (a class called with its
    :class:`~zckpt.write.boxes.WriterSettings`)."""

    def write(self, reader: BoxReader, rank: RankExport, target: Path, ticker: Ticker | None = None,
              publisher: Publisher | None = None, files: Opener = local) -> RankResult:
        """Write ``rank``'s slices, read from ``reader``, as ``target``: each new file opened
        by ``files`` (on this machine: unnamed or under a temporary name; or an upload), given
        its name once complete: here, or by ``publisher`` on its thread where the format allows."""
        ...


@dataclass(frozen=True)
class OutputFormat:
    """One row of :data:`OUTPUTS`."""

    name: str
    suffix: str
    rank: Callable[[WriterSettings], RankWriter]
    """The writer of a destination rank in the export layout."""
    file: Callable[[WriterSettings], RankWriter]
    """The writer of exactly the one file named."""
    layout: Layout
    """Where each byte of one such file goes, for writing several source-major."""
    parts: bool = False
    """A rank may become several files (parts and an index), replaced together."""

    def group(self, settings: WriterSettings) -> GroupWriter | None:
        """The writer of several files at once, where these settings allow one: files with
        a checksum over their bytes in file order, or split into parts, are written front
        to back."""
        return None if settings.crc or settings.max_file_bytes else GroupWriter(self.layout, settings)


OUTPUTS: dict[str, OutputFormat] = {f.name: f for f in (
    OutputFormat("ckpt", ckpt_rank.SUFFIX, CkptRankWriter, CkptRankWriter, ckpt_layout),
    OutputFormat("safetensors", safetensors_file.SUFFIX, SafetensorsRankWriter, SafetensorsFileWriter,
                 safetensors_layout, parts=True),
    # a MindFormers iteration's model and optimizer files: each exactly the file named
    # (zckpt.plan.mf_iteration names them, zckpt.write.mindformers_dir publishes the directory)
    OutputFormat("mindformers", safetensors_file.SUFFIX, SafetensorsFileWriter, SafetensorsFileWriter,
                 safetensors_layout),
)}


def output_format(name: str) -> OutputFormat:
    """The row of format ``name``; an :class:`OutputError` naming the known ones otherwise."""
    try:
        return OUTPUTS[name]
    except KeyError:
        raise OutputError(f"unknown output format {name!r} ({' or '.join(OUTPUTS)})") from None


class FormatOptions(WriteOptions, Protocol):
    """A job's options that name the output format too."""

    @property
    def format(self) -> str: ...


def write_rank(out: OutputFile, reader: BoxReader, rank: RankExport, options: FormatOptions,
               ticker: Ticker | None = None, publisher: Publisher | None = None) -> RankResult:
    """Write destination ``rank`` to ``out`` in the options' format, published as ``out``
    publishes a file (a rank that may become parts and an index: all of them, once complete)."""
    writer = rank_writer(options)
    if output_format(options.format).parts:
        return out.publish_parts(lambda path, files: writer.write(reader, rank, path, ticker, publisher, files))
    return out.publish(lambda path, pub, files: writer.write(reader, rank, path, ticker, pub, files), publisher)


def rank_writer(options: FormatOptions) -> RankWriter:
    """The writer of a destination rank in ``options.format``, set as ``options`` say."""
    return output_format(options.format).rank(WriterSettings.of(options))


def group_writer(options: FormatOptions) -> GroupWriter:
    """The writer of several destination ranks at once (where :func:`source_major` chose it)."""
    writer = output_format(options.format).group(WriterSettings.of(options))
    if writer is None:
        raise OutputError(f"{options.format} files with these settings are written one by one")
    return writer


def source_major(reader: CostedReader, ranks: Sequence[RankExport], options: FormatOptions,
                 tasks: int) -> list[list[int]] | None:
    """The groups of ``ranks`` (positions) to write source-major as at least ``tasks`` tasks,
    when that reads far less than writing them one by one, or no more where the files' parts
    are small (:data:`zckpt.write.group_writer.SMALL_PIECE`), and the format and settings
    allow it; ``None``: one by one."""
    if len(ranks) < 2 or output_format(options.format).group(WriterSettings.of(options)) is None:
        return None
    prices = grouping.Prices(reader, ranks)
    whole = groups(ranks, 1)
    alone = sum(prices.alone(g[0], g[-1] + 1) for g in whole)
    together = sum(prices.together(g[0], g[-1] + 1) for g in whole)
    if together * grouping.GAIN >= alone and not (together <= alone and grouping.small_pieces(reader, ranks)):
        return None
    cut = groups(ranks, tasks)
    if len(cut) > len(whole) and together < alone:  # (else the halves read no more than one by one: no more)
        split = sum(prices.together(g[0], g[-1] + 1) for g in cut)
        if split > together * grouping.SPLIT_COST:
            return whole  # the other process stays idle rather than read the shared rows twice
    return cut


def file_writer(format: str, settings: WriterSettings | None = None) -> RankWriter:
    """The writer of one file in ``format`` (``"ckpt"`` or ``"safetensors"``); by default
    without checksum, synced, no read-ahead."""
    return output_format(format).file(settings if settings is not None else WriterSettings())
