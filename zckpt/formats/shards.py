"""One entry point for reading a source shard, whatever its format.

A MindSpore job saves each rank either as ``.ckpt`` (protobuf) or as ``.safetensors``;
zckpt may also have split a rank's safetensors file into parts listed by an HF-style
``<name>.safetensors.index.json``. :func:`open_shard` picks the reader from the file (its
suffix, else its first bytes), and every reader offers the
:class:`~zckpt.formats.ckpt.CkptReader` interface, so ingest does not care which it got.

:func:`pick_rank_file` applies MindSpore's rules for choosing a rank directory's file, and
:func:`check_single_format` refuses a job that mixes ``.ckpt`` and ``.safetensors`` files,
as ``mindspore.transform_checkpoints`` does (it could not tell which set is current).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

from zckpt.errors import CheckpointFormatError, SourceError
from zckpt.formats.ckpt import CkptReader, EntryInfo
from zckpt.formats.safetensors import SafetensorsReader

INDEX_SUFFIX = ".safetensors.index.json"
"""A split safetensors checkpoint: ``<name>.safetensors.index.json`` with a ``weight_map``."""

ShardReader = CkptReader
"""The interface every shard reader offers (``entries``, ``array``, ``rows``, ``string``, ...)."""


def shard_format(path: str | os.PathLike[str]) -> str:
    """``"ckpt"``, ``"safetensors"`` or ``"safetensors-index"``: by suffix, else by content.

    A safetensors file starts with an 8-byte length and then ``{``; a ``.ckpt`` starts with a
    protobuf field, never ``{`` at byte 8 (that would be a 1-byte length field for byte 9).
    """
    p = Path(path)
    if p.name.endswith(INDEX_SUFFIX):
        return "safetensors-index"
    if p.name == "param_name_map.json":
        return "safetensors-unified"  # MindSpore's unified directory (zckpt.formats.unified)
    if p.suffix == ".safetensors" and _is_mindformers_rank(p):
        return "safetensors-mindformers"  # a rank of a MindFormers iteration (zckpt.formats.mindformers)
    if p.suffix == ".safetensors":
        return "safetensors"
    if p.suffix == ".ckpt":
        return "ckpt"
    try:
        with open(p, "rb") as f:
            head = f.read(9)
    except OSError:
        return "ckpt"  # let the reader report the problem with its own message
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < os.path.getsize(p):
        return "safetensors"
    return "ckpt"


def open_shard(path: str | os.PathLike[str], *, verify_crc: bool = True) -> CkptReader:
    """Open a source shard with the reader its format needs (use as a context manager)."""
    fmt = shard_format(path)
    if fmt == "safetensors":
        return SafetensorsReader(path, verify_crc=verify_crc)
    if fmt == "safetensors-index":
        return SafetensorsSetReader(path, verify_crc=verify_crc)
    if fmt == "safetensors-unified":
        from zckpt.formats.unified import UnifiedSafetensorsReader

        return UnifiedSafetensorsReader(path, verify_crc=verify_crc)
    if fmt == "safetensors-mindformers":
        from zckpt.formats.mindformers import MindFormersRankReader

        return MindFormersRankReader(path, verify_crc=verify_crc)
    return CkptReader(path, verify_crc=verify_crc)


def _is_mindformers_rank(path: Path) -> bool:
    from zckpt.formats.mindformers import is_rank_file

    return is_rank_file(path)


def _numbers_key(name: str) -> list[int]:
    """MindSpore's ``_extract_last_two_numbers``: the last two integers in a file name."""
    return [int(x) for x in re.findall(r"\d+", name)][-2:]


def pick_rank_file(rank_dir: Path) -> Path | None:
    """The checkpoint of one ``rank_<r>`` directory, as MindSpore chooses it (see
    :func:`pick_rank_name`); ``None`` when the directory holds no checkpoint."""
    names = [p.name for p in rank_dir.iterdir() if p.is_file()]
    found = pick_rank_name(names, rank_dir.name, str(rank_dir))
    return None if found is None else rank_dir / found


def pick_rank_name(names: Sequence[str], dir_name: str, where: str) -> str | None:
    """The checkpoint among a ``rank_<r>`` directory's file names, as MindSpore chooses it.

    ``.ckpt``: the last in lexicographic order. ``.safetensors``: the one whose last two
    numbers are largest (``-<epoch>_<step>``), as ``transform_checkpoints`` picks it; a split
    checkpoint's index file stands for its parts. A directory holding both formats is
    refused. Works on names alone, so remote directories (listed through fsspec) follow
    the same rules as local ones.
    """
    ckpts = sorted(n for n in names if n.endswith(".ckpt"))
    indexes = sorted(n for n in names if n.endswith(INDEX_SUFFIX))
    sts = sorted(n for n in names if n.endswith(".safetensors"))
    if ckpts and (sts or indexes):
        raise SourceError(
            "rank directory holds both .ckpt and .safetensors files; MindSpore refuses such a source as well "
            "(keep one format per job)", path=where)
    if ckpts:
        return ckpts[-1]
    if indexes:
        if len(indexes) > 1:
            raise SourceError(f"rank directory holds {len(indexes)} split-checkpoint index files "
                              f"({', '.join(indexes)}); keep one", path=where)
        return indexes[0]
    if sts:
        return max(sts, key=lambda n: (_numbers_key(f"{dir_name}/{n}"), n))
    return None


def check_single_format(files: Mapping[int, str | Path], root: str | Path) -> None:
    """Refuse a job whose ranks are saved in different formats (MindSpore refuses it too)."""
    kinds = {r: "safetensors" if shard_format(p).startswith("safetensors") else "ckpt" for r, p in files.items()}
    if len(set(kinds.values())) > 1:
        ck = sorted(r for r, k in kinds.items() if k == "ckpt")
        st = sorted(r for r, k in kinds.items() if k != "ckpt")
        raise SourceError(
            f"source directory mixes .ckpt (ranks {ck}) and .safetensors (ranks {st}) checkpoints; MindSpore refuses "
            "such a source as well (keep one format per job)", path=root)


class SafetensorsSetReader(SafetensorsReader):
    """A rank saved as several safetensors parts plus an HF-style index (``weight_map``).

    Entries are the union of the parts' (in part order); reads go to the part holding the
    tensor. Tensors then live in several files, so :meth:`row_bytes_range` says ``None`` and
    ingest copies through memory instead of file to file.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify_crc: bool = True) -> None:
        # No mapping of its own: every read is delegated to a part's reader.
        self.path = Path(path)
        self._parts: list[SafetensorsReader] = []
        self._owner: dict[str, SafetensorsReader] = {}
        try:
            weight_map = self._read_index()
            files: dict[str, list[str]] = {}
            for name, fname in weight_map.items():
                files.setdefault(fname, []).append(name)
            self.entries: dict[str, EntryInfo] = {}
            self.metadata: dict[str, str] = {}
            for fname, names in files.items():
                part = SafetensorsReader(self.path.parent / fname, verify_crc=verify_crc)
                self._parts.append(part)
                tensors = {n for n, e in part.entries.items() if e.kind == "tensor"}
                if tensors != set(names):
                    extra = sorted(tensors - set(names)) or sorted(set(names) - tensors)
                    raise CheckpointFormatError(
                        f"weight_map and part {fname} disagree on which tensors it holds", path=self.path,
                        param=extra[0])
                for n, e in part.entries.items():
                    if n in self._owner:
                        raise CheckpointFormatError(f"entry is in two parts (also in {fname})", path=self.path,
                                                    param=n)
                    self._owner[n] = part
                    self.entries[n] = e
                self.metadata.update(part.metadata)
        except BaseException:
            self.close()
            raise
        self.has_crc = any(p.has_crc for p in self._parts)
        self.crc_expected = None

    def _read_index(self) -> dict[str, str]:
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointFormatError(f"cannot read split-checkpoint index: {err}", path=self.path) from None
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointFormatError("index has no weight_map of tensor name -> file name", path=self.path)
        for name, fname in wm.items():
            if Path(fname).name != fname or not fname.endswith(".safetensors"):
                raise CheckpointFormatError(f"weight_map names {fname!r}, not a .safetensors file beside the index",
                                            path=self.path, param=name)
        return dict(wm)

    def __enter__(self) -> SafetensorsSetReader:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        for p in self._parts:
            p.close()

    def _part(self, name: str) -> SafetensorsReader:
        try:
            return self._owner[name]
        except KeyError:
            raise CheckpointFormatError("no such entry", path=self.path, param=name) from None

    def release_pages(self) -> None:
        for p in self._parts:
            p.release_pages()

    def verify_crc(self) -> None:
        for p in self._parts:
            if p.has_crc:
                p.verify_crc()

    def fileno(self) -> int:
        raise CheckpointFormatError("a split checkpoint has no single file descriptor", path=self.path)

    def row_bytes_range(self, name: str, r0: int, r1: int) -> tuple[int, int] | None:
        return None

    def array(self, name: str) -> np.ndarray:
        return self._part(name).array(name)

    def rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        return self._part(name).rows(name, r0, r1)

    def row_blocks(self, name: str, max_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
        yield from self._part(name).row_blocks(name, max_bytes)

    def string(self, name: str) -> str:
        return self._part(name).string(name)
