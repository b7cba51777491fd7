"""Read and write MindSpore parallel strategy files (protobuf or JSON).

A strategy file lists, for every parameter the parallel compiler laid out, the device
matrix, the tensor map and the optimizer-shard settings. Only that layout part matters for
checkpoints; operator strategies are kept verbatim so that files zckpt writes (merges,
generated test inputs) stay loadable by MindSpore.

Pipeline jobs write one file per rank holding only its stage's parameters (their stage is
in ``parallel_strategy_item``); ``merge_pipeline_strategys`` prefixes each name with
``"<stage>-"``. Both shapes are read into the same :class:`StrategyMap`.

A tensor dimension split over several device axes (``mindspore.parallel.Layout`` with a
tuple) is written two ways. Protobuf files give that dimension its own ``TensorMap``
listing the axes. JSON files hold the *expanded* layout instead: the dimension becomes k
dimensions in ``tensor_shape`` and ``tensor_map``, the first k-1 the size of their axis
and the last one the rest, and a size-1 axis is dropped from ``dev_matrix`` (its entry is
-1) yet still gives a dimension. Which expanded dimensions make up one real dimension is
not written down, only the real shape tells, so a JSON layout is read as written and
folded by :func:`fold_layout` once the tensor's shape is known; :func:`expand_layout`
writes the expanded form back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from google.protobuf.message import DecodeError

from zckpt.core.errors import StrategyError

# The values a strategy holds live in zckpt.core.strategy_values; their readers still import them from here.
from zckpt.core.strategy_values import MAX_DEVICES as MAX_DEVICES
from zckpt.core.strategy_values import ParamLayout as ParamLayout
from zckpt.core.strategy_values import StrategyMap as StrategyMap
from zckpt.core.strategy_values import check_range
from zckpt.core.strategy_values import expand_layout as expand_layout
from zckpt.core.strategy_values import fold_candidates as fold_candidates
from zckpt.core.strategy_values import fold_layout as fold_layout
from zckpt.core.strategy_values import make_layout as make_layout
from zckpt.third_party.mindspore_proto import ms_node_strategy_pb2 as pb

_STAGE_PREFIX = re.compile(r"^([0-9]{1,10})-(.+)$", re.DOTALL)
"""MindSpore writes ``f"{stage}-{name}"`` with a uint32 stage: ASCII digits only and at most
10 of them (``int()`` refuses numbers of more than 4300 digits with a ValueError)."""

def read_strategy(path: str | Path) -> StrategyMap:
    """Read a strategy file; JSON when the name ends with ``.json`` (as MindSpore decides)."""
    p = Path(path)
    if not p.is_file():
        raise StrategyError("no such strategy file", path=p)
    return parse_strategy(_read_bytes(p), p)


def parse_strategy(data: bytes, name: str | Path) -> StrategyMap:
    """A strategy file from its bytes (a file at a URL is read whole into memory: strategy
    files are KiBs to MiBs); ``name`` names it in errors and in the map's sources, and says
    JSON by its ``.json`` end, as for a file."""
    if not data:
        raise StrategyError("strategy file is empty", path=name)
    if Path(name).suffix == ".json":
        return _read_json(data, name)
    return _read_protobuf(data, name)


def _read_bytes(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError as err:
        raise StrategyError(f"cannot read: {err.strerror}", path=p) from None


def read_strategies(paths: Iterable[str | Path]) -> StrategyMap:
    """Combine several strategy files (e.g. one per pipeline rank) into one map.

    Identical layouts of the same parameter and stage are de-duplicated; conflicting ones
    are refused.
    """
    return combine_strategies(read_strategy(p) for p in paths)


def combine_strategies(maps: Iterable[StrategyMap]) -> StrategyMap:
    """:func:`read_strategies` of maps already read (each named by its sources)."""
    combined: dict[str, dict[int, ParamLayout]] = {}
    sources: list[str] = []
    ops: dict[str, tuple[int, tuple[tuple[int, ...], ...]]] = {}
    for one in maps:
        path = one.sources[-1] if one.sources else None
        sources.extend(one.sources)
        ops.update(one.operator_strategies)
        for name, per in one.layouts.items():
            slot = combined.setdefault(name, {})
            for stage, lay in per.items():
                old = slot.get(stage)
                if old is not None and old != lay:
                    raise StrategyError(
                        f"stage {stage} layout differs between strategy files", path=path, param=name
                    )
                slot[stage] = lay
    return StrategyMap(layouts=combined, sources=tuple(sources), operator_strategies=ops)


def _split_stages(names: list[str], file_stage: int, p: str | Path) -> list[tuple[int, str]]:
    """(stage, parameter name) of every layout name of one file.

    ``merge_pipeline_strategys`` prefixes *every* name with ``"<stage>-"``, so names are
    split only when all of them carry such a prefix: in a per-rank or non-pipeline file a
    parameter that happens to be called ``"7-x"`` keeps its name instead of being read as
    ``x`` of stage 7 (which ingest then refused as a sharded tensor with no layout).
    """
    if any(not n for n in names):
        raise StrategyError("a layout has an empty parameter name", path=p)
    matches = [_STAGE_PREFIX.match(n) for n in names]
    if names and all(matches):
        return [(int(m.group(1)), m.group(2)) for m in matches if m]
    return [(file_stage, n) for n in names]


def _add_layout(
    layouts: dict[str, dict[int, ParamLayout]], name: str, stage: int, lay: ParamLayout, p: str | Path
) -> None:
    """Record a layout; a parameter listed twice for one stage must say the same both times."""
    old = layouts.setdefault(name, {}).get(stage)
    if old is not None and old != lay:
        raise StrategyError(f"listed twice for stage {stage} with different layouts", path=p, param=name)
    layouts[name][stage] = lay


def _pb_text(value: str | bytes, what: str, p: str | Path) -> str:
    """A proto2 ``string`` field: upb hands back ``bytes`` when the wire bytes are not UTF-8."""
    if isinstance(value, bytes):
        raise StrategyError(f"{what} {value[:40]!r} is not UTF-8", path=p)
    return value


def _read_protobuf(data: bytes, p: str | Path) -> StrategyMap:
    msg = pb.ParallelStrategyMap()
    try:
        msg.ParseFromString(data)
    except DecodeError as err:
        raise StrategyError(f"not a protobuf strategy file ({err})", path=p) from None
    if not msg.IsInitialized():
        missing = ", ".join(msg.FindInitializationErrors()[:5])  # type: ignore[attr-defined]
        raise StrategyError(f"not a protobuf strategy file (required fields missing: {missing})", path=p)
    ops = {
        _pb_text(item.node_name, "node_name", p): (
            int(item.parallel_strategys.stage),
            tuple(tuple(int(d) for d in s.dim) for s in item.parallel_strategys.parallel_strategy),
        )
        for item in msg.parallel_strategy_item
    }
    file_stage = _file_stage(ops)
    layouts: dict[str, dict[int, ParamLayout]] = {}
    names = _split_stages([_pb_text(item.param_name, "param_name", p) for item in msg.parallel_layout_item],
                          file_stage, p)
    for item, (stage, name) in zip(msg.parallel_layout_item, names, strict=True):
        _add_layout(layouts, name, stage, _layout_from_pb(item.parallel_layouts, p, name), p)
    return StrategyMap(layouts=layouts, sources=(str(p),), operator_strategies=ops)


def _file_stage(ops: Mapping[str, tuple[int, tuple[tuple[int, ...], ...]]]) -> int:
    """A per-rank pipeline file names its stage only through its operator strategies."""
    for stage, _ in ops.values():
        return stage  # MindSpore takes the first operator's stage
    return 0


def _first_dims(items: Iterable[pb.ParamSplitShape] | Iterable[pb.IndicesOffset]) -> tuple[int, ...]:
    for it in items:
        return tuple(int(d) for d in it.dim)
    return ()


def _layout_from_pb(pl: pb.ParallelLayouts, p: str | Path, name: str) -> ParamLayout:
    if len(pl.dev_matrix) == 0 or len(pl.tensor_map) == 0:
        raise StrategyError("layout has no dev_matrix or no tensor_map", path=p, param=name)
    dev = tuple(int(d) for d in pl.dev_matrix[0].dim)
    if len(pl.tensor_map) > 1:
        raw: list[object] = [list(tm.dim) for tm in pl.tensor_map if len(tm.dim) > 0]
    else:
        raw = list(pl.tensor_map[0].dim)
    return make_layout(
        dev,
        raw,
        opt_shard_step=int(pl.opt_weight_shard_step),
        opt_shard_size=int(pl.opt_weight_shard_size),
        field_size=int(pl.field),
        param_split_shape=_first_dims(pl.param_split_shape),
        indices_offset=_first_dims(pl.indices_offset),
        path=p,
        param=name,
    )


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads`` keeps the last of duplicate keys silently; a strategy that lists a
    parameter twice is ambiguous, so it is refused (ValueError: reported as not JSON)."""
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out and out[k] != v:
            raise ValueError(f"key {k!r} appears twice with different values")
        out[k] = v
    return out


