"""Progress records of an ingest: one small JSON file per source rank, ``progress/rank_<r>.json``.

A record says that every byte its rank writes is in the store, with the checksums that prove
them (``docs/store-format.md``, "Progress records"). It is written once, whole, under a
temporary name and renamed (:func:`zckpt.io.fileio.write_atomic`), after the rank's bytes: a
crash never leaves a rank marked done without its checksums, and parallel workers each write
their own name. Stores up to format 4 kept the same document as the attributes of a zarr
group ``progress/rank_<r>``; creating hundreds of groups through zarr cost more than the
ingest's own copying at 512 ranks, so format 5 writes plain files, and both are read here.

From format 7, an ingest running its ranks in one process records them in groups: the ranks
of a contiguous range finished together share one file, ``progress/ranks_<first>-<last>.json``
(a list of the same documents), so that hundreds of source ranks make a few dozen files
(creating and renaming 512 record files cost 0.5-0.75 s of CPU at 512 ranks). A group's file
is written once all of its ranks' bytes are written, like a single record; a crash loses
the records of the group being filled, and those ranks are redone.

Records are zckpt's bookkeeping, not arrays: they live in the directory of ``progress``, a
zero-length array (:func:`define_folder`), which zarr never lists.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from zckpt.core.errors import StoreError
from zckpt.io import safe_paths
from zckpt.io.fileio import write_atomic

FOLDER = "progress"
FILE_VERSION = 5
"""Store format version from which records are files (earlier: zarr groups)."""
GROUP_VERSION = 7
"""Store format version from which several ranks' records may share a file."""
_FILE = re.compile(r"rank_(0|[1-9][0-9]*)\.json")
_GROUP = re.compile(r"rank_(0|[1-9][0-9]*)")
_RANGE = re.compile(r"ranks_(0|[1-9][0-9]*)-(0|[1-9][0-9]*)\.json")


FOLDER_ATTRIBUTES = {"zckpt": {"records": "progress/rank_<r>.json, one per source rank done"}}


def define_folder(group: Any) -> None:
    """Create ``progress`` in a new store's root ``group`` as a zero-length ``uint8`` array:
    the record files live in its directory, where zarr looks only for chunk keys, so a zarr
    reader walking the hierarchy meets one empty array and no unknown objects (in a group,
    every file would be reported as "not recognized as a component of a Zarr hierarchy")."""
    group.create_array(FOLDER, shape=(0,), chunks=(1,), dtype="uint8", fill_value=0, compressors=None,
                       attributes=FOLDER_ATTRIBUTES)


def folder_document() -> dict[str, Any]:
    """The ``zarr.json`` that :func:`define_folder` has zarr-python write (tests compare the
    two), for local stores, which write it without importing zarr-python."""
    return {"shape": [0], "data_type": "uint8",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": 0, "codecs": [{"name": "bytes"}], "attributes": FOLDER_ATTRIBUTES, "zarr_format": 3,
            "node_type": "array", "storage_transformers": []}


def file_name(rank: int) -> str:
    """The record's name inside ``progress/``."""
    return f"rank_{rank}.json"


