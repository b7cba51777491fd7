"""The checksum records of a store's chunks, as its progress records hold them, found by file and byte range.

Each source rank's progress record (:mod:`zckpt.store.records`) lists the checksums of what
it wrote: per chunk file (unsharded arrays, and every array of stores up to format 3), or
per run of a shard or of a packed chunk, as text (:func:`zckpt.store.records.decode_runs`).
:class:`ChunkRecords` gathers them once per process and answers "which records cover these
bytes of this file", decoding a rank's run text only when a range can meet it. Reading the
bytes and comparing them is :mod:`zckpt.store.chunk_files` (local) and
:mod:`zckpt.store.zarr_arrays` (remote).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from zckpt.core.errors import StoreError
from zckpt.io.checksums import ChunkSums, Mismatch
from zckpt.store import packed
from zckpt.store.manifest import EntryRecord
from zckpt.store.records import decode_runs

Checked = set[tuple[str, str, int]]
"""Chunk blocks already checked in this process: ``(entry name, record key, block index)``."""


def all_checked(done: Checked | None, name: str, key: str, sums: ChunkSums) -> bool:
    return done is not None and all((name, key, i) in done for i in range(len(sums.values)))


def refuse_mismatch(bad: Mismatch | None, key: str, where: str, name: str, want: ChunkSums | None = None) -> None:
    """A chunk that fails its checksum, refused naming chunk, file and parameter."""
    if bad is not None:
        place = want.where() if want is not None else ""
        raise StoreError(f"chunk {key} fails its checksum ({place}{bad}): the store is damaged", path=where,
                         param=name)


class ChunkRecords:
    """Every chunk checksum record of one store, read from its progress records on first use.

    ``attributes`` gives ``(rank, record)`` of every progress record in rank order;
    ``check`` refuses a record that lost its checksums (digests are checked once per command
    by :meth:`zckpt.store.store.Store.check_integrity`); ``entry`` finds a manifest entry by
    name (packed tensors file their records under their packed array's name)."""

    def __init__(self, attributes: Callable[[], list[tuple[int, dict[str, Any]]]],
                 check: Callable[[int, dict[str, Any]], None], entry: Callable[[str], EntryRecord | None]) -> None:
        self._attributes = attributes
        self._check = check
        self._entry = entry
        self._crcs: dict[str, dict[str, ChunkSums]] | None = None
        self._records: dict[tuple[str, str, int], list[tuple[str, ChunkSums]]] = {}
        self._index: dict[tuple[str, str], tuple[list[int], list[int], list[str]]] = {}
        self._plain: dict[str, dict[str, ChunkSums]] | None = None
        self._texts: dict[tuple[str, str], list[str]] | None = None
        self._owners: set[str] | None = None

    def checksums(self) -> dict[str, dict[str, ChunkSums]]:
        """Checksums of every chunk, as recorded by the source rank that wrote it: per block
        (``crc32c_blocks``), or one per chunk in stores of version 2 and older. In sharded
        arrays, one record per run a rank wrote, keyed ``<shard key>@<offset>`` (its
        :attr:`~zckpt.io.checksums.ChunkSums.origin` and ``length`` say where it lies)."""
        if self._crcs is None:
            crcs = {name: dict(per) for name, per in self._chunk_records().items()}
            for name, key in list(self._run_texts()):
                crcs.setdefault(name, {}).update(self.records_in(name, key))
            self._crcs = crcs
        return self._crcs

    def _chunk_records(self) -> dict[str, dict[str, ChunkSums]]:
        """The records of unsharded chunks (the run records are kept as text until asked)."""
        if self._plain is None:
            plain: dict[str, dict[str, ChunkSums]] = {}
            texts: dict[tuple[str, str], list[str]] = {}
            for rank, attrs in self._attributes():
                self._check(rank, attrs)
                blocks: Any = attrs.get("crc32c_blocks", {})
                if blocks:
                    size = int(blocks["block_bytes"])
                    for name, per in blocks.get("chunks", {}).items():
                        plain.setdefault(name, {}).update(
                            {k: ChunkSums("crc32c", tuple(int(x) for x in v), size) for k, v in per.items()})
                    for name, shards in blocks.get("runs", {}).items():
                        for key, text in shards.items():
                            texts.setdefault((name, key), []).append(f"{size} {text}")
                    for pack, chunks in blocks.get("packed", {}).items():  # runs of packed tensors
                        for key, text in chunks.items():
                            texts.setdefault((packed.record_owner(pack), key), []).append(f"{size} {text}")
                for algo in ("crc32c", "crc32"):
                    recorded: Any = attrs.get(algo, {})
                    for name, per in recorded.items():
                        plain.setdefault(name, {}).update({k: ChunkSums(algo, (int(v),)) for k, v in per.items()})
            self._plain, self._texts = plain, texts
        return self._plain

    def _run_texts(self) -> dict[tuple[str, str], list[str]]:
        self._chunk_records()
        assert self._texts is not None
        return self._texts

    def record_owner(self, name: str) -> str:
        """Under which name the checksum records of entry ``name`` are filed: a packed
        tensor's are its packed array's runs (:func:`zckpt.store.packed.record_owner`), shared with
        the tensors written together, unless its writer recorded one run per tensor. Blocks
        checked once per command are remembered under this name."""
        e = self._entry(name)
        if e is None or e.offset is None:
            return name
        owner = packed.record_owner(e.key)
        if self._owners is None:
            self._owners = {n for n, _ in self._run_texts()}
        # a tensor with a record of its own (a rank ingested by the first format-6 zckpt) keeps it
        return owner if owner in self._owners and name not in self._owners else name

    def records_in(self, name: str, file_key: str) -> list[tuple[str, ChunkSums]]:
        """``(record key, sums)`` of every checksum record of one chunk or shard file, in
        file order (a chunk file has one record covering it, a shard one per run)."""
        name = self.record_owner(name)
        per = self._chunk_records().get(name, {})
        if file_key in per:
            return [(file_key, per[file_key])]
        return self.records_over(name, file_key, 0, 2**63)

    def records_over(self, name: str, file_key: str, start: int, stop: int) -> list[tuple[str, ChunkSums]]:
        """The records of :meth:`records_in` that bytes ``[start, stop)`` of the file meet.
        A shard's run records stay text until a range needs them: each rank's text is placed
        by its first and last run (found without decoding it), and only the texts a range
        can meet are decoded, so a task reading a part of a shard written by hundreds of
        ranks decodes the few runs it reads."""
        name = self.record_owner(name)
        per = self._chunk_records().get(name, {})
        if file_key in per:
            return [(file_key, per[file_key])]
        index = self._text_index(name, file_key)
        if index is None:
            return []
        firsts, reach, texts = index
        out: list[tuple[str, ChunkSums]] = []
        k = bisect.bisect_left(firsts, stop) - 1
        while k >= 0 and reach[k] > start:
            for rec in self._decoded(name, file_key, k, texts[k]):
                if rec[1].covers(start, stop) is not None:
                    out.append(rec)
            k -= 1
        out.sort(key=lambda kv: kv[1].origin)
        return out

    def _text_index(self, name: str, file_key: str) -> tuple[list[int], list[int], list[str]] | None:
        """The run texts of a shard sorted by first offset, with the furthest end reached by
        any text up to each one (so a backward scan from a range's end can stop)."""
        key = (name, file_key)
        got = self._index.get(key)
        if got is None:
            texts = self._run_texts().get(key)
            if not texts:
                return None
            placed = []
            for text in texts:
                body = text.partition(" ")[2]
                first = body[: body.index(":")]
                o, n, _ = body.rpartition(" ")[2].split(":")
                placed.append((int(first), int(o) + int(n), text))
            placed.sort(key=lambda x: x[0])
            reach, far = [], 0
            for _, end, _ in placed:
                far = max(far, end)
                reach.append(far)
            got = self._index[key] = ([p[0] for p in placed], reach, [p[2] for p in placed])
        return got

    def _decoded(self, name: str, file_key: str, k: int, text: str) -> list[tuple[str, ChunkSums]]:
        got = self._records.get((name, file_key, k))
        if got is None:
            size, _, body = text.partition(" ")
            got = self._records[(name, file_key, k)] = [
                (f"{file_key}@{o}", ChunkSums("crc32c", v, int(size), o, n)) for o, n, v in decode_runs(body)]
        return got

