"""The export plan: for every destination rank, the global box of every entry its file holds.

Built from the entries' global specs and the destination strategy, by pure layout maths;
export, transform, segmented and unified writing, loading and verification act on the
:class:`~zckpt.plan.values.ExportPlan` it returns. MindSpore's habits on the destination side
(optimizer states that take their parameter's layout, ``accu_grads.*`` dropped or laid out
without the optimizer split) are decided here (:func:`destination_layouts`); the source side
is :mod:`zckpt.plan.ingest_plan`.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence

from zckpt.core.errors import LayoutError
from zckpt.core.layout import Box, Sharding, rank_box, resolve
from zckpt.formats.strategy import ParamLayout, StrategyMap
from zckpt.plan.entry_layouts import folded, stage_of, state_owner, with_owner_split, without_opt_shard
from zckpt.plan.values import ExportPlan, RankExport, Slice, TensorSpec


def dropped_entries(tensors: Sequence[TensorSpec], strategy: StrategyMap | None) -> frozenset[str]:
    """Entries a destination does not hold: gradient-accumulation buffers (``accu_grads.*``)
    exist only in pipeline training, so a destination whose strategy lists none gets none
    (MindSpore's transform copies them anyway; its compiled destination jobs do not hold them)."""
    if strategy is None or any(n.startswith("accu_grads.") for n in strategy.layouts):
        return frozenset()
    return frozenset(t.name for t in tensors if t.name.startswith("accu_grads."))


def destination_layouts(
    tensors: Sequence[TensorSpec], strategy: StrategyMap | None
) -> dict[str, dict[int, ParamLayout]]:
    """The destination layout of every entry, per destination stage.

    An optimizer state the destination strategy does not list takes its parameter's layout
    when both have the same global shape (older MindSpore saved strategies without them); a
    listed state of a ``manual_split`` table takes the table's uneven split
    (:func:`~zckpt.plan.entry_layouts.with_owner_split`, fixture s19); ``accu_grads.*`` are laid out without the
    optimizer split their strategy entries state, because MindSpore does not
    optimizer-shard them (fixture s07); JSON expanded layouts are folded onto the shape.
    """
    if strategy is None:
        return {}
    shapes = {t.name: t.shape for t in tensors}
    out: dict[str, dict[int, ParamLayout]] = {}
    for t in tensors:
        per = dict(strategy.layouts.get(t.name, {}))
        if not per and t.kind == "tensor":
            owner = state_owner(t.name, strategy.layouts)
            if owner is not None and shapes.get(owner) == t.shape:
                per = dict(strategy.layouts[owner])
        elif per and shapes.get(state_owner(t.name, strategy.layouts) or "") == t.shape:
            per = with_owner_split(t.name, per, strategy.layouts)
        if t.name.startswith("accu_grads."):
            per = {s: without_opt_shard(lay) for s, lay in per.items()}
        if per:
            out[t.name] = folded(per, t.shape, t.name) if t.kind == "tensor" else per
    return out


def _refuse_unlisted_stages(strategy: StrategyMap, ranks: Sequence[int], stage_dev: int) -> None:
    """A destination rank whose pipeline stage the strategy does not list would get no
    listed parameter, only unlisted ones written whole (a file of another stage's tensors):
    the strategy is one stage's file of a pipeline job, or lacks stages."""
    listed = set(strategy.stages)
    for r in ranks:
        if stage_of(r, stage_dev) not in listed:
            raise LayoutError(
                f"destination rank {r} is in pipeline stage {stage_of(r, stage_dev)}, which the destination "
                f"strategy does not list (it lists stage(s) {sorted(listed)} only): give the merged strategy of "
                "every stage (merge-strategies) or the directory of every rank's strategy file",
                path=", ".join(strategy.sources) or None)


def build_export_plan(
    tensors: Sequence[TensorSpec],
    strategy: StrategyMap | None,
    *,
    ranks: Iterable[int] | None = None,
) -> ExportPlan:
    """For every destination rank, the box of every entry it holds.

    Entries the destination strategy does not list are written whole, as MindSpore does for
    ``learning_rate`` and the like; a pipeline destination rank holds only its stage's
    parameters. Three MindSpore habits are handled (see :func:`destination_layouts`).
    """
    if strategy is None:
        device_num, stage_dev = 1, 1
    else:
        stage_dev = strategy.stage_device_num()
        device_num = strategy.device_num()
    dst_layouts = destination_layouts(tensors, strategy)
    dropped = dropped_entries(tensors, strategy)
    wanted = list(range(device_num)) if ranks is None else sorted(set(ranks))
    for r in wanted:
        if not 0 <= r < device_num:
            raise LayoutError(f"destination rank {r} is outside the destination's {device_num} ranks")
    if strategy is not None:
        _refuse_unlisted_stages(strategy, wanted, stage_dev)
    same: dict[Sharding, Sharding] = {}  # equal shardings as one object: their boxes are built once
    boxes: dict[tuple[int, int], Box] = {}
    held: dict[int, list[tuple[str, Sharding | Slice]]] = {}
    out: list[RankExport] = []
    for r in wanted:
        stage = stage_of(r, stage_dev)
        items = held.get(stage)
        if items is None:
            items = held[stage] = _stage_items(tensors, dst_layouts, dropped, stage, same)
        local = r % stage_dev
        slices: list[Slice] = []
        for name, held_as in items:
            if isinstance(held_as, Slice):
                slices.append(held_as)
                continue
            box = boxes.get((id(held_as), local))
            if box is None:
                box = boxes[id(held_as), local] = rank_box(held_as, local)
            slices.append(Slice(name, box))
        out.append(RankExport(r, tuple(slices)))
    return ExportPlan(tuple(out), device_num)


def _stage_items(tensors: Sequence[TensorSpec], dst_layouts: Mapping[str, Mapping[int, ParamLayout]],
                 dropped: Container[str], stage: int,
                 same: dict[Sharding, Sharding]) -> list[tuple[str, Sharding | Slice]]:
    """What a rank of ``stage`` holds of each entry, in order: its sharding, or the one
    :class:`Slice` of the whole entry every such rank shares (1 024 ranks, one slice each)."""
    items: list[tuple[str, Sharding | Slice]] = []
    for t in tensors:
        if t.name in dropped:
            continue
        per = dst_layouts.get(t.name, {})
        if per and stage not in per:
            continue
        lay = per.get(stage) if per else None
        if lay is None or t.kind != "tensor":
            items.append((t.name, Slice(t.name, Box.full(t.shape))))
            continue
        sh = resolve(lay, t.shape, param=t.name)
        items.append((t.name, same.setdefault(sh, sh)))
    return items


def served_boxes(tensors: Sequence[TensorSpec], strategies: Iterable[StrategyMap | None]) -> dict[str, list[Box]]:
    """Per tensor, the distinct boxes the ranks of these destination strategies hold: a
    store chunked on their borders hands each such rank its slice as whole chunks."""
    out: dict[str, dict[Box, None]] = {}
    for strategy in strategies:
        for r in build_export_plan(tensors, strategy).ranks:
            for s in r.slices:
                if s.box.ndim and s.box.size:
                    out.setdefault(s.name, {})[s.box] = None
    return {n: list(bs) for n, bs in out.items()}
