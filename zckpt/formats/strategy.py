"""Read and write MindSpore parallel strategy files (protobuf or JSON).

A strategy file lists, for every parameter the parallel compiler laid out, the device
matrix, the tensor map and the optimizer-shard settings. Only that layout part matters for
checkpoints; operator strategies are kept verbatim so that files zckpt writes (merges,
generated test inputs) stay loadable by MindSpore.

Pipeline jobs write one file per rank holding only its stage's parameters (their stage is
in ``parallel_strategy_item``); ``merge_pipeline_strategys`` prefixes each name with
``"<stage>-"``. Both shapes are read into the same :class:`StrategyMap`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError

from zckpt.errors import StrategyError
from zckpt.formats.pb import ms_node_strategy_pb2 as pb

_STAGE_PREFIX = re.compile(r"^(\d+)-(.+)$", re.DOTALL)


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's layout as the strategy file states it.

    ``tensor_map`` holds, per tensor dimension, the device axes that split it, outermost
    first, in MindSpore's numbering (axis ``k`` is ``dev_matrix[len(dev_matrix) - 1 - k]``);
    an empty tuple means the dimension is not split.
    """

    dev_matrix: tuple[int, ...]
    tensor_map: tuple[tuple[int, ...], ...]
    opt_shard_step: int = 0
    opt_shard_size: int = 0
    field_size: int = 0
    param_split_shape: tuple[int, ...] = ()
    indices_offset: tuple[int, ...] = ()
    tensor_shape: tuple[int, ...] | None = None

    @property
    def device_num(self) -> int:
        return math.prod(self.dev_matrix)

    def flat_tensor_map(self) -> tuple[int, ...] | None:
        """The single-axis tensor map MindSpore writes when no dimension has several axes."""
        if any(len(axes) > 1 for axes in self.tensor_map):
            return None
        return tuple(axes[0] if axes else -1 for axes in self.tensor_map)


@dataclass(frozen=True)
class StrategyMap:
    """The layouts of one strategy file (or of a merged/combined set of files).

    ``layouts[name][stage]`` is the layout of ``name`` in pipeline ``stage``; a
    non-pipeline job has only stage 0.
    """

    layouts: Mapping[str, Mapping[int, ParamLayout]]
    sources: tuple[str, ...] = ()
    operator_strategies: Mapping[str, tuple[int, tuple[tuple[int, ...], ...]]] = field(
        default_factory=dict
    )

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted({s for per in self.layouts.values() for s in per}))

    @property
    def stage_num(self) -> int:
        return len(self.stages)

    def stage_device_num(self) -> int:
        """Devices per pipeline stage: every layout's dev_matrix product must agree."""
        nums = {lay.device_num for per in self.layouts.values() for lay in per.values()}
        if not nums:
            raise StrategyError("strategy holds no parameter layout", path=self._where())
        if len(nums) > 1:
            raise StrategyError(
                f"layouts disagree on the device count per stage: {sorted(nums)}", path=self._where()
            )
        return nums.pop()

    def device_num(self) -> int:
        return self.stage_device_num() * max(1, self.stage_num)

    def layout(self, name: str, stage: int = 0) -> ParamLayout | None:
        per = self.layouts.get(name)
        if per is None:
            return None
        return per.get(stage)

    def _where(self) -> str | None:
        return ", ".join(self.sources) if self.sources else None


def read_strategy(path: str | Path) -> StrategyMap:
    """Read a strategy file; JSON when the name ends with ``.json`` (as MindSpore decides)."""
    p = Path(path)
    if not p.is_file():
        raise StrategyError("no such strategy file", path=p)
    if p.stat().st_size == 0:
        raise StrategyError("strategy file is empty", path=p)
    if p.suffix == ".json":
        return _read_json(p)
    return _read_protobuf(p)


def read_strategies(paths: Iterable[str | Path]) -> StrategyMap:
    """Combine several strategy files (e.g. one per pipeline rank) into one map.

    Identical layouts of the same parameter and stage are de-duplicated; conflicting ones
    are refused.
    """
    combined: dict[str, dict[int, ParamLayout]] = {}
    sources: list[str] = []
    ops: dict[str, tuple[int, tuple[tuple[int, ...], ...]]] = {}
    for path in paths:
        one = read_strategy(path)
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


def _split_stage(name: str, file_stage: int) -> tuple[int, str]:
    m = _STAGE_PREFIX.match(name)
    if m:
        return int(m.group(1)), m.group(2)
    return file_stage, name


def _read_protobuf(p: Path) -> StrategyMap:
    msg = pb.ParallelStrategyMap()
    try:
        msg.ParseFromString(p.read_bytes())
    except DecodeError as err:
        raise StrategyError(f"not a protobuf strategy file ({err})", path=p) from None
    if not msg.IsInitialized():
        missing = ", ".join(msg.FindInitializationErrors()[:5])  # type: ignore[attr-defined]
        raise StrategyError(f"not a protobuf strategy file (required fields missing: {missing})", path=p)
    ops = {
        item.node_name: (
            int(item.parallel_strategys.stage),
            tuple(tuple(int(d) for d in s.dim) for s in item.parallel_strategys.parallel_strategy),
        )
        for item in msg.parallel_strategy_item
    }
    file_stage = _file_stage(ops)
    layouts: dict[str, dict[int, ParamLayout]] = {}
    for item in msg.parallel_layout_item:
        stage, name = _split_stage(item.param_name, file_stage)
        layouts.setdefault(name, {})[stage] = _layout_from_pb(item.parallel_layouts, p, name)
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


