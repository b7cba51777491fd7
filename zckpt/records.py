"""Progress records of an ingest: one small JSON file per source rank, ``progress/rank_<r>.json``.

A record says that every byte its rank writes is in the store, with the checksums that prove
them (``docs/store-format.md``, "Progress records"). It is written once, whole, under a
temporary name and renamed (:func:`zckpt.fileio.write_atomic`), after the rank's bytes: a
crash never leaves a rank marked done without its checksums, and parallel workers each write
their own name. Stores up to format 4 kept the same document as the attributes of a zarr
group ``progress/rank_<r>``; creating hundreds of groups through zarr cost more than the
ingest's own copying at 512 ranks, so format 5 writes plain files, and both are read here.

Records are zckpt's bookkeeping, not arrays: they live in the directory of ``progress``, a
zero-length array (:func:`define_folder`), which zarr never lists.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zckpt import safe_paths
from zckpt.errors import StoreError
from zckpt.fileio import write_atomic

FOLDER = "progress"
FILE_VERSION = 5
"""Store format version from which records are files (earlier: zarr groups)."""
_FILE = re.compile(r"rank_(0|[1-9][0-9]*)\.json")
_GROUP = re.compile(r"rank_(0|[1-9][0-9]*)")


def define_folder(group: Any) -> None:
    """Create ``progress`` in a new store's root ``group`` as a zero-length ``uint8`` array:
    the record files live in its directory, where zarr looks only for chunk keys, so a zarr
    reader walking the hierarchy meets one empty array and no unknown objects (in a group,
    every file would be reported as "not recognized as a component of a Zarr hierarchy")."""
    group.create_array(FOLDER, shape=(0,), chunks=(1,), dtype="uint8", fill_value=0, compressors=None,
                       attributes={"zckpt": {"records": "progress/rank_<r>.json, one per source rank done"}})


def file_name(rank: int) -> str:
    """The record's name inside ``progress/``."""
    return f"rank_{rank}.json"


def encode(rank: int, info: Mapping[str, Any]) -> bytes:
    """The record file's bytes: ``{"rank": r, "bytes": ..., "crc32c_blocks": ...}`` as compact JSON."""
    return json.dumps({"rank": rank, **info}, separators=(",", ":")).encode("utf-8")


def decode(data: bytes, rank: int, where: str) -> dict[str, Any]:
    """A record file's document, refused by name when it is not one (damaged or hand-edited)."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise StoreError("progress record is not JSON: the store is damaged", path=where) from None
    if not isinstance(doc, dict) or doc.get("rank") != rank:
        raise StoreError(f"progress record does not describe rank {rank}: the store is damaged", path=where)
    return doc


def write(root: Path, rank: int, info: Mapping[str, Any]) -> None:
    """Record rank ``rank`` done in the local store at ``root`` (no fsync: the store's bytes
    are not synced one by one either; the rename makes the record whole or absent)."""
    write_atomic(root / FOLDER / file_name(rank), encode(rank, info), fsync=False)


def rank_of(name: str) -> tuple[int, bool] | None:
    """``(rank, is_file)`` for a record's name in ``progress/``: ``rank_<r>.json`` (a file,
    format 5) or ``rank_<r>`` (a zarr group, formats 1 to 4); ``None`` for anything else."""
    m = _FILE.fullmatch(name)
    if m is not None:
        return int(m.group(1)), True
    m = _GROUP.fullmatch(name)
    return (int(m.group(1)), False) if m is not None else None


def local_ranks(root: Path) -> set[int]:
    """Ranks with a record in the local store at ``root`` (files and format-4 groups)."""
    folder = root / FOLDER
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return set()
    out = set()
    for n in names:
        got = rank_of(n)
        if got is not None and (got[1] or (folder / n / "zarr.json").is_file()):
            out.add(got[0])
    return out


def read_local(root: Path) -> dict[int, dict[str, Any]]:
    """Every record of the local store at ``root``: the files' documents and the attributes
    of format-4 groups (``{rank: record}``)."""
    folder = root / FOLDER
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return {}
    out: dict[int, dict[str, Any]] = {}
    for n in names:
        got = rank_of(n)
        if got is None:
            continue
        rank, is_file = got
        if is_file:
            path = folder / n
            out[rank] = decode(safe_paths.read_bytes(path, StoreError), rank, str(path))
            continue
        meta = folder / n / "zarr.json"
        if meta.is_file():
            doc = json.loads(safe_paths.read_bytes(meta, StoreError))
            out.setdefault(rank, dict(doc.get("attributes") or {}))
    return out
