"""The safetensors rank writer: a destination rank as one file, or as HF-style parts and an index.

MindSpore's own safetensors jobs (``save_checkpoint(format="safetensors")``,
``transform_checkpoints(..., output_format="safetensors")``) write each rank as
``rank_<r>/<prefix><r>.safetensors``, which loads with
``mindspore.load_checkpoint(f, format="safetensors")`` and with any safetensors reader. With
``max_file_bytes`` a rank larger than that is split HF-style into
``<prefix><r>-00001-of-0000K.safetensors`` parts (tensors whole, in plan order) plus
``<prefix><r>.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``);
string entries go to the first part. ``zckpt ingest`` reads such a rank back through its
index.

This module owns that layout: the names of the parts and the index, which files an earlier
write of the same rank may have left (removed once the new ones are in place), and the order
that never leaves an index naming a mix of old and new parts. Each file itself is written by
:class:`~zckpt.write.safetensors_file.SafetensorsFileWriter`.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from zckpt.core.errors import OutputError
from zckpt.formats.safetensors import TensorHeader
from zckpt.formats.shard_reader import INDEX_SUFFIX
from zckpt.io import fileio, remote
from zckpt.io.fileio import Publisher
from zckpt.io.new_files import Opener, local
from zckpt.plan.values import RankExport, Slice
from zckpt.run.progress import Ticker
from zckpt.write.boxes import BoxReader, RankResult, WriterSettings, reading_ahead
from zckpt.write.safetensors_file import SUFFIX, SafetensorsFileWriter, refuse_maps, tensor_headers


def part_name(stem: str, index: int, count: int) -> str:
    """HF's shard file name: ``<stem>-00001-of-00003.safetensors``."""
    return f"{stem}-{index + 1:05d}-of-{count:05d}{SUFFIX}"


def split_parts(tensors: Sequence[TensorHeader], max_bytes: int) -> list[list[TensorHeader]]:
    """Tensors grouped in order into parts of at most ``max_bytes`` of data (a larger tensor
    gets a part of its own); one part when ``max_bytes`` is 0."""
    if max_bytes <= 0 or not tensors:
        return [list(tensors)]
    parts: list[list[TensorHeader]] = [[]]
    size = 0
    for t in tensors:
        if parts[-1] and size + t.nbytes > max_bytes:
            parts.append([])
            size = 0
        parts[-1].append(t)
        size += t.nbytes
    return parts


def stem(target: Path) -> str:
    """``target``'s name without ``.safetensors``: what its parts and index are named after."""
    return target.name[: -len(SUFFIX)] if target.name.endswith(SUFFIX) else target.stem


def existing_outputs(target: Path) -> list[Path]:
    """Every file a write of ``target`` may leave: the single file, the index, parts."""
    base = stem(target)
    found = [target, target.with_name(base + INDEX_SUFFIX)]
    if target.parent.is_dir():
        found += sorted(target.parent.glob(f"{base}-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]{SUFFIX}"))
    return [p for p in found if p.exists()]


def output_names(target_name: str, names: Iterable[str]) -> list[str]:
    """Which of ``names`` (files beside ``target``) a write of ``target`` may leave: the
    single file, its index, its parts (what :func:`existing_outputs` finds on a local disk)."""
    base = stem(Path(target_name))
    part = re.compile(re.escape(base) + r"-[0-9]{5}-of-[0-9]{5}" + re.escape(SUFFIX) + "$")
    return sorted(n for n in names if n in (target_name, base + INDEX_SUFFIX) or part.match(n))


def remote_outputs(out: remote.Location, target: str) -> list[str]:
    """Filesystem paths of what a write of ``target`` (a path below ``out``) left there."""
    folder, name = target.rsplit("/", 1)
    beside = [n for n, d in remote.listdir(remote.Location(out.url_of(folder), out.fs, folder), OutputError) if not d]
    return [f"{folder}/{n}" for n in output_names(name, beside)]


@dataclass(frozen=True)
class SafetensorsRankWriter:
    """Writes a rank as ``target``, or as its parts and index (a :class:`~zckpt.write.writers.RankWriter`)."""

    settings: WriterSettings = WriterSettings()

    def write(self, reader: BoxReader, rank: RankExport, target: Path, ticker: Ticker | None = None,
              publisher: Publisher | None = None, files: Opener = local) -> RankResult:
        """One rank's file, or its parts and index when it exceeds ``max_file_bytes``, each
        opened by ``files`` (``publisher`` is not used: each file is synced and renamed here)."""
        refuse_maps(reader, rank.slices)
        tensors = tensor_headers(reader, rank.slices)
        boxes = {s.name: s.box for s in rank.slices}
        strings = [s for s in rank.slices if reader.kind(s.name) == "str"]
        parts = split_parts(tensors, self.settings.max_file_bytes)
        base = stem(target)
        stale = set(existing_outputs(target))
        paths = [target] if len(parts) == 1 else [target.with_name(part_name(base, i, len(parts)))
                                                  for i in range(len(parts))]
        index_path = target.with_name(base + INDEX_SUFFIX)
        if len(parts) > 1:
            _retract(index_path, fsync=self.settings.fsync)
        one = SafetensorsFileWriter(self.settings)
        total = 0
        published: list[Path] = []
        try:
            with reading_ahead(self.settings.overlap) as helper:
                for i, (path, part) in enumerate(zip(paths, parts, strict=True)):
                    slices = (strings if i == 0 else []) + [Slice(t.name, boxes[t.name]) for t in part]
                    total += one.write_file(reader, slices, path, helper, ticker, files)[1]
                    published.append(path)
        except BaseException:
            if len(parts) > 1:  # no index names them any more: parts of this write or of an older one
                for p in sorted({*published, *stale} - {target, index_path}):
                    _retract(p, fsync=False)
            raise
        result_path = paths[0]
        if len(parts) > 1:
            result_path = index_path
            doc = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                   "weight_map": {t.name: p.name for p, part in zip(paths, parts, strict=True) for t in part}}
            text = (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
            fileio.write_atomic(result_path, text, fsync=self.settings.fsync, files=files)
            total += len(text)
        for p in stale - {*paths, result_path}:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        if ticker is not None:
            ticker.close()
        return RankResult(rank.rank, str(result_path), len(tensors), total, reader.read_bytes, reader.checked_bytes)


def _retract(path: Path, *, fsync: bool) -> None:
    """Remove an output that must not outlive a failed split write: an old index would name
    a mix of new and old parts, new parts without their index would look like a short model."""
    try:
        path.unlink()
    except FileNotFoundError:
        return
    if fsync:
        fileio.fsync_dir(path.parent)
