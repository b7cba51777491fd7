"""Integrity of a store's own metadata, and the identity of what an ingest read.

The chunks are checked against CRC-32C records; this module checks the records and the
manifest themselves, so that a damaged or hand-edited store is refused by name instead of
exported with wrong values:

* ``manifest["integrity"]["manifest"]``: SHA-256 of the manifest's canonical JSON (entries,
  source, layout fingerprint), written with the entries: an entry whose shape or type was
  edited, or which was removed, no longer matches.
* ``manifest["integrity"]["records"]``: ``{rank: SHA-256}`` of each source rank's progress
  record (its checksum records, :meth:`zckpt.store.store.Store.progress_records`), written when the
  store is marked complete: a record removed or edited afterwards no longer matches, and a
  store marked complete without them was not completed by zckpt.
* each array's ``zarr.json`` (shape, data type, zckpt attributes) is compared with its
  manifest entry when it is first read.

The digest of the records is also the store's **identity** (:func:`identity`): the records
hold the CRC-32C of every byte written and the identity of every source file read, so it
changes whenever the store's content may have, and stays the same when an interrupted ingest
is resumed (the store is then byte for byte the one an uninterrupted run writes). It enters
export fingerprints, so an output directory exported from an earlier content of the store
is never taken as done.

Digests detect damage and inconsistent edits; they are not signatures (whoever can edit a
store can recompute them: only comparing the store with its sources, ``zckpt verify
--sources``, finds a consistent forgery). Stores of format 6 and later always carry them
(:data:`SEALED_VERSION`): one without them was damaged and is refused; only stores that
declare an older format (written before these keys existed) are read without them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Set
from typing import Any

from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import StoreError
from zckpt.store import records
from zckpt.store.manifest import EntryRecord

MANIFEST_KEYS = ("format", "version", "entries", "source", "fingerprint")
"""What the manifest digest covers (not ``complete`` nor ``integrity``, which change later)."""

RECORD_KEYS = ("crc32c_blocks", "crc32c", "crc32")
"""Where a progress record keeps its checksums (per block; per chunk in older stores)."""

SEALED_VERSION = 6
"""The first store format whose every store carries ``integrity`` (digests came during format 5)."""

ENDS_BYTES = 64 * 1024
"""Bytes read at each end of a source file for its identity (headers, first and last data)."""


def digest(doc: Any) -> str:
    """SHA-256 of a JSON document in canonical form (sorted keys, no spaces)."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    return digest({k: manifest.get(k) for k in MANIFEST_KEYS})


def record_digest(record: Mapping[str, Any]) -> str:
    """Digest of one source rank's progress record (its attributes as stored)."""
    return digest(dict(record))


def checked(manifest: Mapping[str, Any]) -> bool:
    """Whether the store carries digests (written by a zckpt that records them)."""
    return isinstance(manifest.get("integrity"), dict)


def required(manifest: Mapping[str, Any]) -> bool:
    """Whether the store's declared format requires digests (:data:`SEALED_VERSION`)."""
    try:
        return int(manifest.get("version", 0)) >= SEALED_VERSION
    except (TypeError, ValueError):
        return True


def _refuse_unsealed(manifest: Mapping[str, Any], where: str) -> None:
    """Refuse a store whose format requires digests but which has none (removed by hand:
    without them, edited records and damaged chunks would go unnoticed)."""
    if not checked(manifest) and required(manifest):
        raise StoreError(f"the store declares format {manifest.get('version')!r}, whose manifest always carries "
                         "integrity digests, but it has none (removed?): the store is damaged", path=where)


def sealed(manifest: Mapping[str, Any], records: Mapping[int, Mapping[str, Any]] | None = None,
           known: str | None = None) -> dict[str, Any]:
    """The ``integrity`` value of a manifest: its digest (``known``: already computed by the
    caller for this same manifest), and with ``records`` (a store being marked complete) the
    digest of each source rank's progress record."""
    seal: dict[str, Any] = {"manifest": known if known is not None else manifest_digest(manifest)}
    if records is not None:
        seal["records"] = record_digests(records)
    return seal


def record_digests(records: Mapping[int, Mapping[str, Any]]) -> dict[str, str]:
    return {str(r): record_digest(a) for r, a in sorted(records.items())}


def identity(manifest: Mapping[str, Any], records: Mapping[int, Mapping[str, Any]] | None = None) -> str | None:
    """The store's content identity: the digest of its records' digests (sealed in a complete
    store, else computed from ``records``, the progress records present); ``None`` for stores
    without digests."""
    if not checked(manifest):
        return None
    sealed_records = manifest["integrity"].get("records")
    if manifest.get("complete") and isinstance(sealed_records, dict):
        return digest(sealed_records)
    return None if records is None else digest(record_digests(records))


