"""A job read without a source strategy: every rank file present must be the full model.

MindSpore's ``src_strategy_file=None`` means that rank_0 holds the whole model. Read that
way, a sharded job would be stored as rank 0's shard, complete and without complaint, while
the other ranks hold other bytes under the same names. So when several rank files are
present they must hold the same entries with the same bytes (a data-parallel job saves the
same model on every rank): anything else is refused, naming a parameter that differs and
the ranks, and asking for the source strategy.

Headers are compared first (a sharded job almost always fails there, before a byte is
read); then the bytes, entry by entry in blocks of at most ``block_bytes`` per file, each
block of rank 0 compared with every other rank's, stopping at the first difference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from zckpt.core.errors import SourceError
from zckpt.formats.entries import EntryInfo
from zckpt.formats.shard_reader import ShardReader
from zckpt.io import remote
from zckpt.sources.discovery import SourceFile, open_source

_ADVICE = "without a source strategy rank_0 must be the full model; pass the source strategy (--strategy / " \
          "src_strategy_file) to read a sharded job"


_MAX_BLOCK = 16 * 1024 * 1024
"""Bytes compared per step: the comparison's temporary and the mapped pages touched between
two releases stay this small whatever ``block_bytes`` allows."""


@dataclass(frozen=True)
class SameModel:
    """Rank files found equal to rank 0's (entries, types, shapes and bytes)."""

    ranks: tuple[int, ...]
    bytes_compared: int


def check_same_model(
    files: Mapping[int, SourceFile],
    storage_options: remote.StorageOptions = None,
    *,
    block_bytes: int = 64 * 1024 * 1024,
    keep: Callable[[str], bool] | None = None,
) -> SameModel:
    """Check that every rank file holds what rank 0's holds, byte for byte; refuse otherwise.

    Nothing to check when rank 0 is alone (or absent: the plan refuses that itself).
    ``keep`` limits the check to the entries an ingest keeps (its ``choice_func``).
    """
    others = sorted(r for r in files if r != 0)
    if 0 not in files or not others:
        return SameModel((), 0)
    compared = 0
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(open_source(files[0], storage_options, verify_crc=False))
        readers = {r: stack.enter_context(open_source(files[r], storage_options, verify_crc=False)) for r in others}
        for r, reader in readers.items():
            _same_entries(base, reader, r, keep)
        block = max(1, min(block_bytes // 2, _MAX_BLOCK))  # a block of rank 0 and one of the rank compared
        for name, entry in base.entries.items():
            if keep is not None and not keep(name):
                continue
            compared += _same_bytes(name, entry, base, readers, block)
    return SameModel(tuple(others), compared)


def _same_entries(base: ShardReader, other: ShardReader, rank: int, keep: Callable[[str], bool] | None) -> None:
    def kept(names: Iterable[str]) -> list[str]:
        return [n for n in names if keep is None or keep(n)]

    missing = [n for n in kept(base.entries) if n not in other.entries]
    if missing:
        raise SourceError(f"rank_0 holds it but rank {rank} does not: the ranks hold different parameters (a "
                          f"pipeline-parallel or sharded job); {_ADVICE}", path=other.path, param=missing[0])
    extra = [n for n in kept(other.entries) if n not in base.entries]
    if extra:
        raise SourceError(f"rank {rank} holds it but rank_0 does not: the ranks hold different parameters (a "
                          f"pipeline-parallel or sharded job); {_ADVICE}", path=other.path, param=extra[0])
    for name in kept(base.entries):
        e, o = base.entries[name], other.entries[name]
        if (o.kind, o.ms_type, o.shape) != (e.kind, e.ms_type, e.shape):
            raise SourceError(
                f"rank_0 holds {_describe(e)} and rank {rank} holds {_describe(o)}: the ranks hold different shards; "
                f"{_ADVICE}", path=other.path, param=name)


def _describe(e: EntryInfo) -> str:
    return f"{e.ms_type}{list(e.shape)}" if e.kind == "tensor" else f"a {e.kind}"


def _same_bytes(name: str, entry: EntryInfo, base: ShardReader, readers: Mapping[int, ShardReader], block: int) -> int:
    """Bytes compared for one entry (its size times the ranks compared)."""
    if entry.kind == "str":
        value: object = base.string(name)
        differs = [r for r, x in readers.items() if x.string(name) != value]
    elif entry.kind == "map":
        value = base.map_bytes(name)
        differs = [r for r, x in readers.items() if x.map_bytes(name) != value]
    else:
        differs = []
        for r0, mine in base.row_blocks(name, block):
            rows = mine.shape[0] if mine.ndim else 0
            for r, x in readers.items():
                if r in differs:
                    continue
                theirs = x.rows(name, r0, r0 + rows) if mine.ndim else x.array(name)
                same = _bitwise_equal(mine, theirs)
                x.release_pages()  # mapped pages count in RSS until released: one block per file at a time
                if not same:
                    differs.append(r)
                    break
            base.release_pages()
            if differs:
                break
    if differs:
        r = differs[0]
        raise SourceError(f"rank_0 and rank {r} hold different values under this name (the job is sharded); "
                          f"{_ADVICE}", path=readers[r].path, param=name)
    return entry.nbytes * len(readers)


def _bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype.itemsize != b.dtype.itemsize:
        return False
    return bool(np.array_equal(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                               np.ascontiguousarray(b).reshape(-1).view(np.uint8)))