def _layout_from_pb(pl: pb.ParallelLayouts, p: Path, name: str) -> ParamLayout:
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


def make_layout(
    dev_matrix: Iterable[int],
    tensor_map: Iterable[object],
    *,
    opt_shard_step: int = 0,
    opt_shard_size: int = 0,
    field_size: int = 0,
    param_split_shape: Iterable[int] = (),
    indices_offset: Iterable[int] = (),
    tensor_shape: Iterable[int] | None = None,
    path: str | Path | None = None,
    param: str | None = None,
) -> ParamLayout:
    """Build and check a :class:`ParamLayout` from raw file values.

    ``tensor_map`` entries are ints (``-1`` = not split) or lists of ints (several axes).
    """
    dev = tuple(int(d) for d in dev_matrix)
    if not dev or any(d < 1 for d in dev):
        raise StrategyError(f"dev_matrix {list(dev)} must hold positive sizes", path=path, param=param)
    tmap: list[tuple[int, ...]] = []
    used: set[int] = set()
    for entry in tensor_map:
        axes_raw = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        try:
            ints = [int(a) for a in axes_raw]  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise StrategyError(
                f"tensor_map entry {entry!r} is not an int or a list of ints", path=path, param=param
            ) from None
        axes = tuple(a for a in ints if a != -1)
        for a in axes:
            if not 0 <= a < len(dev):
                raise StrategyError(
                    f"tensor_map names device axis {a} but dev_matrix {list(dev)} has {len(dev)} axes",
                    path=path,
                    param=param,
                )
            if a in used:
                raise StrategyError(
                    f"tensor_map uses device axis {a} twice", path=path, param=param
                )
            used.add(a)
        tmap.append(axes)
    if opt_shard_size < -1:
        raise StrategyError(
            f"opt_weight_shard_size {opt_shard_size} is negative", path=path, param=param
        )
    return ParamLayout(
        dev_matrix=dev,
        tensor_map=tuple(tmap),
        opt_shard_step=int(opt_shard_step),
        opt_shard_size=int(opt_shard_size),
        field_size=int(field_size),
        param_split_shape=tuple(int(x) for x in param_split_shape),
        indices_offset=tuple(int(x) for x in indices_offset),
        tensor_shape=None if tensor_shape is None else tuple(int(x) for x in tensor_shape),
    )


def _read_json(p: Path) -> StrategyMap:
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StrategyError(f"not a JSON strategy file ({err})", path=p) from None
    if not isinstance(doc, dict):
        raise StrategyError("JSON strategy must be an object", path=p)
    ops: dict[str, tuple[int, tuple[tuple[int, ...], ...]]] = {}
    for node, item in (doc.get("parallel_strategy_item") or {}).items():
        try:
            ops[node] = (
                int(item.get("stage", 0)),
                tuple(tuple(int(d) for d in s) for s in item.get("parallel_strategy", [])),
            )
        except (TypeError, ValueError, AttributeError) as err:
            raise StrategyError(f"bad parallel_strategy_item {node!r}: {err}", path=p) from None
    file_stage = _file_stage(ops)
    layouts: dict[str, dict[int, ParamLayout]] = {}
    items = doc.get("parallel_layout_item") or {}
    if not isinstance(items, dict):
        raise StrategyError("parallel_layout_item must be an object", path=p)
    for full_name, it in items.items():
        stage, name = _split_stage(full_name, file_stage)
        try:
            lay = make_layout(
                it["dev_matrix"],
                it["tensor_map"],
                opt_shard_step=int(it.get("opt_weight_shard_step", 0)),
                opt_shard_size=int(it.get("opt_weight_shard_size", 0)),
                field_size=int(it.get("field", 0)),
                param_split_shape=it.get("param_split_shape", ()),
                indices_offset=it.get("indices_offset", ()),
                tensor_shape=it.get("tensor_shape"),
                path=p,
                param=name,
            )
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, StrategyError):
                raise
            raise StrategyError(f"bad layout entry: {err!r}", path=p, param=name) from None
        layouts.setdefault(name, {})[stage] = lay
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
    """Serialize to MindSpore's JSON form (the layout of ``StrategyCheckpointInfo::to_json``)."""
    prefix = smap.stage_num > 1 if merged is None else merged
    ops = {
        node: {"stage": stage, "parallel_strategy": [list(d) for d in dims]}
        for node, (stage, dims) in smap.operator_strategies.items()
    }
    items: dict[str, dict[str, object]] = {}
    for name, per in smap.layouts.items():
        for stage, lay in sorted(per.items()):
            flat = lay.flat_tensor_map()
            entry: dict[str, object] = {
                "dev_matrix": list(lay.dev_matrix),
                "tensor_map": list(flat) if flat is not None else [list(a) or [-1] for a in lay.tensor_map],
                "field": lay.field_size,
                "opt_weight_shard_step": lay.opt_shard_step,
                "opt_weight_shard_size": lay.opt_shard_size,
            }
            if lay.tensor_shape is not None:
                entry["tensor_shape"] = list(lay.tensor_shape)
            if lay.param_split_shape:
                entry["param_split_shape"] = list(lay.param_split_shape)
                entry["indices_offset"] = list(lay.indices_offset)
            items[f"{stage}-{name}" if prefix else name] = entry
    doc = {"current_stage": current_stage, "parallel_strategy_item": ops, "parallel_layout_item": items}
    return json.dumps(doc, indent=1)
