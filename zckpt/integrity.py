"""Integrity of a store's own metadata, and the identity of what an ingest read.

The chunks are checked against CRC-32C records; this module checks the records and the
manifest themselves, so that a damaged or hand-edited store is refused by name instead of
exported with wrong values:

* ``manifest["integrity"]["manifest"]``: SHA-256 of the manifest's canonical JSON (entries,
  source, layout fingerprint), written with the entries: an entry whose shape or type was
  edited, or which was removed, no longer matches.
* ``manifest["integrity"]["records"]``: ``{rank: SHA-256}`` of each source rank's progress
  record (its checksum records, :meth:`zckpt.store.Store.progress_records`), written when the
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
store can recompute them). Stores written before these keys existed (no ``integrity``) are
read as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Set
from typing import Any

from zckpt.dtypes import ms_dtype
from zckpt.errors import StoreError

MANIFEST_KEYS = ("format", "version", "entries", "source", "fingerprint")
"""What the manifest digest covers (not ``complete`` nor ``integrity``, which change later)."""

RECORD_KEYS = ("crc32c_blocks", "crc32c", "crc32")
"""Where a progress record keeps its checksums (per block; per chunk in older stores)."""

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


def check_manifest(manifest: Mapping[str, Any], ranks: Set[int], where: str) -> None:
    """Refuse a store whose manifest is not the one its ingest wrote: begun but never
    defined (killed before its manifest), edited since, or marked complete without the
    digests of its checksum records (``ranks``: the source ranks with a progress record)."""
    if manifest.get("fingerprint") is None and not manifest.get("complete"):
        raise StoreError("store is incomplete: its ingest stopped before writing the manifest (no entries); rerun "
                         "the ingest", path=where)
    if not checked(manifest):
        return
    seal = manifest["integrity"]
    if "manifest" not in seal:
        raise StoreError("the manifest has no integrity digest: the store is damaged", path=where)
    if seal["manifest"] != manifest_digest(manifest):
        raise StoreError("the manifest differs from the one its ingest wrote (entries, shapes, types or source "
                         "edited or lost): the store is damaged", path=where)
    if not manifest.get("complete"):
        return
    records = seal.get("records")
    if not isinstance(records, dict):
        raise StoreError("store is marked complete but its checksum records were never sealed (the flag was not "
                         "set by zckpt): the store is damaged", path=where)
    listed = {int(r) for r in records}
    if listed - set(ranks):
        raise StoreError(f"the checksum records of source rank(s) {sorted(listed - set(ranks))} are missing: the "
                         "store is damaged", path=where)
    if set(ranks) - listed:
        raise StoreError(f"progress records of source rank(s) {sorted(set(ranks) - listed)} were not part of the "
                         "completed ingest: the store is damaged", path=where)


def check_record(manifest: Mapping[str, Any], rank: int, record: Mapping[str, Any], where: str, *,
                 digest: bool = True) -> None:
    """Refuse a source rank's progress record that lost its checksums or (``digest``: checked
    against the digest sealed with a complete store) changed since the store was completed."""
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
