"""Writes a checkpoint iteration as MindSpore Transformers 2.1 saves it, for the tests.

Each step is a port of the code that does it (mindformers 2.1.0 from PyPI; MindSpore 2.10):

* the layout each parameter gets in ``metadata.json``: MindSpore's
  ``mindspore/parallel/strategy.py`` ``_NetStrategyInfo._layout_process`` (with
  ``_get_dev_mat_for_opt_shard``, ``_split_dev_dim``, ``_get_tensor_map_for_opt_shard``,
  ``_compact_tensor_map``), which folds optimizer parallel into dimension 0's map, then
  ``Layout(...)(*alias_map).to_dict()`` (``mindspore/parallel/shard.py``);
* the chunks: ``mindformers/checkpoint/sharded_tensor.py`` ``_get_layout_shard_info``
  (``_DistributedTensorInfo.sharding_strategy`` for the pieces, ``_alias_name_with_rank_id``,
  ``_tensor_map_with_rank_id``, ``_rank_id_with_slice_id`` for each rank's slice number) and
  ``get_sharded_tensor_from_strategy_metadata`` (``global_offset = (slice,)``);
* ``metadata.json``: ``mindformers/checkpoint/metadata.py`` ``save_metadata`` and
  ``get_total_params_file_mapping_info`` (compact JSON); with ``balanced=True`` the
  storage records of ``mindformers/checkpoint/fully_parallel.py`` ``save_balanced_metadata``
  (files numbered by the ranks that received something; which replica saves a piece is this
  writer's choice, round robin, as the balancing itself does not matter to a reader);
* file names: ``mindformers/checkpoint/utils.py`` ``get_checkpoint_name``,
  ``get_checkpoint_iter_dir``, the tracker of ``checkpoint.py`` ``save_checkpoint``;
* ``common.json``: ``checkpoint.py`` ``CommonInfo.save_common`` (``json.dumps(__dict__, indent=4)``),
  filled as ``core/callback/callback.py`` ``_save_megatron_ckpt_file_format`` does.

The bytes each rank saves are *not* derived from that layout: they are what MindSpore's
parallel compiler puts on the rank (tensor-parallel slice, then the optimizer-shard part),
cut by ``tests/oracle.py`` from :func:`zckpt.jobs.generate_model.global_value`. A reader that applies the
metadata's layouts therefore agrees with the global values only if the layout port and the
reader agree with MindSpore's own slicing.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
from oracle import expected_shard
from safetensors.numpy import save_file

from zckpt.jobs.generate_model import global_value


@dataclass(frozen=True)
class MsParam:
    """One parameter as MindSpore's compiler reports it (``StrategyInfo``): its strategy-file
    fields, the ranks of its pipeline stage, and whether the model or the optimizer owns it."""

    name: str
    shape: tuple[int, ...]
    dev_matrix: tuple[int, ...]
    tensor_map: tuple[tuple[int, ...], ...]  # per dimension, MindSpore's axis numbers (-1: none)
    opt_weight_shard_size: int = 0
    rank_list: tuple[int, ...] = ()
    optimizer: bool = False
    ms_type: str = "Float32"
    layout: bool = True  # False: held whole, ``layout`` null (PyNative's unsharded tensors)


# --- MindSpore strategy.py _NetStrategyInfo ---------------------------------------------

def _used_dev_mat(dev_mat: list[int], tensor_map: list[list[int]]) -> list[bool]:
    used = {i for sub in tensor_map for i in sub if i != -1}
    return [(len(dev_mat) - i - 1) in used for i in range(len(dev_mat))]


def _calc_used_dev_num(dev_mat: list[int], tensor_map: list[list[int]]) -> int:
    idx = [i for i in chain.from_iterable(tensor_map) if i != -1]
    return int(np.prod([dev_mat[len(dev_mat) - i - 1] for i in idx])) if idx else 1


def _split_dev_dim(dev_mat: list[int], tensor_map: list[list[int]], counter: int, real_remain: int,
                   remain: int) -> tuple[list[int], int, list[list[int]], bool]:
    value = dev_mat[counter]
    first = remain // (real_remain // value)
    second = value // first
    new_dev = dev_mat[:counter] + [first, second] + dev_mat[counter + 1:]
    flag = len(new_dev) - 1 - counter
    new_map = [[v if v < flag or v == -1 else v + 1 for v in sub] for sub in tensor_map]
    return new_dev, counter, new_map, False


def _dev_mat_for_opt_shard(opt: int, dev_mat: list[int], tensor_map: list[list[int]]
                           ) -> tuple[list[int], int, list[list[int]], bool]:
    if opt == 0:
        return dev_mat, -1, tensor_map, True
    used = _calc_used_dev_num(dev_mat, tensor_map)
    total = int(np.prod(dev_mat))
    if opt == -1 or used * opt == total:
        return dev_mat, -1, tensor_map, True
    remain = total // (used * opt)
    mask = _used_dev_mat(dev_mat, tensor_map)
    counter, real_remain = -1, 1
    for axis, value in enumerate(dev_mat):
        if mask[axis]:
            continue
        if real_remain == remain:
            return dev_mat, counter, tensor_map, False
        if real_remain < remain:
            counter = axis
            real_remain *= value
            continue
        return _split_dev_dim(dev_mat, tensor_map, counter, real_remain, remain)
    if real_remain == remain:
        return dev_mat, counter, tensor_map, False
    return _split_dev_dim(dev_mat, tensor_map, counter, real_remain, remain)


def _compact(elem: Any) -> Any:
    if isinstance(elem, (list, tuple)):
        out = tuple(_compact(e) for e in elem)
        if len(out) == 1:
            return out[0]
        if all(x == "None" for x in out):
            return "None"
        return out
    return elem


def layout_process(p: MsParam) -> dict[str, Any]:
    """``Layout.to_dict()`` of the layout ``get_strategy_metadata`` reports for ``p``."""
    dev = list(p.dev_matrix)
    tmap = [list(sub) for sub in p.tensor_map]
    new_dev, counter, new_map, full = _dev_mat_for_opt_shard(p.opt_weight_shard_size, dev, tmap)
    alias = [chr(ord("a") + i) for i in range(len(new_dev))]

    def to_alias(i: int) -> str:
        return "None" if i == -1 else alias[len(alias) - i - 1]

    if p.opt_weight_shard_size == 0:
        alias_map: tuple[Any, ...] = tuple(tuple(to_alias(i) for i in sub) for sub in new_map)
    else:
        used = _used_dev_mat(new_dev, new_map)
        if full:
            unused = [len(used) - i - 1 for i, u in enumerate(used) if not u]
        else:
            unused = [len(used) - i - 1 for i, u in enumerate(used) if not u and i > counter]
        first = [d for d in list(new_map[0]) + unused if d != -1]
        first_alias = [to_alias(i) for i in first] or ["None"]
        head: Any = first_alias[0] if len(first_alias) == 1 else tuple(first_alias)
        rest = [tuple(to_alias(i) for i in sub) for sub in new_map[1:]]
        alias_map = tuple([head] + rest)
    alias_map = tuple(_compact(e) for e in alias_map)

    def to_int(a: Any) -> Any:  # Layout.__call__: alias -> axis number from the right, "None" -> -1
        if isinstance(a, tuple):
            return tuple(to_int(x) for x in a)
        return -1 if a == "None" else len(alias) - 1 - alias.index(a)

    ranks = list(p.rank_list) if p.rank_list else list(range(math.prod(p.dev_matrix)))
    return {"device_matrix": tuple(new_dev), "tensor_map": tuple(to_int(a) for a in alias_map),
            "interleaved_parallel": False, "alias_name": tuple(alias), "rank_list": ranks}


# --- MindFormers sharded_tensor.py -----------------------------------------------------

def sharding_strategy(layout: dict[str, Any]) -> list[int]:
    """``_DistributedTensorInfo(layout).sharding_strategy``."""
    dev = layout["device_matrix"]
    out = []
    for m in layout["tensor_map"]:
        if isinstance(m, (tuple, list)):
            out.append(math.prod(dev[len(dev) - v - 1] for v in m if v != -1))
        else:
            out.append(dev[len(dev) - m - 1] if m != -1 else 1)
    return out


def slice_table(layout: dict[str, Any]) -> list[int]:
    """Each rank-list position's slice number (``_get_global_offset_and_replica_id_from_layout``)."""
    dev, alias, rank_list = layout["device_matrix"], layout["alias_name"], layout["rank_list"]
    arrange: dict[Any, list[Any]] = {}
    stride = [1] * len(dev)
    for d in range(len(dev) - 1, -1, -1):
        stride[d] = 1 if d == len(dev) - 1 else stride[d + 1] * dev[d + 1]
        if dev[d] == 1:
            arrange[alias[d]] = [1, [0] * len(rank_list)]
            continue
        table: list[int] = []
        j = 0
        while j < len(rank_list):
            for i in range(dev[d]):
                table.extend([i] * stride[d])
            j += stride[d] * dev[d]
        arrange[alias[d]] = [dev[d], table]
    tmap = layout["tensor_map"]
    if len(tmap) == 1 and isinstance(tmap[0], (list, tuple)):
        tmap = tmap[0]
    flat: list[int] = []
    for item in tmap:
        flat.extend(item if isinstance(item, (list, tuple)) else [item])
    rank_num = len(next(iter(arrange.values()))[1])
    arrange[None] = [1, [0] * rank_num]
    pos_stride: list[Any] = [None] * len(flat)
    counts, strides = [1] * len(flat), [1] * len(flat)
    for pos in range(len(flat) - 1, -1, -1):
        dim = flat[pos]
        name = None if dim == -1 else alias[len(dev) - 1 - dim]
        counts[pos] = arrange.get(name, [1])[0]
        strides[pos] = 1 if pos == len(flat) - 1 else strides[pos + 1] * counts[pos + 1]
        pos_stride[pos] = [arrange.get(name, [1, [0] * rank_num])[1], strides[pos]]
    out = []
    for i in range(len(pos_stride[0][0])):
        out.append(sum(e[1] * e[0][i] for e in pos_stride if e and e[0] and len(e[0]) > i))
    return out


