"""``zckpt info``: describe a checkpoint file (.ckpt or .safetensors), a strategy file or a store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zckpt.errors import UsageError
from zckpt.formats.shards import open_shard, shard_format
from zckpt.formats.strategy import read_strategy


def _table(rows: list[list[str]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def describe(path: Path) -> tuple[dict[str, Any], list[str]]:
    """A JSON-able description and the aligned text lines that show it."""
    if (path / "zarr.json").is_file():
        return _describe_store(path)
    if not path.is_file():
        raise UsageError("no such file or store", path=path)
    if shard_format(path) != "ckpt":  # a .safetensors file or a split checkpoint's index
        return _describe_ckpt(path)
    if path.suffix == ".json" or _looks_like_strategy(path):
        return _describe_strategy(path)
    return _describe_ckpt(path)


def _looks_like_strategy(path: Path) -> bool:
    try:
        smap = read_strategy(path)
    except Exception:  # any parse failure means "not a strategy file"
        return False
    return bool(smap.layouts)


def _describe_ckpt(path: Path) -> tuple[dict[str, Any], list[str]]:
    kind = "ckpt" if shard_format(path) == "ckpt" else "safetensors"
    with open_shard(path) as r:
        infos = list(r.entries.values())
        crc = r.has_crc
    entries: list[dict[str, Any]] = [
        {"name": e.name, "kind": e.kind, "dtype": e.ms_type, "shape": list(e.shape), "bytes": e.nbytes,
         "values": len(e.segments)}
        for e in infos
    ]
    rows = [["name", "dtype", "shape", "bytes"]] + [[e.name, e.ms_type, str(e.shape), str(e.nbytes)] for e in infos]
    total = sum(e.nbytes for e in infos)
    lines = [f"checkpoint {path}: {len(entries)} entries, {total} bytes, crc trailer: {crc}", *_table(rows)]
    return {"type": kind, "path": str(path), "crc": crc, "entries": entries}, lines


def _describe_strategy(path: Path) -> tuple[dict[str, Any], list[str]]:
    smap = read_strategy(path)
    params: list[dict[str, Any]] = []
    for name, per in smap.layouts.items():
        for stage, lay in sorted(per.items()):
            params.append({"name": name, "stage": stage, "dev_matrix": list(lay.dev_matrix),
                           "tensor_map": [list(a) for a in lay.tensor_map],
                           "opt_shard_size": lay.opt_shard_size, "opt_shard_step": lay.opt_shard_step})
    rows = [["name", "stage", "dev_matrix", "tensor_map", "opt_size"]] + [
        [str(p["name"]), str(p["stage"]), str(p["dev_matrix"]), str(p["tensor_map"]), str(p["opt_shard_size"])]
        for p in params
    ]
    head = f"strategy {path}: {len(smap.layouts)} parameters, stages {list(smap.stages)}"
    doc = {"type": "strategy", "path": str(path), "stages": list(smap.stages), "layouts": params}
    return doc, [head, *_table(rows)]


def _describe_store(path: Path) -> tuple[dict[str, Any], list[str]]:
    from zckpt.store import Store

    st = Store.open(path)
    entries = [e.to_json() for e in st.entries()]
    rows = [["name", "kind", "dtype", "shape"]] + [
        [e["name"], e["kind"], e["ms_type"], str(tuple(e["shape"]))] for e in entries
    ]
    ranks = sorted(st.ingested_ranks())
    head = f"store {path}: {len(entries)} entries, complete: {st.complete}, ingested ranks {ranks}"
    return {"type": "store", "path": str(path), "complete": st.complete, "entries": entries}, [head, *_table(rows)]