def canonical(doc: Any) -> bytes:
    """``doc`` as canonical JSON (sorted keys, no spaces): the same document is the same bytes
    whichever process wrote it and in whatever order its parts were gathered (threads,
    workers, the helper process)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")


def encode(rank: int, info: Mapping[str, Any]) -> bytes:
    """The record file's bytes: ``{"bytes": ..., "crc32c_blocks": ..., "rank": r, ...}`` as
    canonical JSON (:func:`canonical`)."""
    return canonical({"rank": rank, **info})


def range_name(first: int, last: int) -> str:
    """The name of the file holding the records of ranks ``first`` to ``last`` (a single
    rank's is :func:`file_name`)."""
    return file_name(first) if first == last else f"ranks_{first}-{last}.json"


def ranges(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """``ranks`` as maximal runs of consecutive ranks ``(first, last)``, in order."""
    out: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r - 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out


def encode_range(infos: Mapping[int, Mapping[str, Any]]) -> bytes:
    """A range file's bytes: the records of its ranks in order, a JSON list."""
    return ("[" + ",".join(encode(r, infos[r]).decode("utf-8") for r in sorted(infos)) + "]").encode("utf-8")


def encode_runs(runs: Iterable[tuple[int, int, Sequence[int]]]) -> str:
    """A shard's run records as one JSON string (progress groups stay small and quick to
    parse at hundreds of thousands of runs): ``"<offset>:<length>:<sum>.<sum>... ..."``,
    offsets and lengths in decimal, each block's CRC-32C as 8 hexadecimal digits."""
    return " ".join(f"{o}:{n}:" + ".".join(f"{int(v):08x}" for v in sums) for o, n, sums in runs)


def decode_runs(text: str) -> list[tuple[int, int, tuple[int, ...]]]:
    """The ``(offset, length, block sums)`` of every run :func:`encode_runs` wrote."""
    out = []
    for item in text.split():
        o, n, sums = item.split(":")
        out.append((int(o), int(n), tuple(int(v, 16) for v in sums.split("."))))
    return out


def decode_named(data: bytes, name: str, where: str) -> dict[int, dict[str, Any]]:
    """The records of a record file named ``name`` (one rank's or a range's), each checked
    to describe the rank its name says."""
    got = ranks_of(name)
    if got is None:
        raise StoreError("not a progress record's name", path=where)
    first, last = got
    if first == last:
        return {first: decode(data, first, where)}
    try:
        docs = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise StoreError("progress record is not JSON: the store is damaged", path=where) from None
    want = list(range(first, last + 1))
    if not isinstance(docs, list) or [d.get("rank") if isinstance(d, dict) else None for d in docs] != want:
        raise StoreError(f"progress record does not describe ranks {first} to {last}: the store is damaged",
                         path=where)
    return {r: d for r, d in zip(want, docs, strict=True)}


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


def files_for(infos: Mapping[int, Mapping[str, Any]]) -> list[tuple[str, bytes]]:
    """The record files of several ranks (format 7): ``(name, bytes)`` of one file per run of
    consecutive ranks (:func:`range_name`)."""
    out = []
    for first, last in ranges(infos):
        part = {r: infos[r] for r in range(first, last + 1)}
        out.append((range_name(first, last), encode(first, part[first]) if first == last else encode_range(part)))
    return out


def write_many(root: Path, infos: Mapping[int, Mapping[str, Any]]) -> None:
    """Record several ranks done in the local store at ``root`` (:func:`files_for`), each
    file written as :func:`write` writes one."""
    for name, data in files_for(infos):
        write_atomic(root / FOLDER / name, data, fsync=False)


def regroup_local(root: Path, ranks: Sequence[int], group: int) -> None:
    """Rewrite the records of ``ranks``, one file each (written by tasks on a cluster), as the
    files an ingest running in one process writes: ``group`` ranks at a time, in order, each
    run of consecutive ranks in one file (:func:`files_for`), so that the store is the same
    bytes however it was written. A group's file is written before its ranks' own files are
    removed: a crash in between leaves ranks in two files with the same records."""
    if group <= 1:
        return
    folder = root / FOLDER
    for i in range(0, len(ranks), group):
        part = list(ranks[i:i + group])
        infos = {}
        for r in part:
            path = folder / file_name(r)
            infos[r] = {k: v for k, v in decode(safe_paths.read_bytes(path, StoreError), r, str(path)).items()
                        if k != "rank"}
        written = set()
        for name, data in files_for(infos):
            write_atomic(folder / name, data, fsync=False)
            written.add(name)
        for r in part:
            if file_name(r) not in written:
                (folder / file_name(r)).unlink(missing_ok=True)


def forget(
    names: Iterable[str], ranks: Iterable[int], *, read: Callable[[str], bytes],
    write: Callable[[str, bytes], None], remove: Callable[[str], None], where: Callable[[str], str],
) -> None:
    """Remove the records of ``ranks`` from the record files ``names`` (of format 5 and
    later) of a ``progress`` folder read, written and removed through the callables: a
    rank's own file goes; a range file holding one of them goes once the records of its
    other ranks are written again as smaller ranges, so that a crash between never loses
    a record (a rank then found in two files has the same record in both)."""
    gone = set(ranks)
    for n in sorted(names):
        got = ranks_of(n)
        if got is None or not gone.intersection(range(got[0], got[1] + 1)):
            continue
        if got[0] != got[1]:
            kept = {r: {k: v for k, v in d.items() if k != "rank"}
                    for r, d in decode_named(read(n), n, where(n)).items() if r not in gone}
            for name, data in files_for(kept):
                write(name, data)
        remove(n)


def forget_local(root: Path, ranks: Iterable[int]) -> None:
    """:func:`forget` in the local store at ``root``."""
    folder = root / FOLDER
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    forget(names, ranks, read=lambda n: safe_paths.read_bytes(folder / n, StoreError),
           write=lambda n, data: write_atomic(folder / n, data, fsync=False),
           remove=lambda n: (folder / n).unlink(missing_ok=True), where=lambda n: str(folder / n))


def ranks_of(name: str) -> tuple[int, int] | None:
    """``(first, last)`` ranks of a record file's name in ``progress/`` (``rank_<r>.json`` or,
    format 7, ``ranks_<first>-<last>.json``); ``None`` for anything else, and for a range
    that is not one (its last rank not after its first)."""
    m = _FILE.fullmatch(name)
    if m is not None:
        return int(m.group(1)), int(m.group(1))
    m = _RANGE.fullmatch(name)
    if m is None or int(m.group(2)) <= int(m.group(1)):
        return None
    return int(m.group(1)), int(m.group(2))


def rank_of(name: str) -> tuple[int, bool] | None:
    """``(rank, is_file)`` for a record's name in ``progress/``: ``rank_<r>.json`` (a file,
    format 5) or ``rank_<r>`` (a zarr group, formats 1 to 4); ``None`` for anything else."""
    m = _FILE.fullmatch(name)
    if m is not None:
        return int(m.group(1)), True
    m = _GROUP.fullmatch(name)
    return (int(m.group(1)), False) if m is not None else None


def local_ranks(root: Path) -> set[int]:
    """Ranks with a record in the local store at ``root`` (files, named by the ranks they
    hold, and format-4 groups)."""
    folder = root / FOLDER
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return set()
    out: set[int] = set()
    for n in names:
        span = ranks_of(n)
        if span is not None:
            out.update(range(span[0], span[1] + 1))
            continue
        got = rank_of(n)
        if got is not None and (got[1] or (folder / n / "zarr.json").is_file()):
            out.add(got[0])
    return out


def read_local(root: Path, found_in: dict[int, str] | None = None) -> dict[int, dict[str, Any]]:
    """Every record of the local store at ``root``: the files' documents (one rank's or a
    range's) and the attributes of format-4 groups (``{rank: record}``). ``found_in``
    receives, per rank, the file its record was read from (relative to ``root``), which
    errors about that record name."""
    folder = root / FOLDER
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return {}
    out: dict[int, dict[str, Any]] = {}
    where = {} if found_in is None else found_in
    for n in names:
        if ranks_of(n) is not None:
            path = folder / n
            got_docs = decode_named(safe_paths.read_bytes(path, StoreError), n, str(path))
            out.update(got_docs)
            where.update(dict.fromkeys(got_docs, f"{FOLDER}/{n}"))
            continue
        got = rank_of(n)  # not a file: a format-4 group
        meta = folder / n / "zarr.json"
        if got is not None and meta.is_file():
            doc = json.loads(safe_paths.read_bytes(meta, StoreError))
            out.setdefault(got[0], dict(doc.get("attributes") or {}))
            where.setdefault(got[0], f"{FOLDER}/{n}/zarr.json")
    return out
