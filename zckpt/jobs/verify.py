"""``zckpt verify``: prove a store (and optionally its sources and exports) intact, by reading.

Three independent checks, each reporting every mismatch it finds instead of stopping at
the first, so that one run says everything that is wrong:

* **store** -- the manifest against the arrays (every entry has an array of its shape,
  dtype and attributes, no array lacks an entry), and every chunk: present where a
  complete (or ingested) region needs it, of the right size, matching the CRC-32C recorded
  at ingest, and decodable by zarr; every shard file (format 4): its size, its index and
  every writer's run in it against its record. Problems are named by parameter and chunk
  (or shard) key.
* **sources** -- every source shard equals its box of the store, byte for byte (the boxes
  come from the same plan ingest uses), replicas included. The store's digests are not keyed
  (an edit can recompute them); this comparison is what finds such a consistent forgery
  (``zckpt verify STORE --sources SRC_DIR``).
* **exports** -- every destination rank file (``.ckpt``, ``.safetensors`` or a split
  safetensors index) holds exactly the entries the export plan gives it, in order (unless
  ``any_order``; safetensors files have no order), with the store's dtype, the slice's
  shape and the slice's bytes.

Nothing is written. Memory is bounded by ``block_bytes`` (plus one row when a row is
wider, and one chunk).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import StoreError, ZckptError
from zckpt.core.layout import Box
from zckpt.formats.opener import open_shard
from zckpt.formats.shard_reader import INDEX_SUFFIX, ShardReader
from zckpt.formats.strategy import StrategyMap
from zckpt.io import remote, safe_paths
from zckpt.io.checksums import ChunkSums, file_sums
from zckpt.plan.plans import build_export_plan
from zckpt.sources.prepare import prepare_ingest
from zckpt.store import packed
from zckpt.store.integrity import stored_type_names
from zckpt.store.reader import reading
from zckpt.store.store import Checked, ChunkInfo, EntryRecord, Store

MiB = 1024 * 1024


@dataclass(frozen=True)
class Mismatch:
    """One problem found: where (file, parameter, region) and what."""

    check: str
    """``"store"``, ``"source"`` or ``"export"``."""
    message: str
    file: str | None = None
    param: str | None = None
    region: str | None = None

    def render(self) -> str:
        where = [f"file {self.file}"] if self.file else []
        if self.param is not None:
            where.append(f"parameter {self.param!r}")
        if self.region:
            where.append(self.region)
        return f"[{self.check}] " + (", ".join(where) + ": " if where else "") + self.message

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "message": self.message, "file": self.file, "param": self.param,
                "region": self.region}


@dataclass
class VerifyReport:
    """Counts of what was checked, and every mismatch."""

    store: str
    arrays: int = 0
    chunks: int = 0
    chunk_bytes: int = 0
    checksummed_chunks: int = 0
    source_files: int = 0
    source_bytes: int = 0
    export_files: int = 0
    export_bytes: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    source_choices: dict[int, tuple[str, tuple[str, ...], str]] = field(default_factory=dict)
    """Source rank directories that held several checkpoint files: (file read, candidates, rule)."""

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def add(self, check: str, message: str, *, file: str | Path | None = None, param: str | None = None,
            region: str | None = None) -> None:
        self.mismatches.append(Mismatch(check, message, None if file is None else str(file), param, region))

    def add_error(self, check: str, err: ZckptError) -> None:
        self.add(check, err.message, file=err.path, param=err.param)

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store, "ok": self.ok, "arrays": self.arrays, "chunks": self.chunks,
            "chunk_bytes": self.chunk_bytes, "checksummed_chunks": self.checksummed_chunks,
            "source_files": self.source_files, "source_bytes": self.source_bytes,
            "export_files": self.export_files, "export_bytes": self.export_bytes,
            "mismatches": [m.to_json() for m in self.mismatches],
            "source_file_choices": {str(r): {"file": f, "candidates": list(c), "rule": why}
                                    for r, (f, c, why) in self.source_choices.items()},
        }


def verify(
    store_path: str | Path,
    src: str | Path | None = None,
    src_strategy: str | Path | StrategyMap | None = None,
    *,
    against: str | Path | None = None,
    dst_strategy: str | Path | StrategyMap | None = None,
    prefix: str = "checkpoint_",
    any_order: bool = False,
    block_bytes: int = 64 * MiB,
    storage_options: remote.StorageOptions = None,
    file_suffix: str | None = None,
    choice_func: Callable[[str], bool] | None = None,
) -> VerifyReport:
    """Check the store, then (``src``) the sources against it, then (``against``) an export.

    The store may be a URL (``s3://...``; ``storage_options`` configure its filesystem): its
    chunks are fetched through zarr's store API. ``src`` and ``against`` are compared as
    local files only.
    A store that cannot be opened at all raises its :class:`~zckpt.core.errors.StoreError`;
    everything else found is collected in the report.
    """
    remote.require_local("zckpt verify", sources=src, exports=against)
    with reading(store_path):
        store = Store.open(store_path, storage_options=storage_options)
        report = VerifyReport(store.url)
        check_store(store, report, block_bytes=block_bytes)
        if src is not None:
            check_sources(store, src, src_strategy, report, block_bytes=block_bytes, file_suffix=file_suffix,
                          choice_func=choice_func)
        if against is not None:
            check_export(store, against, dst_strategy, report, prefix=prefix, block_bytes=block_bytes,
                         any_order=any_order)
    return report


# --------------------------------------------------------------------------- store


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
    from zckpt.io.zarr_local import default_buffer_prototype

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
                if required is None or any(box.intersect(b) is not None for b in required):
                    report.add("store", "chunk is missing" + (" from a complete store" if required is None else
                                                              " from an ingested region"),
                               file=where, param=e.name, region=region)
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
            if required is None or any(box.intersect(b) is not None for b in required):
                report.add("store", "shard is missing" + (" from a complete store" if required is None else
                                                          " from an ingested region"),
                           file=where, param=e.name, region=region)
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


def _is_raw(arr: Any) -> bool:
    """Chunks stored as plain bytes (the single ``bytes`` codec): decoding is a size check."""
    codecs: Sequence[Any] = getattr(arr.metadata, "codecs", ())
    return len(codecs) == 1 and type(codecs[0]).__name__ == "BytesCodec"


def _gather(coros: Sequence[Awaitable[Any]]) -> list[Any]:
    from zckpt.io.zarr_local import sync as zarr_sync

    async def run() -> list[Any]:
        return list(await asyncio.gather(*coros))

    result: list[Any] = zarr_sync(run()) if coros else []
    return result


# --------------------------------------------------------------------------- comparisons


def first_difference(a: np.ndarray, b: np.ndarray) -> tuple[int, ...] | None:
    """Index of the first element whose bytes differ (``None``: identical bytes)."""
    if a.shape != b.shape or a.dtype.itemsize != b.dtype.itemsize:
        return ()
    ua = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    ub = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    diff = np.flatnonzero(ua != ub)
    if not diff.size:
        return None
    flat = int(diff[0]) // max(1, a.dtype.itemsize)
    return tuple(int(i) for i in np.unravel_index(flat, a.shape)) if a.shape else ()


def compare_tensor(
    reader: ShardReader, name: str, arr: Any, box: Box, block_bytes: int
) -> tuple[int, tuple[int, ...] | None]:
    """Compare a file's tensor with the store's region ``box``, band by band.

    Returns the bytes compared and the global index of the first differing element
    (``None`` when equal).
    """
    if box.ndim == 0:
        mine = reader.array(name)
        return mine.nbytes, (None if first_difference(mine, np.asarray(arr[()])) is None else ())
    if box.size == 0:
        return 0, None
    rest = box.slices()[1:]
    done = 0
    for r0, block in reader.row_blocks(name, block_bytes):
        start = box.start[0] + r0
        stored = np.asarray(arr[(slice(start, start + block.shape[0]), *rest)])
        at = first_difference(block, stored)
        done += block.nbytes
        if at is not None:
            if not at:
                return done, tuple(box.start)
            return done, tuple(a + o for a, o in zip(at, (start, *box.start[1:]), strict=True))
    return done, None


def _where(index: tuple[int, ...], box: Box) -> str:
    return f"region {box.to_json()}, first difference at element {list(index)}"


def _compare_entry(
    check: str,
    reader: ShardReader,
    store: Store,
    e: EntryRecord,
    box: Box,
    report: VerifyReport,
    block_bytes: int,
    count: Callable[[int], None],
) -> None:
    """One entry of a file against the store: kind, dtype, shape and bytes."""
    mine = reader.entries.get(e.name)
    if mine is None:
        report.add(check, "entry is missing from the file", file=reader.path, param=e.name)
        return
    if mine.kind != e.kind:
        report.add(check, f"file holds a {mine.kind} entry, the store a {e.kind}", file=reader.path, param=e.name)
        return
    try:
        if e.kind == "str":
            if reader.string(e.name) != e.value:
                report.add(check, "string value differs from the store's", file=reader.path, param=e.name)
            return
        arr = store.array(e.name)
        if e.kind == "map":
            body = reader.map_bytes(e.name)
            count(len(body))
            if body != np.asarray(arr[...]).tobytes():
                report.add(check, "map entry bytes differ from the store's", file=reader.path, param=e.name)
            return
        if mine.ms_type != e.ms_type:
            report.add(check, f"dtype {mine.ms_type} but the store holds {e.ms_type}", file=reader.path,
                       param=e.name)
            return
        if mine.shape != box.shape:
            report.add(check, f"shape {list(mine.shape)} but its region {box.to_json()} of the store has shape "
                              f"{list(box.shape)}", file=reader.path, param=e.name)
            return
        done, at = compare_tensor(reader, e.name, arr, box, block_bytes)
        count(done)
        if at is not None:
            report.add(check, "bytes differ from the store's", file=reader.path, param=e.name,
                       region=_where(at, box))
    except ZckptError as err:
        report.add(check, err.message, file=err.path or reader.path, param=err.param or e.name)


# --------------------------------------------------------------------------- sources


def check_sources(
    store: Store,
    src: str | Path,
    strategy: str | Path | StrategyMap | None,
    report: VerifyReport,
    *,
    block_bytes: int = 64 * MiB,
    file_suffix: str | None = None,
    choice_func: Callable[[str], bool] | None = None,
) -> None:
    """Every source shard (writers and replicas alike) equals its box of the store; the file
    read in a rank directory holding several is recorded in the report."""
    try:
        prepared = prepare_ingest(src, strategy, file_suffix=file_suffix, choice_func=choice_func,
                                  block_bytes=block_bytes)
    except ZckptError as err:
        report.add_error("source", err)
        return
    plan = prepared.plan
    report.source_choices = {r: (str(prepared.sources.files[r]), c.candidates, c.rule)
                             for r, c in prepared.sources.several().items()}
    entries = {e.name: e for e in store.entries()}
    for t in plan.tensors:
        e = entries.get(t.name)
        if e is None:
            report.add("source", "in the source checkpoints but not in the store", file=store.url, param=t.name)
        elif t.kind != e.kind or (t.kind == "tensor" and (t.ms_type, t.shape) != (e.ms_type, e.shape)):
            report.add("source", f"source gives {t.kind} {t.ms_type}{list(t.shape)}, the store holds "
                                 f"{e.kind} {e.ms_type}{list(e.shape)}", file=store.url, param=t.name)
    for name in sorted(set(entries) - {t.name for t in plan.tensors}):
        report.add("source", "in the store but in no source checkpoint", file=store.url, param=name)
    todo: dict[int, list[tuple[str, Box]]] = {}
    for w in plan.writes:
        todo.setdefault(w.rank, []).append((w.name, w.box))
    for c in plan.checks:
        todo.setdefault(c.rank, []).append((c.name, c.box))

    def count(n: int) -> None:
        report.source_bytes += n

    for rank in sorted(todo):
        path = plan.rank_files[rank]
        try:
            with open_shard(path) as reader:
                report.source_files += 1
                for name, box in todo[rank]:
                    e = entries.get(name)
                    if e is not None:
                        _compare_entry("source", reader, store, e, box, report, block_bytes, count)
        except ZckptError as err:
            report.add("source", err.message, file=err.path or path, param=err.param)


# --------------------------------------------------------------------------- exports


def check_export(
    store: Store,
    out_dir: str | Path,
    strategy: str | Path | StrategyMap | None,
    report: VerifyReport,
    *,
    prefix: str = "checkpoint_",
    block_bytes: int = 64 * MiB,
    per_stage: bool | None = None,
    any_order: bool = False,
) -> None:
    """Every destination file holds exactly its plan's entries, in order, with the store's
    bytes. ``per_stage`` checks ``<prefix><r>_part<s>.ckpt`` parts instead of one file per
    rank; ``None`` decides from what the directory holds. A rank saved as safetensors
    (``<prefix><r>.safetensors`` or its split index) is compared the same way, except for
    the order of its entries, which that format does not keep; ``any_order`` accepts
    ``.ckpt`` entries in any order too."""
    from zckpt.jobs.export_job import ExportOptions, output_jobs
    from zckpt.sources.strategies import load_strategy

    try:
        plan = build_export_plan(store.specs(), load_strategy(strategy))
    except ZckptError as err:
        report.add_error("export", err)
        return
    out = Path(out_dir)
    if per_stage is None:
        per_stage = any(out.glob(f"rank_*/{prefix}*_part*.ckpt")) and not any(
            (out / f"rank_{r.rank}" / f"{prefix}{r.rank}.ckpt").is_file() for r in plan.ranks)
    entries = {e.name: e for e in store.entries()}
    expected = set()

    def count(n: int) -> None:
        report.export_bytes += n

    for rank, path in output_jobs(store, plan, out, ExportOptions(prefix=prefix, per_stage=per_stage)):
        what = f"destination rank {rank.rank}'s {'part' if per_stage else 'file'}"
        path = _saved_as(path)
        expected.add(path)
        if not path.is_file():
            report.add("export", f"{what} is missing", file=path)
            continue
        try:
            with open_shard(path) as reader:
                report.export_files += 1
                want = [s.name for s in rank.slices]
                have = list(reader.entries)
                ordered = path.suffix == ".ckpt" and not any_order
                if (have if ordered else sorted(have)) != (want if ordered else sorted(want)):
                    report.add("export", _order_problem(have, want), file=path)
                for s in rank.slices:
                    _compare_entry("export", reader, store, entries[s.name], s.box, report, block_bytes, count)
        except ZckptError as err:
            report.add("export", err.message, file=err.path or path, param=err.param)
    found = [*out.glob(f"rank_*/{prefix}*.ckpt"), *out.glob(f"rank_*/{prefix}*.safetensors"),
             *out.glob(f"rank_*/{prefix}*{INDEX_SUFFIX}")]
    parts = {p.parent / n for p in found if p.name.endswith(INDEX_SUFFIX) for n in _index_files(p)}
    for extra in sorted(set(found) - parts):
        if extra not in expected:
            report.add("export", "file is not part of this destination layout", file=extra)


def _saved_as(ckpt_path: Path) -> Path:
    """Where a rank's file is: the ``.ckpt``, else its ``.safetensors``, else a split index."""
    if ckpt_path.is_file():
        return ckpt_path
    for cand in (ckpt_path.with_suffix(".safetensors"), ckpt_path.with_name(ckpt_path.stem + INDEX_SUFFIX)):
        if cand.is_file():
            return cand
    return ckpt_path


def _index_files(index: Path) -> list[str]:
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
        return sorted({str(v) for v in doc["weight_map"].values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _order_problem(have: list[str], want: list[str]) -> str:
    missing = [n for n in want if n not in set(have)]
    extra = [n for n in have if n not in set(want)]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} entr{'y' if len(missing) == 1 else 'ies'} ({missing[:3]!r})")
        if extra:
            parts.append(f"holds {len(extra)} unexpected ({extra[:3]!r})")
        return "file " + " and ".join(parts)
    i = next(i for i, (a, b) in enumerate(zip(have, want, strict=True)) if a != b)
    return f"entries are out of order: position {i} holds {have[i]!r}, the plan puts {want[i]!r} there"


def summary_lines(report: VerifyReport) -> list[str]:
    """Human-readable report: what was checked, then one line per mismatch."""
    lines = [
        f"store {report.store}: {report.arrays} arrays, {report.chunks} chunks ({report.chunk_bytes} bytes, "
        f"{report.checksummed_chunks} against recorded checksums)",
    ]
    if report.source_files:
        lines.append(f"sources: {report.source_files} files, {report.source_bytes} bytes compared")
    lines += [f"source rank {r}: chose {f} among {len(c)} files ({why})"
              for r, (f, c, why) in report.source_choices.items()]
    if report.export_files:
        lines.append(f"exports: {report.export_files} files, {report.export_bytes} bytes compared")
    lines += [m.render() for m in report.mismatches]
    lines.append("OK: no mismatch" if report.ok else f"FAILED: {len(report.mismatches)} mismatch(es)")
    return lines
