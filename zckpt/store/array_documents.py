"""The ``zarr.json`` documents zckpt writes for its groups and arrays, without zarr-python.

Creating thousands of arrays through zarr-python costs milliseconds each and its import a few
tenths of a second, so ingest renders each uncompressed array's document itself, exactly as
zarr-python would (tests/test_lazy_zarr.py compares the two for every data type, sharded or
not). Only documents live here; reading them back into a chunk layout is
:class:`zckpt.store.geometry.ChunkInfo`, and compressed arrays are still created through
zarr-python (:mod:`zckpt.store.zarr_arrays`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from zckpt.core.dtypes import ms_dtype
from zckpt.core.layout import Box
from zckpt.formats.strategy import ParamLayout
from zckpt.plan.values import TensorSpec


def _type_name(ms_type: str, kind: str) -> tuple[str, int]:
    """The Zarr data type of an entry's array as its ``zarr.json`` names it, and its item size
    (:func:`zckpt.store.zarr_arrays.zarr_type`, without importing zarr-python)."""
    if kind != "tensor":
        return "uint8", 1
    if ms_type == "BFloat16":
        return "bfloat16", 2
    dtype = ms_dtype(ms_type).storage
    return dtype.name, dtype.itemsize


def _template(ms_type: str, kind: str, sharded: bool = False) -> dict[str, Any]:
    """The ``zarr.json`` that zarr-python writes for an uncompressed array of the entry's data
    type (tests/test_lazy_zarr.py compares the two for every type), with or without the
    sharding codec (inner chunks uncompressed, index at the end); written here so that
    defining a store's arrays needs no zarr-python.

    Chunk keys use the ``.`` separator (``c.0.1``): one file per chunk (or shard) in the
    array's folder, with no directory per chunk coordinate to create.
    """
    name, itemsize = _type_name(ms_type, kind)
    raw: dict[str, Any] = {"name": "bytes"}
    if itemsize > 1:  # zckpt's storage types are little-endian
        raw["configuration"] = {"endian": "little"}
    codecs: list[dict[str, Any]] = [raw]
    if sharded:
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [1], "codecs": [raw],
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "index_location": "end"}}]
    fill: Any = False if name == "bool" else 0.0 if "float" in name else 0
    return {"shape": [2], "data_type": name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2 if sharded else 1]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
            "fill_value": fill, "codecs": codecs, "attributes": {}, "zarr_format": 3, "node_type": "array",
            "storage_transformers": []}


def array_json(ms_type: str, kind: str, shape: Sequence[int], chunks: Sequence[int], attributes: dict[str, Any],
                per_shard: Sequence[int] | None = None) -> str:
    """An array's ``zarr.json``: ``chunks`` is the chunk shape, the inner chunk shape of a
    sharded array whose shards hold ``per_shard`` inner chunks per dimension."""
    doc = _template(ms_type, kind, per_shard is not None)
    doc["shape"] = [int(s) for s in shape]
    grid = [int(c) for c in chunks] if per_shard is None else [int(c) * int(k) for c, k in zip(chunks, per_shard,
                                                                                                   strict=True)]
    doc["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": grid}}
    if per_shard is not None:
        doc["codecs"][0]["configuration"]["chunk_shape"] = [int(c) for c in chunks]
    doc["attributes"] = attributes
    return json.dumps(doc)


GROUP_DOCUMENT: dict[str, Any] = {"attributes": {}, "zarr_format": 3, "node_type": "group"}
"""A group's ``zarr.json`` as zarr-python writes it (``tensors``, ``maps``)."""


def write_json(folder: Path, doc: Mapping[str, Any]) -> None:
    """A node's ``zarr.json`` in a local store being defined (no data yet: not atomic), laid
    out as zarr-python lays it out."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "zarr.json").write_text(json.dumps(doc, indent=2), encoding="utf-8")


def write_array_json(
    folder: Path, ms_type: str, kind: str, shape: Sequence[int], chunks: Sequence[int], attributes: dict[str, Any],
    per_shard: Sequence[int] | None = None,
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "zarr.json").write_text(array_json(ms_type, kind, shape, chunks, attributes, per_shard),
                                      encoding="utf-8")



def layout_to_json(lay: ParamLayout) -> dict[str, Any]:
    return {
        "dev_matrix": list(lay.dev_matrix),
        "tensor_map": [list(a) for a in lay.tensor_map],
        "opt_weight_shard_step": lay.opt_shard_step,
        "opt_weight_shard_size": lay.opt_shard_size,
    }


def entry_attributes(t: TensorSpec, writers: Iterable[tuple[int, Box]]) -> dict[str, Any]:
    """The ``zckpt`` attributes of an entry's array: what it is, which source rank writes
    which box of it ("writers"), and the source layouts and stages it came from."""
    attrs: dict[str, Any] = {
        "name": t.name,
        "ms_dtype": t.ms_type,
        "kind": t.kind,
        "writers": [[r, b.to_json()] for r, b in writers],
        "source_layouts": {str(s): layout_to_json(lay) for s, lay in t.layouts.items()},
        "source_stages": list(t.stages),
    }
    if t.note:
        attrs["note"] = t.note
    return attrs
