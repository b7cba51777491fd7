"""The store's manifest: its format and version, its entry records, the names of their arrays.

The manifest is the ``zckpt`` attribute of the store's root group (``zarr.json``): which
checkpoint entries the store holds, where each one lives, where it came from and whether the
store is complete (docs/store-format.md). What belongs here is the document itself — reading
it from a local ``zarr.json``, refusing what is not a zckpt store of a known version, parsing
its entries and naming their arrays. Where the document is stored (a local file, a remote
group) is :mod:`zckpt.store.backends`; its digests are :mod:`zckpt.store.integrity`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zckpt.core.errors import StoreError
from zckpt.io import safe_paths
from zckpt.plan.values import TensorSpec

FORMAT = "zckpt-store"
VERSION = 7
"""7: the progress records of consecutive ranks may share one file (:mod:`zckpt.store.records`);
6: small tensors that one source rank writes whole are packed into one array per data type
(:mod:`zckpt.store.packed`); 5: progress records are plain files (:mod:`zckpt.store.records`), not zarr
groups; 4: local stores group chunks into shards (``sharding_indexed``), checksums per block of
each writer's run of a shard; 3: chunk checksums per block (``crc32c_blocks``); 2: one per
chunk; 2 and later: BFloat16 arrays are Zarr ``bfloat16``; 1: they were ``uint16``. Older
versions are still read."""

SHARDED_LAYOUTS = (4, 5)
"""Versions whose arrays ingest defines raw, ``.``-separated, sharded as
:func:`zckpt.store.geometry.shard_grid` says."""


_SAFE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789._-")
_MAX_KEY = 180


def encode_key(name: str) -> str:
    """A store-safe node name for an entry name: one path component that no other name maps
    to, even on a case-insensitive disk, and never Zarr's own ``zarr.json``.

    Only lowercase letters, digits and ``._-`` are kept; everything else (uppercase included,
    so that ``W`` and ``w`` differ in more than case) is percent-encoded as UTF-8 bytes.
    """
    out = []
    for i, ch in enumerate(name):
        if ch in _SAFE and not (i == 0 and ch in "._"):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    key = "".join(out) or "%"
    if key == "zarr.json":
        key = "%7A" + key[1:]
    if len(key) > _MAX_KEY:
        digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:16]
        key = f"{key[:_MAX_KEY - 18]}~{digest}"
    return key


@dataclass(frozen=True)
class EntryRecord:
    """A manifest line: one checkpoint entry and where it lives in the store."""

    name: str
    kind: str
    ms_type: str
    shape: tuple[int, ...]
    key: str
    value: str | None = None
    stages: tuple[int, ...] = (0,)
    note: str | None = None
    offset: int | None = None
    """A packed tensor's element offset in its packed array ``key`` (:mod:`zckpt.store.packed`)."""
    writer: int | None = None
    """The source rank that writes a packed tensor (other tensors list their writers in their
    array's attributes)."""

    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.kind, self.ms_type, self.shape, stages=self.stages, note=self.note)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "ms_type": self.ms_type,
            "shape": list(self.shape),
            "key": self.key,
        }
        if self.value is not None:
            doc["value"] = self.value
        doc["stages"] = list(self.stages)
        if self.note is not None:
            doc["note"] = self.note
        if self.offset is not None:
            doc["offset"], doc["writer"] = self.offset, self.writer
        return doc

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> EntryRecord:
        return EntryRecord(
            name=str(doc["name"]),
            kind=str(doc["kind"]),
            ms_type=str(doc["ms_type"]),
            shape=tuple(map(int, doc["shape"])),
            key=str(doc["key"]),
            value=doc.get("value"),
            stages=tuple(map(int, doc.get("stages", (0,)))),
            note=doc.get("note"),
            offset=None if doc.get("offset") is None else int(doc["offset"]),
            writer=None if doc.get("offset") is None else int(doc["writer"]),
        )


def group_attributes(root: Path) -> dict[str, Any]:
    """The attributes of the Zarr v3 group at ``root``, read from its ``zarr.json`` alone
    (not through zarr-python, whose import costs every command a few tenths of a second)."""
    try:
        doc = json.loads(safe_paths.read_bytes(root / "zarr.json", StoreError))
        if not isinstance(doc, dict):
            raise ValueError("zarr.json is not a JSON object")
        if doc.get("zarr_format") != 3:
            raise ValueError(f"zarr.json: zarr_format is {doc.get('zarr_format')!r}, not 3")
        if doc.get("node_type") != "group":
            raise ValueError(f"zarr.json: node_type is {doc.get('node_type')!r}, not 'group'")
        attrs = doc.get("attributes", {})
        if not isinstance(attrs, dict):
            raise ValueError("zarr.json: attributes is not a JSON object")
    except (OSError, ValueError, StoreError) as err:
        raise StoreError(f"cannot open zarr store: {err}", path=root) from None
    return attrs


def new_manifest() -> dict[str, Any]:
    """The manifest of a store just created: no entries yet, a fresh identity."""
    return {"format": FORMAT, "version": VERSION, "complete": False, "entries": []}




def readable_manifest(meta: Any, where: str | Path) -> dict[str, Any]:
    """The manifest of a store being opened, refused unless zckpt wrote it in a version this
    zckpt reads."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StoreError("zarr store was not written by zckpt (no zckpt manifest)", path=where)
    if int(meta.get("version", 0)) > VERSION:
        raise StoreError(f"store format version {meta.get('version')} is newer than this zckpt", path=where)
    return meta


def entry_records(meta: Mapping[str, Any], where: str) -> dict[str, EntryRecord]:
    """The manifest's entries by name, each array key checked to be a path below the store
    (``where``: the manifest, as messages name it)."""
    entries = {d["name"]: EntryRecord.from_json(d) for d in meta.get("entries", [])}
    safe = set()  # packed tensors share their array's key
    for e in entries.values():
        if e.kind != "str" and e.key not in safe:  # a key is a path below the store: not out of it
            safe_paths.check_key(e.key, StoreError, path=where, param=e.name, what="manifest key")
            safe.add(e.key)
    return entries
