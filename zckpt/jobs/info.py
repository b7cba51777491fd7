"""``zckpt info``: describe a checkpoint file (.ckpt or .safetensors), a strategy file, a store or a
MindFormers Checkpoint 2.0 directory (:mod:`zckpt.jobs.info_mindformers`), on a local disk or at a
URL (``s3://...``, ``memory://...``: a store is read through zarr, a checkpoint's header and index
by byte range as ingest reads remote shards, a strategy file whole into memory; nothing is copied
to local disk)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zckpt.core.errors import CheckpointFormatError, UsageError, ZckptError
from zckpt.formats.opener import open_shard, shard_format
from zckpt.formats.rank_files import pick_rank_file
from zckpt.formats.safetensors import SafetensorsReader
from zckpt.formats.shard_reader import INDEX_SUFFIX, ShardReader
from zckpt.formats.strategy import StrategyMap, parse_strategy, read_strategy
from zckpt.io import remote
from zckpt.jobs.info_mindformers import is_mindformers_dir, survey
from zckpt.sources.discovery import discover_sources
from zckpt.sources.layouts import discover_other_layout


def _table(rows: list[list[str]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


Described = tuple[dict[str, Any], list[str]]


def describe(path: str | os.PathLike[str], storage_options: remote.StorageOptions = None) -> Described:
    """A JSON-able description and the aligned text lines that show it."""
    if isinstance(path, str) and remote.is_remote(path):
        return _describe_remote(path, storage_options)
    local = remote.local_path(path)
    if (local / "zarr.json").is_file():
        return _describe_store(local)
    if local.is_dir():
        return _describe_dir(local)
    if not local.is_file():
        raise UsageError("no such file, directory or store", path=local)
    return _describe_file(local, str(local))


STRATEGY_BYTES = 64 << 20
"""A remote file up to this size is fetched whole to be tried as a strategy file first, as a
local one is (strategy files are KiBs to MiBs); a larger one is a checkpoint."""


CKPT_FIRST = b"\x0a"
"""A MindSpore checkpoint's first byte: its first entry (protobuf field 1, length-delimited); a
protobuf strategy file starts with its ``current_stage`` (field 1, varint: ``0x08``), JSON with ``{``."""


def _first_byte(loc: remote.Location) -> bytes:
    with remote.remote_errors(UsageError, loc.url, "cannot read"):
        return bytes(loc.fs.cat_file(loc.path, start=0, end=1))


def _describe_remote(url: str, storage_options: remote.StorageOptions) -> Described:
    """A store at a URL is opened where it is; a checkpoint's entries are read by byte range
    (its header and index only: :mod:`zckpt.formats.remote_shard`); a strategy file is read
    whole into memory."""
    loc = remote.locate(url, storage_options, UsageError)
    if remote.isfile(loc.child("zarr.json"), UsageError):
        return _describe_store(url, storage_options)
    if not remote.isfile(loc, UsageError):
        raise UsageError("no such file or store", path=url)
    if not url.endswith((".safetensors", INDEX_SUFFIX)) and remote.size(loc, UsageError) <= STRATEGY_BYTES \
            and _first_byte(loc) != CKPT_FIRST:
        data = remote.read_bytes(loc, UsageError)
        if url.endswith(".json"):
            return _describe_strategy(parse_strategy(data, url), url)
        smap = _as_strategy(data, url)
        if smap is not None:
            return _describe_strategy(smap, url)
    from zckpt.formats.remote_shard import open_remote  # the ranged reader (fsspec): only for a URL

    try:
        with open_remote(url, storage_options, sparse=True) as r:
            return _describe_reader(r, url)
    except CheckpointFormatError:
        if url.rsplit("/", 1)[-1].endswith(KNOWN_SUFFIXES):
            raise
        raise UsageError("not a checkpoint (.ckpt, .safetensors), strategy file or zckpt store", path=url) from None


KNOWN_SUFFIXES = (".ckpt", ".safetensors", ".json")


def _describe_file(path: Path, shown: str) -> Described:
    if shard_format(path) != "ckpt":  # a .safetensors file or a split checkpoint's index
        return _describe_ckpt(path, shown)
    if path.suffix == ".json" or _looks_like_strategy(path):
        return _describe_strategy(read_strategy(path), shown)
    try:
        return _describe_ckpt(path, shown)
    except CheckpointFormatError:
        if path.suffix.lower() in KNOWN_SUFFIXES:
            raise  # a checkpoint by its name: what is wrong with it helps
        raise UsageError("not a checkpoint (.ckpt, .safetensors), strategy file or zckpt store", path=shown) from None


def _describe_dir(path: Path) -> Described:
    """A job directory (``rank_<r>/`` folders): the checkpoint each rank's folder gives, as
    ingest would choose it. A rank folder alone: its chosen checkpoint, described. A MindFormers
    checkpoint directory or iteration: :func:`_describe_mindformers`."""
    if is_mindformers_dir(path):
        return _describe_mindformers(path)
    ranks = any(p.is_dir() and p.name.startswith("rank_") for p in path.iterdir())
    if ranks or discover_other_layout(path) is not None:
        found = discover_sources(path)
        files = found.files
        rows = [["rank", "file", "bytes"]] + [[str(r), str(f), str(Path(f).stat().st_size)] for r, f in files.items()]
        doc = {"type": "job", "path": str(path), "ranks": {str(r): str(f) for r, f in files.items()},
               "file_choices": {str(r): {"file": c.name, "candidates": list(c.candidates), "rule": c.rule}
                                for r, c in found.several().items()}}
        chose = [f"rank {r}: chose {c.name} among {len(c.candidates)} files ({c.rule})"
                 for r, c in found.several().items()]
        return doc, [f"job {path}: {len(files)} rank(s)", *_table(rows), *chose]
    chosen = pick_rank_file(path)
    if chosen is None:
        raise UsageError("directory holds no store, no rank_<r>/ folders and no checkpoint file", path=path)
    doc, lines = _describe_file(chosen, str(chosen))
    return {**doc, "chosen_from": str(path)}, [f"{path}: checkpoint chosen as ingest would: {chosen.name}", *lines]


SHOWN = 20
"""Refusals a MindFormers directory's text shows (a layout wrong throughout can give thousands)."""


def _describe_mindformers(path: Path) -> Described:
    doc = survey(path)
    tracker = doc["tracker"]
    said = "no latest_checkpointed_iteration.txt"
    if tracker is not None:
        said = f"latest_checkpointed_iteration.txt says {tracker['text']!r}"
        if tracker["iteration"] is None:
            given = doc["iteration_dir"] == str(path)
            said += " (names no iteration here)" if given else " (no such iteration; the highest is shown)"
    where = Path(doc["iteration_dir"] or "-").name
    head = (f"MindFormers Checkpoint 2.0 {path}: iteration {doc['iteration']} ({where}); {said}; "
            f"iterations here: {doc['iterations']}")
    lines = [head]
    if doc["common"] is not None:
        lines.append("common.json: " + ", ".join(f"{k} {json.dumps(v)}" for k, v in doc["common"].items()))
    if doc["saving"] is not None:
        lines.append(f"saving: {doc['saving']}")
    ranks = doc["ranks"]
    lines += _table([["rank", "files", "bytes", "entries"]] + [
        [r, " ".join(d["files"]), str(d["bytes"]), str(d["entries"])] for r, d in ranks.items()])
    params = doc["parameters"]
    bad = sum(p["refused"] is not None for p in params)
    also = f"; in the files but not in metadata.json: {', '.join(doc['not_in_metadata'])}" \
        if doc["not_in_metadata"] else ""
    lines.append(f"{len(params)} parameters, {bad} refused{also}")
    lines += _table([["name", "file", "dtype", "global shape", "layout", "device matrix", "tensor map", "pieces",
                      "stage", "chunks"]] + [_param_row(p) for p in params])
    refused = doc["refused"]
    lines.append(f"refused ({len(refused)}): reading this directory stops at the first" if refused else
                 "nothing refused")
    lines += ["  " + str(ZckptError(f["reason"] or "", path=f["file"], param=f["param"])) for f in refused[:SHOWN]]
    if len(refused) > SHOWN:
        lines.append(f"  ... and {len(refused) - SHOWN} more (--json lists every one)")
    return doc, lines


def _param_row(p: dict[str, Any]) -> list[str]:
    lay = p["layout"]
    cut = lay.get("device_matrix") is not None
    return [p["name"], str(p["file"]), str(p["dtype"]), str(p["global_shape"]), lay["kind"],
            json.dumps(lay["device_matrix"]) if cut else "-",
            json.dumps(lay["tensor_map"], separators=(",", ":")) if cut else "-",
            str(lay.get("pieces", "-")), str(lay.get("stage", "-")), str(p["chunks"])]


def _looks_like_strategy(path: Path) -> bool:
    try:
        smap = read_strategy(path)
    except Exception:  # any parse failure means "not a strategy file"
        return False
    return bool(smap.layouts)


def _as_strategy(data: bytes, name: str) -> StrategyMap | None:
    """``data`` read as a strategy file, if it is one (:func:`_looks_like_strategy`)."""
    try:
        smap = parse_strategy(data, name)
    except Exception:  # any parse failure means "not a strategy file"
        return None
    return smap if smap.layouts else None


def _describe_ckpt(path: Path, shown: str) -> Described:
    with open_shard(path) as r:
        return _describe_reader(r, shown)


def _describe_reader(r: ShardReader, shown: str) -> Described:
    kind = "safetensors" if isinstance(r, SafetensorsReader) else "ckpt"
    infos = list(r.entries.values())
    crc = r.has_crc
    entries: list[dict[str, Any]] = [
        {"name": e.name, "kind": e.kind, "dtype": e.ms_type, "shape": list(e.shape), "bytes": e.nbytes,
         "values": len(e.segments)}
        for e in infos
    ]
    rows = [["name", "dtype", "shape", "bytes"]] + [[e.name, e.ms_type, str(e.shape), str(e.nbytes)] for e in infos]
    total = sum(e.nbytes for e in infos)
    lines = [f"checkpoint {shown}: {len(entries)} entries, {total} bytes, crc trailer: {crc}", *_table(rows)]
    return {"type": kind, "path": shown, "crc": crc, "entries": entries}, lines


def _describe_strategy(smap: StrategyMap, shown: str) -> Described:
    params: list[dict[str, Any]] = []
    for name, per in smap.layouts.items():
        for stage, lay in sorted(per.items()):
            params.append({"name": name, "stage": stage, "dev_matrix": list(lay.dev_matrix),
                           "tensor_map": ms_tensor_map(lay.tensor_map),
                           "opt_weight_shard_size": lay.opt_shard_size,
                           "opt_weight_shard_step": lay.opt_shard_step})
    rows = [["name", "stage", "dev_matrix", "tensor_map", "opt_weight_shard_size"]] + [
        [str(p["name"]), str(p["stage"]), str(p["dev_matrix"]), str(p["tensor_map"]),
         str(p["opt_weight_shard_size"])]
        for p in params
    ]
    head = f"strategy {shown}: {len(smap.layouts)} parameters, stages {list(smap.stages)}"
    doc = {"type": "strategy", "path": shown, "stages": list(smap.stages), "layouts": params}
    return doc, [head, *_table(rows)]


def ms_tensor_map(tensor_map: tuple[tuple[int, ...], ...]) -> list[int | list[int]]:
    """A tensor map in MindSpore's notation (``Layout``, MindFormers' metadata, docs/layouts.md):
    per dimension the axis that cuts it, ``-1`` when none does, a list when several do."""
    return [-1 if not axes else axes[0] if len(axes) == 1 else list(axes) for axes in tensor_map]


def _describe_store(path: str | Path, storage_options: remote.StorageOptions = None) -> Described:
    from zckpt.store.store import Store  # a store's modules (~40 ms): not for `zckpt info FILE`

    st = Store.open(path, storage_options=storage_options)
    st.check_links()
    entries = [e.to_json() for e in st.entries()]
    rows = [["name", "kind", "dtype", "shape"]] + [
        [e["name"], e["kind"], e["ms_type"], str(tuple(e["shape"]))] for e in entries
    ]
    ranks = sorted(st.ingested_ranks())
    head = f"store {st.url}: {len(entries)} entries, complete: {st.complete}, ingested ranks {ranks}"
    return {"type": "store", "path": st.url, "complete": st.complete, "entries": entries}, [head, *_table(rows)]


def store_svg(path: str | os.PathLike[str], name: str, dst_strategy: str | None, rank: int | None,
              storage_options: remote.StorageOptions = None) -> str:
    """``zckpt info STORE --svg``: a parameter's writers and chunk grid in the store, beside
    the boxes a destination strategy gives its ranks (real shapes, from the store)."""
    # a store's modules and the picture's (~50 ms): not for `zckpt info FILE`
    from zckpt.jobs.draw import Panel, held_boxes, store_picture
    from zckpt.jobs.export_job import plan_export
    from zckpt.store.store import Store

    store = Store.open(path, storage_options=storage_options)
    specs = {s.name: s for s in store.specs()}
    if name not in specs:
        raise UsageError("the store holds no such parameter", path=str(path), param=name)
    spec = specs[name]
    if spec.kind != "tensor":
        raise UsageError(f"a {spec.kind} entry has no boxes to draw", path=str(path), param=name)
    src = Panel("in the store: source boxes and chunks", spec.shape, held_boxes(store.writers(name)),
                store.chunk_info(name).chunks)
    plan = plan_export(store, dst_strategy, None, storage_options)
    held = [(r.rank, s.box) for r in plan.ranks for s in r.slices if s.name == name]
    if not held:
        raise UsageError("the destination holds no part of this parameter", param=name)
    return store_picture(src, held, name, rank)