def refuse_unsealed(manifest: Mapping[str, Any], ranks: Set[int], where: str, *, records: bool = True) -> None:
    """Refuse a store whose manifest is not the one its ingest wrote: begun but never
    defined (killed before its manifest), edited since, or marked complete without the
    digests of its checksum records (``ranks``: the source ranks with a progress record;
    ``records=False``: the records are not compared, an ingest rerun redoes what they lack)."""
    if manifest.get("fingerprint") is None and not manifest.get("complete"):
        raise StoreError("store is incomplete: its ingest stopped before writing the manifest (no entries); rerun "
                         "the ingest", path=where)
    _refuse_unsealed(manifest, where)
    if not checked(manifest):
        return
    seal = manifest["integrity"]
    if "manifest" not in seal:
        raise StoreError("the manifest has no integrity digest: the store is damaged", path=where)
    if seal["manifest"] != manifest_digest(manifest):
        raise StoreError("the manifest differs from the one its ingest wrote (entries, shapes, types or source "
                         "edited or lost): the store is damaged", path=where)
    if records:
        check_sealed(manifest, ranks, where)


def check_sealed(manifest: Mapping[str, Any], ranks: Set[int], where: str) -> None:
    """Refuse a complete store whose sealed record digests are missing or list other source
    ranks than those with a progress record (``ranks``); the manifest itself is not hashed."""
    if not checked(manifest) or not manifest.get("complete"):
        return
    sealed_records = manifest["integrity"].get("records")
    if not isinstance(sealed_records, dict):
        raise StoreError("store is marked complete but its checksum records were never sealed (the flag was not "
                         "set by zckpt): the store is damaged", path=where)
    listed = {int(r) for r in sealed_records}
    if listed - set(ranks):
        raise StoreError(missing_records(listed - set(ranks)), path=where)
    if set(ranks) - listed:
        raise StoreError(f"progress records of source rank(s) {sorted(set(ranks) - listed)} were not part of the "
                         "completed ingest: the store is damaged", path=where)


def damaged_entry(entries: Iterable[EntryRecord], open_array: Callable[[str], object], group: Callable[[], Any],
                  where: Callable[..., str]) -> StoreError | None:
    """Which parameter a manifest that fails its digest got wrong, when its arrays tell:
    an entry whose array disagrees with it (``open_array`` refuses it), or an array of the
    store's root ``group()`` that no entry names any more (read only on this error path: every array's
    metadata). ``where`` names a node of the store in messages."""
    known = set()
    for e in entries:
        if e.kind == "str":
            continue
        known.add(e.key)
        try:
            open_array(e.name)
        except StoreError as err:
            return err
    for folder in ("tensors", "maps"):
        try:
            node: Any = group()[folder]
            keys = sorted(node.array_keys())
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        for k in keys:
            if f"{folder}/{k}" not in known:
                attrs: Any = node[k].attrs.get("zckpt") or {}
                return StoreError("its array is in the store but the manifest lost its entry",
                                  path=where(folder, k), param=attrs.get("name"))
    return None


def missing_records(ranks: Set[int]) -> str:
    """The error of source ranks sealed in a complete store whose progress records are gone,
    naming the files that held them."""
    shown = sorted(ranks)
    files = ", ".join(f"{records.FOLDER}/{records.file_name(r)}" for r in shown[:3]) + (", ..." if len(shown) > 3
                                                                                        else "")
    return (f"the progress records of source rank(s) {shown} are missing ({files}, or the "
            f"{records.FOLDER}/ranks_<first>-<last>.json holding them): the store is damaged")


def check_record(manifest: Mapping[str, Any], rank: int, record: Mapping[str, Any], where: str, *,
                 digest: bool = True) -> None:
    """Refuse a source rank's progress record that lost its checksums or (``digest``: checked
    against the digest sealed with a complete store) changed since the store was completed."""
    _refuse_unsealed(manifest, where)
    if not checked(manifest):
        return
    if not any(k in record for k in RECORD_KEYS):
        raise StoreError(f"the checksum records of source rank {rank} are missing: the store is damaged", path=where)
    records = manifest["integrity"].get("records")
    if digest and isinstance(records, dict) and records.get(str(rank)) != record_digest(record):
        raise StoreError(f"the checksum records of source rank {rank} differ from those sealed when the store was "
                         "completed: the store is damaged", path=where)


def stored_type_names(ms_type: str) -> tuple[str, ...]:
    """Zarr data types an entry's array may have: BFloat16 is ``bfloat16`` (``uint16`` in
    format-1 stores), a map's bytes ``uint8``, any other type its storage dtype's name."""
    if ms_type == "BFloat16":
        return ("bfloat16", "uint16")
    if ms_type == "map":
        return ("uint8",)
    return (ms_dtype(ms_type).storage.name,)