def _json_int(value: object, what: str) -> int:
    """A JSON number that is an integer (``2`` or ``2.0``); bools, strings, fractions, NaN and
    infinities are refused (``int(float("inf"))`` would raise OverflowError, ``int(True)`` is 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} {value!r} is not an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise TypeError(f"{what} {value!r} is not an integer")
        return int(value)
    return value


def _json_ints(value: object, what: str) -> list[int]:
    if not isinstance(value, list):
        raise TypeError(f"{what} {value!r} is not a list of integers")
    return [_json_int(v, what) for v in value]


def _json_tensor_map(value: object) -> list[object]:
    if not isinstance(value, list):
        raise TypeError(f"tensor_map {value!r} is not a list")
    return [_json_ints(e, "tensor_map entry") if isinstance(e, list) else _json_int(e, "tensor_map entry")
            for e in value]


def _read_json(data: bytes, p: str | Path) -> StrategyMap:
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        # ValueError also covers integers of more than 4300 digits; RecursionError deep nesting
        raise StrategyError(f"not a JSON strategy file ({type(err).__name__}: {err})", path=p) from None
    if not isinstance(doc, dict):
        raise StrategyError("JSON strategy must be an object", path=p)
    ops: dict[str, tuple[int, tuple[tuple[int, ...], ...]]] = {}
    op_items = doc.get("parallel_strategy_item") or {}
    if not isinstance(op_items, dict):
        raise StrategyError("parallel_strategy_item must be an object", path=p)
    for node, item in op_items.items():
        try:
            if not isinstance(item, dict):
                raise TypeError("not an object")
            strategies = item.get("parallel_strategy", [])
            if not isinstance(strategies, list):
                raise TypeError("parallel_strategy is not a list")
            stage = _json_int(item.get("stage", 0), "stage")
            check_range("stage", [stage], (0, 2**32 - 1), p, None)
            dims = [_json_ints(s, "parallel_strategy") for s in strategies]
            check_range("parallel_strategy", [d for x in dims for d in x], (0, 2**32 - 1), p, None)
            ops[node] = (stage, tuple(tuple(x) for x in dims))
        except TypeError as err:
            raise StrategyError(f"bad parallel_strategy_item {node!r}: {err}", path=p) from None
    file_stage = _file_stage(ops)
    layouts: dict[str, dict[int, ParamLayout]] = {}
    items = doc.get("parallel_layout_item") or {}
    if not isinstance(items, dict):
        raise StrategyError("parallel_layout_item must be an object", path=p)
    for (stage, name), it in zip(_split_stages(list(items), file_stage, p), items.values(), strict=True):
        try:
            if not isinstance(it, dict):
                raise TypeError(f"layout entry {it!r} is not an object")
            shape = it.get("tensor_shape")
            lay = make_layout(
                _json_ints(it["dev_matrix"], "dev_matrix"),
                _json_tensor_map(it["tensor_map"]),
                opt_shard_step=_json_int(it.get("opt_weight_shard_step", 0), "opt_weight_shard_step"),
                opt_shard_size=_json_int(it.get("opt_weight_shard_size", 0), "opt_weight_shard_size"),
                field_size=_json_int(it.get("field", 0), "field"),
                param_split_shape=_json_ints(it.get("param_split_shape", []), "param_split_shape"),
                indices_offset=_json_ints(it.get("indices_offset", []), "indices_offset"),
                tensor_shape=None if shape is None else _json_ints(shape, "tensor_shape"),
                path=p,
                param=name,
            )
        except KeyError as err:
            raise StrategyError(f"bad layout entry: missing {err}", path=p, param=name) from None
        except TypeError as err:
            raise StrategyError(f"bad layout entry: {err}", path=p, param=name) from None
        _add_layout(layouts, name, stage, lay, p)
    return StrategyMap(layouts=layouts, sources=(str(p),), operator_strategies=ops)


def _layout_to_pb(lay: ParamLayout, out: pb.ParallelLayouts) -> None:
    out.dev_matrix.add().dim.extend(lay.dev_matrix)
    flat = lay.flat_tensor_map()
    if flat is not None:
        out.tensor_map.add().dim.extend(flat)
    else:
        for axes in lay.tensor_map:
            out.tensor_map.add().dim.extend(axes if axes else (-1,))
        if len(lay.tensor_map) == 1:
            out.tensor_map.add()  # as MindSpore does: one entry alone would read as a flat map
    out.param_split_shape.add().dim.extend(lay.param_split_shape)
    out.indices_offset.add().dim.extend(lay.indices_offset)
    out.field = lay.field_size
    out.opt_weight_shard_step = lay.opt_shard_step
    out.opt_weight_shard_size = lay.opt_shard_size


def encode_strategy(smap: StrategyMap, *, merged: bool | None = None, current_stage: int = 0) -> bytes:
    """Serialize to MindSpore's protobuf form.

    With several stages (or ``merged=True``) parameter names get the ``"<stage>-"`` prefix,
    as ``merge_pipeline_strategys`` writes them.
    """
    prefix = smap.stage_num > 1 if merged is None else merged
    msg = pb.ParallelStrategyMap()
    msg.current_stage = current_stage
    for node, (stage, dims) in smap.operator_strategies.items():
        item = msg.parallel_strategy_item.add()
        item.node_name = node
        item.parallel_strategys.stage = stage
        for d in dims:
            item.parallel_strategys.parallel_strategy.add().dim.extend(d)
    for name, per in smap.layouts.items():
        for stage, lay in sorted(per.items()):
            li = msg.parallel_layout_item.add()
            li.param_name = f"{stage}-{name}" if prefix else name
            _layout_to_pb(lay, li.parallel_layouts)
    return msg.SerializeToString()


def encode_strategy_json(smap: StrategyMap, *, merged: bool | None = None, current_stage: int = 0) -> str:
    """Serialize to MindSpore's JSON form (the layout of ``StrategyCheckpointInfo::to_json``).

    A layout whose ``tensor_shape`` is the real shape is written expanded, as MindSpore
    does (:func:`expand_layout`), so that reading it back and folding it gives the same boxes;
    size-1 axes stay in ``dev_matrix`` (MindSpore drops them; both read the same).
    """
    prefix = smap.stage_num > 1 if merged is None else merged
    ops = {
        node: {"stage": stage, "parallel_strategy": [list(d) for d in dims]}
        for node, (stage, dims) in smap.operator_strategies.items()
    }
    items: dict[str, dict[str, object]] = {}
    for name, per in smap.layouts.items():
        for stage, lay in sorted(per.items()):
            expanded = expand_layout(lay)
            entry: dict[str, object] = {
                "dev_matrix": list(lay.dev_matrix),
                # without a real shape a multi-axis map cannot be expanded: zckpt's own nested-list form
                "tensor_map": [list(a) or [-1] for a in lay.tensor_map] if expanded is None else expanded[1],
                "field": lay.field_size,
                "opt_weight_shard_step": lay.opt_shard_step,
                "opt_weight_shard_size": lay.opt_shard_size,
            }
            if expanded is not None and lay.tensor_shape is not None:
                entry["tensor_shape"] = expanded[0]
            if lay.param_split_shape or lay.indices_offset:
                entry["param_split_shape"] = list(lay.param_split_shape)
                entry["indices_offset"] = list(lay.indices_offset)
            items[f"{stage}-{name}" if prefix else name] = entry
    doc = {"current_stage": current_stage, "parallel_strategy_item": ops, "parallel_layout_item": items}
    return json.dumps(doc, indent=1)
