"""``zckpt verify``'s first check: the store against itself, by reading every chunk.

The manifest against its digest and the arrays (every entry has an array of its shape,
dtype and attributes, no array lacks an entry, every key is one safe path), and every
chunk: present where a complete (or ingested) region needs it, of the right size, matching
the CRC-32C recorded at ingest, and decodable by zarr; every shard file (format 4): its
size, its index and every writer's run in it against its record; every packed tensor's
byte range against its run's checksums. Problems are named by parameter and chunk (or
shard) key. Only the store is read here: the source shards and the exports are
:mod:`zckpt.jobs.verify_files`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Awaitable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import StoreError, ZckptError
from zckpt.core.layout import Box
from zckpt.io import safe_paths
from zckpt.io.checksums import ChunkSums, file_sums
from zckpt.jobs.verify_report import MiB, VerifyReport
from zckpt.store import packed
from zckpt.store.chunk_records import Checked
from zckpt.store.geometry import ChunkInfo
from zckpt.store.integrity import stored_type_names
from zckpt.store.manifest import EntryRecord
from zckpt.store.store import Store


def check_store(store: Store, report: VerifyReport, *, block_bytes: int = 64 * MiB) -> None:
    """Manifest against its digest and arrays, then every chunk of every array."""
    try:
        store.check_integrity()
    except ZckptError as err:
        report.add_error("store", err)
    entries = _manifest_entries(store, report)
    _orphan_arrays(store, entries, report)
    crcs = _recorded_checksums(store, report)
    checked: Checked = set()  # packed tensors share run records: each run is read once
    sizes: dict[tuple[Path, str], int] = {}
    for e in entries:
        if e.kind == "str":
            if not isinstance(e.value, str):
                report.add("store", "string entry has no value in the manifest", file=store.url, param=e.name)
            continue
        if e.offset is not None:
            _check_packed(store, e, report, checked, sizes)
            continue
        try:  # a broken array is reported and the next one checked
            arr = store.array(e.name)
            report.arrays += 1
            if not _array_matches_entry(store, e, arr, report):
                continue
            if store.complete:
                for problem in store.coverage_problems([e.name]):
                    report.add("store", f"marked complete, but {problem}", file=store.url, param=e.name)
            _check_chunks(store, e, arr, crcs.get(e.name, {}), report, block_bytes)
        except ZckptError as err:
            report.add_error("store", err)


def _manifest_entries(store: Store, report: VerifyReport) -> list[EntryRecord]:
    raw = store.manifest.get("entries", [])
    out: list[EntryRecord] = []
    seen_names: set[str] = set()
    seen_keys: set[str] = set()
    for doc in raw if isinstance(raw, list) else []:
        try:
            e = EntryRecord.from_json(doc)
        except (KeyError, TypeError, ValueError) as err:
            report.add("store", f"manifest entry {doc!r:.200} is malformed ({err})", file=store.url)
            continue
        if e.name in seen_names:
            report.add("store", "listed twice in the manifest", file=store.url, param=e.name)
            continue
        seen_names.add(e.name)
        if e.kind not in ("tensor", "map", "str"):
            report.add("store", f"manifest gives unknown kind {e.kind!r}", file=store.url, param=e.name)
            continue
        if e.kind != "str":
            problem = _key_problem(e, seen_keys)
            if problem:
                report.add("store", f"manifest key {e.key!r} {problem}", file=store.url, param=e.name)
                continue
            seen_keys.add(e.key)
        out.append(e)
    if not isinstance(raw, list):
        report.add("store", "manifest has no entry list", file=store.url)
    return out


def _key_problem(e: EntryRecord, seen: set[str]) -> str | None:
    """Why an entry's array key is unsafe, or ``None``. Checked as properties rather than
    against today's ``encode_key``, so that stores written by another zckpt version
    (whose key encoding may differ) still verify."""
    if e.offset is not None:  # a packed tensor shares its type's packed array
        return None if e.kind == "tensor" and e.key == packed.pack_key(e.ms_type) else \
            "is not the packed array of its data type"
    folder, _, node = e.key.partition("/")
    if folder != ("tensors" if e.kind == "tensor" else "maps"):
        return f"is not under the {'tensors' if e.kind == 'tensor' else 'maps'} group"
    if not node or "/" in node or "\\" in node or "\x00" in node or node.startswith((".", "_")):
        return "is not one safe path component"
    if node.lower() == "zarr.json":
        return "is the name of Zarr's metadata file"
    if e.key in seen:
        return "is shared with another entry"
    return None


def _check_packed(store: Store, e: EntryRecord, report: VerifyReport, checked: Checked,
                  sizes: dict[tuple[Path, str], int]) -> None:
    """A packed tensor: its packed chunk file present and of its size (``sizes``: the chunk
    files seen so far), and its byte range matching its recorded checksums (the blocks of the
    run its source rank recorded)."""
    if store.complete:
        for problem in store.coverage_problems([e.name]):
            report.add("store", f"marked complete, but {problem}", file=store.url, param=e.name)
    required = _required_boxes(store, e)
    if required is not None and not required:
        return  # its writer has not written it yet
    try:
        store.verify_chunks(e.name, Box.full(e.shape), checked)
        info = store.chunk_info(e.name)
        assert info.at is not None and info.folder is not None
        key = (info.folder, info.at[0])
        size = sizes[key] if key in sizes else sizes.setdefault(key, (info.folder / info.at[0]).stat().st_size)
        if size != info.at[2]:
            report.add("store", f"packed chunk holds {size} bytes, not {info.at[2]}",
                       file=store.where(e.key, info.at[0]), param=e.name)
            return
        recorded = store.records_over(e.name, info.at[0], info.at[1], info.at[1] + info.inner_bytes)
        report.arrays += 1
        report.chunks += 1
        report.chunk_bytes += info.inner_bytes
        report.checksummed_chunks += 1 if recorded else 0
        if not recorded and store.complete:
            report.add("store", "packed tensor has no recorded checksum", file=store.where(e.key, info.at[0]),
                       param=e.name)
    except FileNotFoundError as err:
        report.add("store", "packed chunk is missing", file=str(err.filename), param=e.name)
    except ZckptError as err:
        report.add_error("store", err)


def _orphan_arrays(store: Store, entries: Sequence[EntryRecord], report: VerifyReport) -> None:
    """Arrays under ``tensors/`` and ``maps/`` that no manifest entry names."""
    known = {e.key for e in entries}
    for folder in ("tensors", "maps", packed.FOLDER):
        try:
            node: Any = store.group[folder]
            keys = list(node.array_keys())
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        for k in sorted(keys):
            if f"{folder}/{k}" not in known:
                report.add("store", "array is not in the manifest", file=store.where(folder, k))


def _array_matches_entry(store: Store, e: EntryRecord, arr: Any, report: VerifyReport) -> bool:
    ok = True
    where = store.where(e.key)

    def bad(message: str) -> None:
        nonlocal ok
        ok = False
        report.add("store", message, file=where, param=e.name)

    want_dtype = ms_dtype(e.ms_type).storage if e.kind == "tensor" else np.dtype("u1")
    stored = store.data_type(e.name)
    allowed = stored_type_names(e.ms_type if e.kind == "tensor" else "map")
    if np.dtype(arr.dtype) != want_dtype or stored not in allowed:
        bad(f"array data type {stored} but the manifest's {e.ms_type} needs {' or '.join(allowed)}")
    if e.kind == "tensor" and tuple(arr.shape) != tuple(e.shape):
        bad(f"array shape {list(arr.shape)} but the manifest says {list(e.shape)}")
    if e.kind == "map" and len(arr.shape) != 1:
        bad(f"map array has shape {list(arr.shape)}, not one dimension of bytes")
    attrs: Any = arr.attrs.get("zckpt")
    if not isinstance(attrs, dict):
        bad("array has no zckpt attributes")
        return ok
    for key, want in (("name", e.name), ("ms_dtype", e.ms_type), ("kind", e.kind)):
        if attrs.get(key) != want:
            bad(f"array attribute {key} is {attrs.get(key)!r}, the manifest says {want!r}")
    return ok


def _recorded_checksums(store: Store, report: VerifyReport) -> dict[str, dict[str, ChunkSums]]:
    try:
        return store.checksums()
    except (ZckptError, KeyError, TypeError, ValueError, AttributeError) as err:
        report.add("store", f"recorded chunk checksums cannot be read ({err})", file=store.url)
        return {}


def _required_boxes(store: Store, e: EntryRecord) -> list[Box] | None:
    """Regions whose chunks must exist: everything in a complete store (``None``), else
    the boxes of the writers already ingested."""
    if store.complete:
        return None
    done = store.ingested_ranks()
    return [b for r, b in store.writers(e.name) if r in done]


def chunk_grid(shape: Sequence[int], chunks: Sequence[int]) -> Iterator[tuple[tuple[int, ...], Box]]:
    """Every chunk's coordinates and element box (clipped to the array)."""
    if any(s == 0 for s in shape):
        return
    counts = [math.ceil(s / c) for s, c in zip(shape, chunks, strict=True)]
    for coords in itertools.product(*(range(n) for n in counts)):
        start = tuple(i * c for i, c in zip(coords, chunks, strict=True))
        stop = tuple(min(s, a + c) for s, a, c in zip(shape, start, chunks, strict=True))
        yield tuple(coords), Box(start, stop)


