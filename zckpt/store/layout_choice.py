"""The store's chunk layout for an ingest: which arrays, chunk shapes, shard files and packed
tensors it gets, and the fingerprint that names the ingest (a rerun with the same one resumes).

Chosen from the plan alone (the values of string entries, MapParameter sizes and the source
record come from the sources, read by the caller: the store knows nothing of shard files).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from zckpt.core.errors import ZckptError
from zckpt.core.layout import Box
from zckpt.plan.values import IngestPlan, TensorSpec
from zckpt.store import packed


class LayoutOptions(Protocol):
    """What :func:`store_layout` reads of an ingest's options."""

    @property
    def chunk_bytes(self) -> int: ...
    @property
    def shard_bytes(self) -> int: ...
    @property
    def pack_bytes(self) -> int: ...
    @property
    def pack_count(self) -> int: ...


@dataclass(frozen=True)
class StoreLayout:
    """Everything the store's structure depends on: arrays, writers, chunks, provenance."""

    tensors: tuple[TensorSpec, ...]
    writers: Mapping[str, tuple[tuple[int, Box], ...]]
    chunks: Mapping[str, tuple[int, ...]]
    strings: Mapping[str, str]
    source: Mapping[str, Any]
    shards: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Inner chunks per shard of every sharded array (format 4, local stores)."""
    packing: packed.PackPlan | None = None
    """Small tensors packed into one array per data type (format 5, local stores)."""
    _fingerprint: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def fingerprint(self) -> str:
        """Identity of an ingest: two runs with the same fingerprint write the same store
        (an unsharded layout keeps the fingerprint format 3 gave it, so that an ingest
        interrupted before format 4 resumes as it began). Computed once per layout."""
        if not self._fingerprint:
            self._fingerprint.append(self._digest())
        return self._fingerprint[0]

    def _digest(self) -> str:
        doc: dict[str, Any] = {
            "tensors": [[t.name, t.kind, t.ms_type, list(t.shape), list(t.stages)] for t in self.tensors],
            "writers": {n: [[r, b.to_json()] for r, b in ws] for n, ws in sorted(self.writers.items())},
            "chunks": {n: list(c) for n, c in sorted(self.chunks.items())},
            "strings": dict(sorted(self.strings.items())),
            "source": self.source,
        }
        if self.shards:
            doc["shards"] = {n: list(k) for n, k in sorted(self.shards.items())}
        if self.packing is not None and self.packing.slots:
            doc["packing"] = self.packing.to_json()
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def resumable_layout(path: Path, layout: StoreLayout, overwrite: bool) -> StoreLayout:
    """The layout to ingest with: the unpacked (or also unsharded) one when ``path`` holds
    this same ingest, interrupted, begun without packing (by a zckpt of format 4) or without
    shards (format 3), so that resuming finishes it as it began."""
    # the store's modules: loaded while the sources are read (jobs.ingest); not by transform --dry-run
    from zckpt.store.store import Store

    if not (layout.shards or layout.packing) or overwrite or not (path / "zarr.json").is_file():
        return layout
    try:
        found = Store.open(path).manifest.get("fingerprint")
    except ZckptError:
        return layout
    if found == layout.fingerprint():
        return layout
    unpacked = replace(layout, packing=None)  # a packed tensor is never sharded: shards stay
    for older in (unpacked, replace(unpacked, shards={})):
        if found == older.fingerprint():
            return older
    return layout


def store_layout(
    plan: IngestPlan, options: LayoutOptions, strings: Mapping[str, str], map_sizes: Mapping[str, int],
    source: Mapping[str, Any], *, sharded: bool = False, served: Mapping[str, Sequence[Box]] | None = None,
) -> StoreLayout:
    """The layout of a store for ``plan``: ``strings`` are the values of its string entries,
    ``map_sizes`` the byte size of each MapParameter, ``source`` the provenance record
    (:func:`zckpt.sources.prepare.store_source`); ``sharded`` for a local store. ``served``:
    per tensor, boxes of destination ranks the store will serve (chunk borders fall on theirs
    too, so each reads whole chunks: :func:`zckpt.plan.export_plan.served_boxes`)."""
    # the store's modules: loaded while the sources are read (jobs.ingest)
    from zckpt.store.geometry import chunk_shape, shard_grid

    writers: dict[str, list[tuple[int, Box]]] = {}
    for w in plan.writes:
        writers.setdefault(w.name, []).append((w.rank, w.box))
    chunks = {}
    for t in plan.tensors:
        ws = writers.get(t.name, [])
        itemsize = 1 if t.kind == "map" else max(1, t.nbytes // max(1, _count(t.shape)))
        if (len(ws) == 1 and t.shape and all(t.shape) and ws[0][1].stop == t.shape and not any(ws[0][1].start)
                and math.prod(t.shape) * itemsize <= options.chunk_bytes):
            chunks[t.name] = t.shape  # one whole box that fits a chunk (a tiny tensor): what the rule below gives
            continue
        boxes = [b for _, b in ws] + list((served or {}).get(t.name, ()))
        grid = _common_grid(boxes) if boxes and t.shape else t.shape
        chunks[t.name] = chunk_shape(grid, itemsize, options.chunk_bytes)
    tensors = [
        t if t.kind != "map" else replace(t, shape=(map_sizes[t.name],))
        for t in plan.tensors
    ]
    for t in tensors:
        if t.kind == "map":
            chunks[t.name] = (max(1, t.shape[0]),)
            writers[t.name] = [(writers[t.name][0][0], Box.full(t.shape))]
    packing = None
    if sharded and options.pack_bytes > 0:
        packing = packed.plan_packing(tensors, writers, options.pack_bytes, options.chunk_bytes,
                                      options.pack_count)
    slots = packing.slots if packing is not None else {}
    shards: dict[str, tuple[int, ...]] = {}
    for t in tensors:
        if sharded and options.shard_bytes > 0 and t.kind == "tensor" and t.name not in slots:
            itemsize = max(1, t.nbytes // max(1, _count(t.shape)))
            per = shard_grid(t.shape, chunks[t.name], itemsize, options.shard_bytes)
            if per is not None:
                shards[t.name] = per
    return StoreLayout(
        tensors=tuple(tensors),
        writers={n: tuple(ws) for n, ws in writers.items()},
        chunks=chunks,
        strings=dict(strings),
        source=dict(source),
        shards=shards,
        packing=packing,
    )


def _common_grid(boxes: list[Box]) -> tuple[int, ...]:
    """Per dimension, the gcd of every writer box's borders: chunks that divide it never
    straddle two writers, even when a dimension is split unevenly."""
    out = []
    for d in range(boxes[0].ndim):
        g = 0
        for b in boxes:
            g = math.gcd(g, math.gcd(b.start[d], b.stop[d]))
        out.append(max(1, g))
    return tuple(out)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


