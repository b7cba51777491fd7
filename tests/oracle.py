"""An independent re-slicer: the shard each rank holds, cut from the global tensor with numpy.

The round-trip and property tests need an expected value that zckpt's layout maths did not
compute (zckpt also generated their inputs, so a bug in :mod:`zckpt.core.layout` would pass a
comparison with itself). This module reads the strategy file's raw fields itself (the
protobuf message through the generated classes, JSON with :mod:`json`) and applies
MindSpore's rules as the fixtures' ``make/verify_layout2.py`` states them, written again
from those rules; it imports nothing from ``zckpt.core.layout`` nor ``zckpt.formats.strategy``.

The rules, per parameter (``D`` = ``dev_matrix``, a rank's coordinate = its stage-local
rank unravelled row-major over ``D``, map entry ``k`` = axis ``D[len(D) - 1 - k]``):

* each tensor dimension is cut into as many equal pieces as the product of its axes; the
  piece a rank holds is the mixed-radix number of its coordinates on those axes, the first
  listed axis most significant;
* ``param_split_shape`` / ``indices_offset`` (manual split) give dimension 0's pieces
  their row counts and offsets instead; an optimizer state listed without them but with its
  parameter's ``D`` and map is cut like the parameter;
* a JSON file's expanded ``tensor_shape``: the global tensor is reshaped to it, cut by the
  single-axis map (a manual split still giving dimension 0's pieces, which the expansion
  leaves whole), and the slice reshaped back to the real number of dimensions;
* optimizer parallel (``opt_weight_shard_size`` ``s`` > 1, ``-1`` = every replica) cuts
  dimension 0 of that slice into ``s`` equal parts; the part is the mixed-radix number of the
  rank's coordinates on the axes the tensor does not use (size > 1), taken from the innermost
  axis outwards, the last one only by its inner factor;
* ``field`` changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from zckpt.third_party.mindspore_proto import ms_node_strategy_pb2 as pb

Layout = dict[str, Any]


def read_layouts(path: str | Path) -> dict[str, Layout]:
    """``{name: raw fields}`` of a non-pipeline strategy file (protobuf, or JSON by suffix)."""
    p = Path(path)
    out: dict[str, Layout] = {}
    if p.suffix == ".json":
        for name, it in json.loads(p.read_text())["parallel_layout_item"].items():
            tmap = [[a] if isinstance(a, int) else list(a) for a in it["tensor_map"]]
            out[name] = {
                "dev": list(it["dev_matrix"]), "map": tmap,
                "tshape": list(it["tensor_shape"]) if "tensor_shape" in it else None,
                "opt": int(it.get("opt_weight_shard_size", 0)),
                "split": list(it.get("param_split_shape", [])), "offset": list(it.get("indices_offset", [])),
            }
        return out
    msg = pb.ParallelStrategyMap.FromString(p.read_bytes())
    for item in msg.parallel_layout_item:
        lay = item.parallel_layouts
        if len(lay.tensor_map) > 1:
            tmap = [list(t.dim) for t in lay.tensor_map if len(t.dim)]
        else:
            tmap = [[a] for a in lay.tensor_map[0].dim]
        out[item.param_name] = {
            "dev": list(lay.dev_matrix[0].dim), "map": tmap, "tshape": None,
            "opt": int(lay.opt_weight_shard_size),
            "split": list(lay.param_split_shape[0].dim) if len(lay.param_split_shape) else [],
            "offset": list(lay.indices_offset[0].dim) if len(lay.indices_offset) else [],
        }
    return out


STATE_PREFIXES = ("moment1.", "moment2.", "moments.", "adam_m.", "adam_v.", "accu_grads.")


def effective(name: str, layouts: dict[str, Layout]) -> Layout:
    """``name``'s layout, with its parameter's manual split when MindSpore left it out."""
    lay = layouts[name]
    for prefix in STATE_PREFIXES:
        owner = layouts.get(name[len(prefix):]) if name.startswith(prefix) else None
        if owner and owner["split"] and not lay["split"] and (owner["dev"], owner["map"]) == (lay["dev"], lay["map"]):
            return {**lay, "split": owner["split"], "offset": owner["offset"]}
    return lay


def _coords(dev: list[int], rank: int) -> list[int]:
    return [int(c) for c in np.unravel_index(rank % int(np.prod(dev)), dev)]


def _axis(dev: list[int], a: int) -> int:
    return len(dev) - 1 - a


def _tp_slice(g: np.ndarray, dev: list[int], tmap: list[list[int]], split: list[int], offset: list[int],
              rank: int) -> np.ndarray:
    coord = _coords(dev, rank)
    index: list[slice] = []
    for d, axes in enumerate(tmap):
        count, piece = 1, 0
        for a in axes:
            if a < 0:
                continue
            n = dev[_axis(dev, a)]
            count *= n
            piece = piece * n + coord[_axis(dev, a)]
        if d == 0 and split:
            inner = len(split) // count
            index.append(slice(offset[piece * inner], offset[piece * inner] + split[piece * inner]))
            continue
        size = g.shape[d] // count
        index.append(slice(piece * size, (piece + 1) * size))
    return g[tuple(index)]


def _opt_part(lay: Layout, rank: int) -> tuple[int, int]:
    """(number of optimizer parts, this rank's part)."""
    dev, size = lay["dev"], lay["opt"]
    used = {_axis(dev, a) for axes in lay["map"] for a in axes if a >= 0}
    free = [i for i, n in enumerate(dev) if i not in used and n > 1]
    if size == -1:
        size = int(np.prod([dev[i] for i in free])) if free else 1
    if size <= 1:
        return 1, 0
    coord = _coords(dev, rank)
    digits: list[tuple[int, int]] = []
    left = size
    for i in reversed(free):
        take = min(dev[i], left)
        digits.append((take, coord[i] % take))
        left //= take
        if left == 1:
            break
    part = 0
    for take, c in reversed(digits):
        part = part * take + c
    return size, part


def expected_shard(g: np.ndarray, lay: Layout, rank: int, *, opt: bool = True) -> np.ndarray:
    """The part of global tensor ``g`` that stage-local ``rank`` holds under ``lay``."""
    tshape = lay["tshape"]
    if tshape is not None and list(tshape) != list(g.shape):
        flat = [[a] for axes in lay["map"] for a in axes]
        if lay["split"] and tshape[0] != g.shape[0]:
            raise ValueError("a manual split of a dimension 0 that the expanded tensor_shape splits again")
        piece = _tp_slice(g.reshape(tshape), lay["dev"], flat, lay["split"], lay["offset"], rank)
        real, j = [], 0
        for size in g.shape:
            full, local = 1, 1
            while full < size:  # expanded dims of size 1 left over belong nowhere: their pieces have 1 row
                full *= tshape[j]
                local *= piece.shape[j]
                j += 1
            real.append(local)
        out = piece.reshape(real)
    else:
        out = _tp_slice(g, lay["dev"], lay["map"], lay["split"], lay["offset"], rank)
    if opt:
        parts, part = _opt_part(lay, rank)
        if parts > 1:
            rows = out.shape[0] // parts
            out = out[part * rows:(part + 1) * rows]
    return out


def cut(g: np.ndarray, layouts: dict[str, Layout], name: str, rank: int) -> np.ndarray:
    """What stage-local ``rank`` holds of ``name`` (global value ``g``) under ``layouts``
    (:func:`read_layouts`): the oracle's slice when they list it, else the whole tensor, as
    MindSpore writes a parameter its strategy does not list."""
    if name not in layouts:
        return g
    return expected_shard(g, effective(name, layouts), rank)


def pieces(lay: Layout) -> list[int]:
    """How many equal pieces ``lay`` cuts each dimension into (dimension 0: the tensor-parallel
    pieces times the optimizer parts); a manual split is not counted."""
    dev = lay["dev"]
    out = [int(np.prod([dev[_axis(dev, a)] for a in axes if a >= 0])) for axes in lay["map"]]
    if out:
        out[0] *= _opt_part(lay, 0)[0]
    return out