def _check_chunks(
    store: Store, e: EntryRecord, arr: Any, crcs: dict[str, ChunkSums], report: VerifyReport, block_bytes: int
) -> None:
    """Fetch every chunk's stored bytes (concurrently, ``block_bytes`` at a time) and check
    presence, size (for raw chunks), recorded checksum and that zarr decodes it."""
    info = store.chunk_info(e.name)
    if info.per_shard is not None and info.raw and info.folder is not None:
        _check_shards(store, e, info, crcs, report)
        return
    from zckpt.io.zarr_local import default_buffer_prototype  # zarr-python: only for chunks read through it

    shape = tuple(arr.shape)
    chunks = tuple(arr.chunks)
    itemsize = np.dtype(arr.dtype).itemsize
    raw = _is_raw(arr)
    chunk_bytes = math.prod(chunks) * itemsize
    required = _required_boxes(store, e)
    zstore = store.group.store
    prefix = arr.path
    per_batch = max(1, block_bytes // max(1, chunk_bytes))
    grid = iter(chunk_grid(shape, chunks))
    while True:
        batch = list(itertools.islice(grid, per_batch))
        if not batch:
            break
        keys = [arr.metadata.encode_chunk_key(coords) for coords, _ in batch]
        got = _gather([zstore.get(f"{prefix}/{k}", prototype=default_buffer_prototype()) for k in keys])
        for (_, box), key, buf in zip(batch, keys, got, strict=True):
            region = f"chunk {key} (elements {box.to_json()})"
            where = store.where(prefix, key)
            if buf is None:
                _missing(report, "chunk", box, required, file=where, param=e.name, region=region)
                continue
            data = buf.to_bytes()
            report.chunks += 1
            report.chunk_bytes += len(data)
            want_crc = crcs.get(key)
            if want_crc is not None:
                report.checksummed_chunks += 1
                bad = want_crc.check_whole(data)
                if bad is not None:
                    report.add("store", f"chunk fails its checksum ({bad})", file=where, param=e.name, region=region)
                    continue
            if raw:
                if len(data) != chunk_bytes:
                    report.add("store", f"chunk holds {len(data)} bytes, its {list(chunks)} x {arr.dtype} need "
                                        f"{chunk_bytes}", file=where, param=e.name, region=region)
                continue
            try:
                np.asarray(arr[box.slices()])
            except Exception as err:  # zarr's codecs raise many types for a damaged chunk
                report.add("store", f"chunk cannot be decoded ({type(err).__name__}: {err})", file=where,
                           param=e.name, region=region)


def _check_shards(store: Store, e: EntryRecord, info: ChunkInfo, crcs: dict[str, ChunkSums],
                  report: VerifyReport) -> None:
    """Every shard file of a raw sharded array, read through one buffer: present where a
    complete (or ingested) region needs it, of its size, its index exactly the one the
    layout gives, and every run recorded in it matching its CRC-32C blocks."""
    assert info.folder is not None and info.per_shard is not None
    required = _required_boxes(store, e)
    buffer = bytearray(MiB)
    for shard in itertools.product(*(range(n) for n in info.shard_count())):
        key = info.chunk_key(shard)
        path = info.folder / key
        start = tuple(s * k * c for s, k, c in zip(shard, info.per_shard, info.chunks, strict=True))
        stop = tuple(min(n, a + k * c) for n, a, k, c in zip(info.shape, start, info.per_shard, info.chunks,
                                                             strict=True))
        box = Box(start, stop)
        region = f"shard {key} (elements {box.to_json()})"
        where = store.where(e.key, key)
        size = safe_paths.regular_size(path, StoreError, e.name)
        if size is None:
            _missing(report, "shard", box, required, file=where, param=e.name, region=region)
            continue
        data_bytes, index = info.shard_layout(shard)
        report.chunks += data_bytes // max(1, info.inner_bytes)  # inner chunks, as an unsharded store counts them
        report.chunk_bytes += min(size, data_bytes)
        if size != data_bytes + len(index):
            report.add("store", f"shard holds {size} bytes, its inner chunks and index need "
                                f"{data_bytes + len(index)}", file=where, param=e.name, region=region)
            continue
        with safe_paths.open_binary(path, StoreError, e.name) as f:
            f.seek(data_bytes)
            if f.read() != index:
                report.add("store", "shard index differs from the one its layout gives", file=where, param=e.name,
                           region=region)
        for want in (v for k, v in crcs.items() if k.partition("@")[0] == key):
            report.checksummed_chunks += (want.length or 0) // max(1, info.inner_bytes)
            got, n = file_sums(path, want.block_bytes, want.algo, buffer, want.origin, want.length)
            bad = want.compare(got, 0, want.length if want.length is not None else n, whole=True)
            if bad is not None:
                report.add("store", f"fails its checksum ({want.where()}{bad})", file=where, param=e.name,
                           region=region)


def _missing(report: VerifyReport, what: str, box: Box, required: list[Box] | None, *, file: str | Path,
             param: str, region: str) -> None:
    """A chunk or shard that is not there: a mismatch where a complete store (``required``
    ``None``) or an ingested region needs it, else a region not written yet."""
    if required is None or any(box.intersect(b) is not None for b in required):
        report.add("store", f"{what} is missing" + (" from a complete store" if required is None else
                                                    " from an ingested region"),
                   file=file, param=param, region=region)


def _is_raw(arr: Any) -> bool:
    """Chunks stored as plain bytes (the single ``bytes`` codec): decoding is a size check."""
    codecs: Sequence[Any] = getattr(arr.metadata, "codecs", ())
    return len(codecs) == 1 and type(codecs[0]).__name__ == "BytesCodec"


def _gather(coros: Sequence[Awaitable[Any]]) -> list[Any]:
    from zckpt.io.zarr_local import sync as zarr_sync  # zarr-python: only for chunks read through it

    async def run() -> list[Any]:
        return list(await asyncio.gather(*coros))

    result: list[Any] = zarr_sync(run()) if coros else []
    return result
