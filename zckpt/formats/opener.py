"""Which reader reads a source shard: the one place that knows every format.

A rank of a MindSpore job is a ``.ckpt`` or ``.safetensors`` file, a split safetensors
checkpoint's ``<name>.safetensors.index.json``, a MindFormers iteration's rank file, or a
unified directory's ``param_name_map.json``. :data:`FORMATS` lists them with the test that
recognises each and the reader class that opens it; :func:`open_shard` takes the first row
whose test accepts the path. Adding a format is one reader class (a
:class:`~zckpt.formats.shard_reader.ShardReader`) and one row here. The format modules never
import this one (``tests/test_formats_imports.py``), so imports run one way.

:func:`check_single_format` refuses a job that mixes ``.ckpt`` and ``.safetensors`` files,
as ``mindspore.transform_checkpoints`` does (it could not tell which set is current).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from zckpt.core.errors import SourceError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.entries import EntryInfo
from zckpt.formats.mindformers import MindFormersRankReader, is_rank_file
from zckpt.formats.remote_shard import open_remote
from zckpt.formats.safetensors import SafetensorsReader
from zckpt.formats.shard_reader import INDEX_SUFFIX, SafetensorsSetReader, ShardReader
from zckpt.formats.unified import MAP_FILE, UnifiedSafetensorsReader


class ReaderClass(Protocol):
    """A shard reader's class, called as the opener calls it."""

    def __call__(self, path: str | os.PathLike[str], *, verify_crc: bool = True) -> ShardReader: ...


@dataclass(frozen=True)
class ShardFormat:
    """One row of :data:`FORMATS`."""

    name: str
    """What :func:`shard_format` answers for such a path."""
    test: Callable[[Path], bool]
    reader: ReaderClass


def _is_index(p: Path) -> bool:
    return p.name.endswith(INDEX_SUFFIX)


def _is_unified_map(p: Path) -> bool:
    return p.name == MAP_FILE


def _is_mindformers_rank(p: Path) -> bool:
    return p.suffix == ".safetensors" and is_rank_file(p)


def _is_safetensors(p: Path) -> bool:
    """By suffix; a file named neither ``.safetensors`` nor ``.ckpt`` by its first bytes.

    A safetensors file starts with an 8-byte length and then ``{``; a ``.ckpt`` starts with a
    protobuf field, never ``{`` at byte 8 (that would be a 1-byte length field for byte 9).
    """
    if p.suffix in (".safetensors", ".ckpt"):
        return p.suffix == ".safetensors"
    try:
        with open(p, "rb") as f:
            head = f.read(9)
    except OSError:
        return False  # let the .ckpt reader report the problem with its own message
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < os.path.getsize(p)


def _anything(p: Path) -> bool:
    return True


FORMATS: tuple[ShardFormat, ...] = (
    ShardFormat("safetensors-index", _is_index, SafetensorsSetReader),
    ShardFormat("safetensors-unified", _is_unified_map, UnifiedSafetensorsReader),
    ShardFormat("safetensors-mindformers", _is_mindformers_rank, MindFormersRankReader),
    ShardFormat("safetensors", _is_safetensors, SafetensorsReader),
    ShardFormat("ckpt", _anything, CkptReader),
)
"""Every source format, asked in order: the first whose test accepts a path reads it."""


def format_of(path: str | os.PathLike[str]) -> ShardFormat:
    """The row of :data:`FORMATS` that reads ``path``."""
    p = Path(path)
    return next(f for f in FORMATS if f.test(p))


def shard_format(path: str | os.PathLike[str]) -> str:
    """The name of the format of ``path`` (``"ckpt"``, ``"safetensors"``, ``"safetensors-index"``,
    ``"safetensors-unified"``, ``"safetensors-mindformers"``): by name, else by content."""
    return format_of(path).name


def open_shard(path: str | os.PathLike[str], *, verify_crc: bool = True, sparse: bool = False) -> ShardReader:
    """Open a source shard with the reader its format needs (use as a context manager);
    ``sparse``: for its index only (:class:`CkptReader`; other formats keep their headers
    together at the start)."""
    fmt = format_of(path)
    if fmt.name == "ckpt":
        return CkptReader(path, verify_crc=verify_crc, sparse=sparse)
    return fmt.reader(path, verify_crc=verify_crc)


def open_indexed(path: str | os.PathLike[str], entries: Mapping[str, EntryInfo]) -> ShardReader:
    """Open a source shard whose index was parsed before (a ``.ckpt``: mapped, not walked
    again; other formats are opened as :func:`open_shard` does, without their CRC check)."""
    if shard_format(path) == "ckpt":
        return CkptReader.indexed(path, entries)
    return open_shard(path, verify_crc=False)


__all__ = ["FORMATS", "check_single_format", "format_of", "open_indexed", "open_remote", "open_shard", "shard_format"]


def check_single_format(files: Mapping[int, str | Path], root: str | Path) -> None:
    """Refuse a job whose ranks are saved in different formats (MindSpore refuses it too)."""
    kinds = {r: "safetensors" if shard_format(p).startswith("safetensors") else "ckpt" for r, p in files.items()}
    if len(set(kinds.values())) > 1:
        ck = sorted(r for r, k in kinds.items() if k == "ckpt")
        st = sorted(r for r, k in kinds.items() if k != "ckpt")
        raise SourceError(
            f"source directory mixes .ckpt (ranks {ck}) and .safetensors (ranks {st}) checkpoints; MindSpore refuses "
            "such a source as well (keep one format per job)", path=root)