# --- writing --------------------------------------------------------------------------------

def checkpoint_name(prefix: str | None, idx: int, total: int, kind: str) -> str:
    """``utils.py`` ``get_checkpoint_name`` (plus ``.safetensors``)."""
    base = f"{kind}-{idx:07d}-{total:07d}"
    return (base if prefix is None else f"{prefix}-{base}") + ".safetensors"


def _shard(p: MsParam, rank: int) -> np.ndarray:
    g = global_value(p.name, p.shape, p.ms_type)
    if not p.layout:
        return g
    start = p.rank_list[0] if p.rank_list else 0
    lay = {"dev": list(p.dev_matrix), "map": [list(s) for s in p.tensor_map], "tshape": None,
           "opt": p.opt_weight_shard_size, "split": [], "offset": []}
    return np.ascontiguousarray(expected_shard(g, lay, rank - start))


def write_iteration(root: Path, params: list[MsParam], world: int, *, step: int = 10, prefix: str | None = None,
                    balanced: bool = False, shards: Callable[[MsParam, int], np.ndarray] | None = None,
                    extra_opt: Mapping[str, np.ndarray] | Callable[[int], Mapping[str, np.ndarray]] | None = None,
                    global_step: int | None = None, loss_scale: float | None = 1024.0) -> Path:
    """``root/iteration_<step>/`` as MindFormers saves it. A rank's pieces are ``shards(param,
    rank)`` (default: cut from the generated global value as MindSpore cuts it); ``extra_opt``
    entries (``global_step``: the optimizer's counter, ``global_step`` in ``common.json``,
    default ``step``) go into each rank's optimizer file without metadata, as the optimizer
    holds them."""
    shard_of = shards or _shard
    it = root / f"iteration_{step:08d}"
    it.mkdir(parents=True)
    metas: dict[int, dict[str, dict[str, Any]]] = {r: {} for r in range(world)}
    for p in params:
        ranks = list(p.rank_list) if p.rank_list else list(range(math.prod(p.dev_matrix)))
        if not p.layout:
            for r in ranks:
                metas[r][p.name] = {"p": p, "layout": None, "frag": [1] * len(p.shape), "local": list(p.shape),
                                    "offset": (0,), "replica": 0}
            continue
        layout = layout_process(p)
        frag = sharding_strategy(layout)
        local = [s // c for s, c in zip(p.shape, frag, strict=True)]
        table = slice_table(layout)
        counts: dict[int, int] = defaultdict(int)
        replica = []
        for s in table:
            replica.append(counts[s])
            counts[s] += 1
        for r in ranks:
            metas[r][p.name] = {"p": p, "layout": layout, "frag": frag, "local": local,
                                "offset": (table[r % len(table)],), "replica": replica}
    # which rank's file holds each piece
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = defaultdict(list)
    for r in range(world):
        for name, m in metas[r].items():
            holders[(name, m["offset"])].append(r)
    saver = {key: (ranks[i % len(ranks)] if balanced else None) for i, (key, ranks) in enumerate(holders.items())}
    files: dict[int, dict[str, dict[str, np.ndarray]]] = {r: {"model": {}, "opt": {}} for r in range(world)}
    for r in range(world):
        for name, m in metas[r].items():
            if balanced and saver[(name, m["offset"])] != r:
                continue
            files[r]["opt" if m["p"].optimizer else "model"][name] = shard_of(m["p"], r)
        for name, value in (extra_opt(r) if callable(extra_opt) else extra_opt or {}).items():
            files[r]["opt"][name] = value
    mapping: list[tuple[str, int, list[int], tuple[str, tuple[int, ...]]]] = []
    for kind in ("model", "opt"):
        writers = [r for r in range(world) if files[r][kind]] if balanced else list(range(world))
        for idx, r in enumerate(writers):
            fname = checkpoint_name(prefix, idx if balanced else r, len(writers), kind)
            save_file(files[r][kind], str(it / fname), metadata={"format": "ms"})
            for name, m in metas[r].items():
                key = (name, m["offset"])
                if m["p"].optimizer == (kind == "opt") and (not balanced or saver[key] == r):
                    mapping.append((fname, r, holders[key], key))
    state: dict[str, Any] = {}
    seen: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for r in range(world):
        for name, m in metas[r].items():
            chunk = {"global_offset": m["offset"], "local_shape": tuple(m["local"])}
            ckey = (tuple(chunk["global_offset"]), tuple(chunk["local_shape"]))
            if name not in state:
                state[name] = {"properties": {"dtype": m["p"].ms_type, "replica_id": m["replica"],
                                              "allow_shape_mismatch": False, "allow_to_save": True},
                               "global_shape": m["p"].shape, "axis_fragmentations": tuple(m["frag"]),
                               "layout": m["layout"], "chunk": [chunk]}
                seen[name] = {ckey}
            elif ckey not in seen[name]:
                seen[name].add(ckey)
                state[name]["chunk"].append(chunk)
    storage: dict[str, list[dict[str, Any]]] = {}
    for fname, rank, group, (name, offset) in mapping:
        storage.setdefault(str((name, tuple(offset))), []).append(
            {"file_name": fname, "storage_rank": rank, "rank_group": group})
    (it / "metadata.json").write_text(json.dumps({"state_dict_metadata": state, "storage_data": storage},
                                                 ensure_ascii=False, separators=(",", ":")))
    common = {"epoch_num": 1, "step_num": step, "global_step": step if global_step is None else global_step,
              "loss_scale": loss_scale, "global_batch_size": 8, "consumed_samples": 8 * step, "ckpt_status": None}
    (it / "common.json").write_text(json.dumps(common, ensure_ascii=False, indent=4))
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return it
