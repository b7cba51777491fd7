"""A remote store's raw chunks read by byte range: each byte a reader needs fetched once, checked block by block.

Why this is written out rather than left to zarr-python: its ``FsspecStore`` fetches a chunk
whole for any part of it, and the checksum check before it fetched the chunk a second time
(loading one of four ranks from a store at a URL fetched 2.45x the bytes it holds,
``bench/bench_remote.py``). Zarr reads byte ranges only inside its sharding codec, and checks
only a shard index's CRC there, not the data; zckpt's checksums are its own records, one
CRC-32C per block of each chunk (:mod:`zckpt.io.checksums`), so the check has to sit where
the bytes arrive.

A raw chunk (the single ``bytes`` codec; a raw inner chunk of a shard) is its values' bytes
at offsets the layout gives (:class:`~zckpt.store.geometry.ChunkInfo`), exactly as in a
local store's files, so the store's reader (:class:`zckpt.store.reader.StoreReader`) finds the
same ranges for both and hands them here instead of to ``preadv``. Each range is widened to
the recorded blocks it touches that were not checked yet (at most one block beyond either
end, as the local reader reads), fetched in one request with its neighbours
(:func:`zckpt.io.ranged.read_objects`: coalesced, at most ``in_flight`` requests at once across
every chunk object, transient failures retried by :class:`~zckpt.io.ranged.RangedObject`), and
its blocks are checked on the fetched bytes before any of them is used. Nothing is written to
local disk. Compressed chunks still go through zarr (whole, once): a part of an encoded chunk
cannot be decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from zckpt.core.errors import StoreError
from zckpt.io.checksums import BlockCheck
from zckpt.io.ranged import DEFAULT_POLICY, ObjectPath, Pools, RangedObject, RangePolicy, read_objects
from zckpt.io.remote import Location
from zckpt.store.geometry import ChunkInfo


class ChunkRange(NamedTuple):
    """``length`` bytes at ``offset`` of chunk (or shard) object ``key`` of entry ``name``,
    at ``path`` (its URL), ``file_bytes`` long when intact; ``checks``: the recorded blocks
    to check with it (:meth:`zckpt.store.reader.StoreReader._block_checks`)."""

    name: str
    key: str
    path: Path
    offset: int
    length: int
    file_bytes: int
    checks: tuple[BlockCheck, ...]

    def hull(self) -> tuple[int, int]:
        """The bytes fetched for it: the range and the blocks its checks read."""
        lo, hi = self.offset, self.offset + self.length
        for check in self.checks:
            for sums, size, first, stop in check.parts:
                b = sums.block_size(size)
                lo, hi = min(lo, sums.origin + first * b), max(hi, sums.origin + min(size, stop * b))
        return lo, hi


class RemoteChunks:
    """The chunk objects of one remote store, read by byte range (see the module doc)."""

    def __init__(self, location: Location, policy: RangePolicy = DEFAULT_POLICY) -> None:
        self.location = location
        self.policy = policy
        self._pools = Pools(policy.in_flight)
        self._objects: dict[Path, RangedObject] = {}
        self._places: dict[tuple[str, str], ObjectPath] = {}
        self._locations: dict[Path, Location] = {}

    def chunk_at(self, array_key: str, info: ChunkInfo, coords: Sequence[int]) -> tuple[str, Path, int, int] | None:
        """``(object key, object URL, byte offset, object size)`` of a raw (inner) chunk of the
        array at ``array_key``, or ``None`` when its chunks are encoded otherwise."""
        if not info.raw or info.at is not None:
            return None
        key, offset = info.locate(coords)
        path = self._places.get((array_key, key))
        if path is None:
            loc = self.location.child(array_key, key)
            path = self._places[(array_key, key)] = ObjectPath(loc.url)
            self._locations[path] = loc
        return key, path, offset, info.file_bytes(coords)

    def _object(self, path: Path, size: int) -> RangedObject:
        obj = self._objects.get(path)
        if obj is None or obj.size != size:
            # the size the layout gives: no request to ask the server (a shorter object fails its reads)
            obj = self._objects[path] = RangedObject(self._locations[path], StoreError, size, self.policy, self._pools)
        return obj

    def read(self, ranges: Sequence[ChunkRange]) -> list[memoryview]:
        """The bytes of each range, fetched together and checked: a block that fails its
        record, a missing object or a lasting failure raises a :class:`StoreError` naming
        the chunk's object."""
        hulls = [r.hull() for r in ranges]
        by_object: dict[Path, list[int]] = {}
        for i, r in enumerate(ranges):
            by_object.setdefault(r.path, []).append(i)
        order = list(by_object.items())
        try:
            fetched = read_objects([(self._object(path, ranges[idx[0]].file_bytes),
                                     [(hulls[i][0], hulls[i][1] - hulls[i][0]) for i in idx]) for path, idx in order])
        except StoreError as err:
            raise _named(err, ranges) from err.__cause__
        got: dict[int, memoryview] = {}
        for (_, idx), datas in zip(order, fetched, strict=True):
            for i, data in zip(idx, datas, strict=True):
                got[i] = memoryview(data)
        out = []
        for i, r in enumerate(ranges):
            lo, _ = hulls[i]
            view = got[i]

            def read_at(_: Path, offset: int, length: int, view: memoryview = view, lo: int = lo) -> memoryview:
                return view[max(0, offset - lo) : max(0, offset - lo + length)]

            for check in r.checks:
                check.run(read_at)
            out.append(view[r.offset - lo : r.offset - lo + r.length])
        return out

    def close(self) -> None:
        self._pools.close()


def _named(err: StoreError, ranges: Sequence[ChunkRange]) -> StoreError:
    """A failed fetch said again naming the chunk and entry: a missing object is damage."""
    hit = next((r for r in ranges if str(r.path) == err.path), None)
    if hit is None:
        return err
    if isinstance(err.__cause__, FileNotFoundError):
        return StoreError(f"chunk {hit.key} is missing: the store is damaged", path=hit.path, param=hit.name)
    return StoreError(f"chunk {hit.key}: {err.message}", path=hit.path, param=hit.name)
