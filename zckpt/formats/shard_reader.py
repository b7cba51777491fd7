"""What every source shard reader offers, and the reader of a rank saved as several files.

A MindSpore job saves each rank as one ``.ckpt`` (protobuf) or ``.safetensors`` file; zckpt
may have split a rank's safetensors file into parts listed by an HF-style
``<name>.safetensors.index.json``; MindSpore's unified directory and MindFormers' iterations
spread a rank over several safetensors files too. Ingest, transform, loading, verification
and ``info`` read them all through :class:`ShardReader`, so they never ask which format they
got; :class:`SafetensorsSetReader` is the base of every several-file reader
(:mod:`zckpt.formats.unified`, :mod:`zckpt.formats.mindformers`). Which reader opens a path
is decided in one place, :mod:`zckpt.formats.opener`, which imports every format; the
format modules import this one and never the opener.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Protocol

import numpy as np

from zckpt.core.errors import CheckpointFormatError
from zckpt.formats.entries import EntryInfo
from zckpt.formats.safetensors import SafetensorsReader

INDEX_SUFFIX = ".safetensors.index.json"
"""A split safetensors checkpoint: ``<name>.safetensors.index.json`` with a ``weight_map``."""


class ShardReader(Protocol):
    """One source rank's entries, read as views or copies; a context manager.

    Satisfied by :class:`~zckpt.formats.ckpt.CkptReader`,
    :class:`~zckpt.formats.safetensors.SafetensorsReader`, :class:`SafetensorsSetReader` and its
    subclasses. Views handed out must not outlive the reader.
    """

    path: Path
    entries: dict[str, EntryInfo]
    """Every entry of the rank by name, in the order MindSpore's loader returns them."""
    has_crc: bool
    """Whether the rank carries MindSpore's checksum (checked on opening unless told not to)."""

    def __enter__(self) -> ShardReader: ...

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None: ...

    def close(self) -> None: ...

    def array(self, name: str) -> np.ndarray:
        """The whole tensor (a read-only view where its bytes lie together, else a copy)."""
        ...

    def rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows ``[r0, r1)`` of a tensor along axis 0."""
        ...

    def row_blocks(self, name: str, max_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(first_row, block)`` covering a tensor along axis 0, each at most ``max_bytes``
        (but at least one row)."""
        ...

    def row_bytes_range(self, name: str, r0: int, r1: int) -> tuple[int, int] | None:
        """Offset and length in :meth:`fileno`'s file of rows ``[r0, r1)``, when they lie there
        together (copied file to file then); ``None`` otherwise (copied through memory)."""
        ...

    def fileno(self) -> int:
        """The file :meth:`row_bytes_range` speaks of (asked only after it gave a range)."""
        ...

    def string(self, name: str) -> str: ...

    def map_bytes(self, name: str) -> bytes:
        """A MapParameter entry's serialized bytes (``.ckpt`` only; others refuse)."""
        ...

    def release_pages(self) -> None:
        """Drop the mapped pages read so far from this process (they stay in the page cache)."""
        ...


class SafetensorsSetReader(SafetensorsReader):
    """A rank saved as several safetensors parts plus an HF-style index (``weight_map``).

    Entries are the union of the parts' (in part order); reads go to the part holding the
    tensor. Tensors then live in several files, so :meth:`row_bytes_range` says ``None`` and
    ingest copies through memory instead of file to file.
    """

    def __init__(self, path: str | os.PathLike[str], *, verify_crc: bool = True) -> None:
        # No mapping of its own: every read is delegated to a part's reader.
        self.path = path if isinstance(path, Path) else Path(path)
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
                part = self._open_part(fname, verify_crc)
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

    def _open_part(self, fname: str, verify_crc: bool) -> SafetensorsReader:
        """The reader of one part named by the index (a file beside it)."""
        return SafetensorsReader(self.path.parent / fname, verify_crc=verify_crc)

    def _index_text(self) -> str:
        """The index file's text (a remote rank's reader fetches it)."""
        return self.path.read_text(encoding="utf-8")

    def _read_index(self) -> dict[str, str]:
        try:
            doc = json.loads(self._index_text())
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
