"""The order of entries in a destination file: the sources' orders merged across pipeline stages.

Each stage's source files list only their stage's parameters; a destination file lists them
as MindSpore's compiled network does. The merge keeps every source order and aligns their
shared entries (the optimizer scalars), grouping optimizer states by kind as optimizers do.
The ingest plan orders its tensors with it; nothing here reads a layout.
"""

from __future__ import annotations

from collections.abc import Sequence

from zckpt.plan.entry_layouts import STATE_PREFIXES


def merge_orders(first: Sequence[str], second: Sequence[str]) -> list[str]:
    """Merge two entry orders, keeping each one's relative order and aligning their common entries.

    Pipeline stages hold different parameters but share the optimizer scalars; putting one
    stage's entries before the other's between shared anchors rebuilds the network's order
    (parameters, then scalars, then optimizer states), which is the order MindSpore's
    compiled destination files have.
    """
    if not first:
        return list(second)  # what the merge below gives (one source order: nothing to align)
    pos = {x: i for i, x in enumerate(first)}
    out: list[str] = []
    taken = 0
    pending: list[str] = []
    for x in second:
        i = pos.get(x)
        if i is None:
            pending.append(x)
        elif i >= taken:
            out.extend(_merge_segment(first[taken:i], pending))
            out.append(x)
            pending = []
            taken = i + 1
    out.extend(_merge_segment(first[taken:], pending))
    return out


def _state_prefix(name: str) -> str:
    return next((p for p in STATE_PREFIXES if name.startswith(p)), "")


def _merge_segment(first: Sequence[str], second: Sequence[str]) -> list[str]:
    """Two stages' entries between the same anchors, grouped by kind when both are.

    An optimizer lists all ``moment1.*`` before all ``moment2.*`` (fixture s21), so when
    each stage's run is grouped by state prefix the groups are merged (each stage's order
    kept inside a group); otherwise the first stage's entries come first.
    """
    groups: list[str] = []
    for x in (*first, *second):
        if _state_prefix(x) not in groups:
            groups.append(_state_prefix(x))

    def grouped(seq: Sequence[str]) -> bool:
        keys = [groups.index(_state_prefix(x)) for x in seq]
        return keys == sorted(keys)

    if not (grouped(first) and grouped(second)):
        return [*first, *second]
    return [x for g in groups for seq in (first, second) for x in seq if _state_prefix(x) == g]