def check_array(kind: str, ms_type: str, shape: tuple[int, ...], name: str, doc: Mapping[str, Any],
                where: str) -> None:
    """An array's ``zarr.json`` (``doc``) against its manifest entry."""
    got = tuple(int(x) for x in doc.get("shape", ()))
    if kind == "tensor" and got != tuple(shape):
        raise StoreError(f"array shape {list(got)} but the manifest says {list(shape)}: the store is damaged",
                         path=where, param=name)
    data_type = doc.get("data_type")
    allowed = stored_type_names(ms_type if kind == "tensor" else "map")
    if isinstance(data_type, str) and data_type not in allowed:
        raise StoreError(f"array data type {data_type} but the manifest's {ms_type} needs {' or '.join(allowed)}: "
                         "the store is damaged", path=where, param=name)
    attrs = (doc.get("attributes") or {}).get("zckpt")
    if isinstance(attrs, dict):
        for key, want in (("name", name), ("kind", kind), ("ms_dtype", ms_type)):
            if key in attrs and attrs[key] != want:
                raise StoreError(f"array attribute {key} is {attrs[key]!r}, the manifest says {want!r}: the store is "
                                 "damaged", path=where, param=name)


def check_codecs(codecs: Any, where: str, name: str) -> None:
    """An array's codecs (its ``zarr.json``) against what zckpt stores hold: a sharded array's
    single ``sharding_indexed`` codec has raw inner chunks and zckpt's index (little-endian
    offsets and sizes with a CRC-32C, at the end of the shard). Any other sharding would make
    zarr read the index from the wrong bytes and fail with an error naming nothing."""
    if not isinstance(codecs, list | tuple):  # tuples: zarr's own metadata
        return
    for c in codecs:
        if not (isinstance(c, dict) and c.get("name") == "sharding_indexed"):
            continue
        conf = c.get("configuration") or {}
        found = {"index_location": conf.get("index_location", "end"),
                 "index_codecs": [_codec(x) for x in conf.get("index_codecs") or []],
                 "codecs": [_codec(x) for x in conf.get("codecs") or []], "codec count": len(codecs)}
        for key, value in found.items():
            if value != SHARDING[key]:
                raise StoreError(f"the sharding codec's {key} is {value!r} where zckpt stores have "
                                 f"{SHARDING[key]!r}: the store is damaged", path=where, param=name)


SHARDING: dict[str, Any] = {"index_location": "end", "index_codecs": [("bytes", "little"), ("crc32c", None)],
                            "codecs": [("bytes", "little")], "codec count": 1}
"""The sharding of zckpt's sharded arrays (:func:`check_codecs`), codecs as ``(name, endian)``."""


def _codec(doc: Any) -> tuple[Any, Any]:
    if not isinstance(doc, dict):
        return (doc, None)
    endian = (doc.get("configuration") or {}).get("endian")
    return (doc.get("name"), "little" if doc.get("name") == "bytes" and endian is None else endian)


def source_identity(path: str | os.PathLike[str], fd: int | None = None) -> dict[str, Any] | None:
    """What resuming can check of a local source file without reading it whole: its size,
    its modification time and a SHA-256 of its first and last ``ENDS_BYTES`` (a file
    rewritten in place with its old size and time still differs there in practice: headers
    and the first and last values). ``None`` for what is not a local regular file. ``fd``:
    the file already open (a reader's), read there rather than opened again (three system
    calls instead of six: at 512 ranks each is a wait for the GIL on the planning thread)."""
    try:
        if fd is not None:
            return _identity(fd)
        own = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _identity(own)
        finally:
            os.close(own)
    except (OSError, ValueError):
        return None


def _identity(fd: int) -> dict[str, Any]:
    st = os.fstat(fd)
    h = hashlib.sha256(os.pread(fd, ENDS_BYTES, 0))
    if st.st_size > ENDS_BYTES:
        h.update(os.pread(fd, ENDS_BYTES, max(ENDS_BYTES, st.st_size - ENDS_BYTES)))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ends_sha256": h.hexdigest()}


def source_change(recorded: Any, path: str | os.PathLike[str]) -> str | None:
    """How a source file differs from the identity recorded when its rank was ingested
    (``None``: the same, or nothing was recorded to compare)."""
    if not isinstance(recorded, dict):
        return None
    now = source_identity(path)
    if now is None:
        return "it cannot be read any more"
    for key, what in (("size", "size"), ("mtime_ns", "modification time"), ("ends_sha256", "content")):
        if recorded.get(key) != now[key]:
            return f"its {what} changed since it was ingested"
    return None
