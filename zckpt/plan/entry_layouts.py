"""An entry's layouts per pipeline stage, as both ends of a plan read them.

The source side (:mod:`zckpt.plan.ingest_plan`) and the destination side
(:mod:`zckpt.plan.export_plan`) apply a strategy's layouts to the entries the same way: which
pipeline stage a rank is in, JSON expanded layouts folded onto the real shape, and
MindSpore's habits with optimizer states (a state named after its parameter takes the
parameter's uneven split; ``accu_grads.*`` are laid out without the optimizer split). Those
shared rules are here, once; what each side decides with them stays in its own module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from zckpt.formats.strategy import ParamLayout, fold_layout


def stage_of(rank: int, stage_device_num: int) -> int:
    """The pipeline stage of global ``rank`` (0 without stages)."""
    return rank // stage_device_num if stage_device_num > 0 else 0


STATE_PREFIXES = ("accu_grads.", "moments.", "moment1.", "moment2.", "adam_m.", "adam_v.", "exp_avg.", "exp_avg_sq.")
"""Prefixes MindSpore optimizers and gradient accumulation give the states of a parameter."""


def state_owner(name: str, known: Iterable[str]) -> str | None:
    """The parameter an optimizer/accumulator state belongs to (``moments.w`` -> ``w``)."""
    names = set(known)
    for prefix in STATE_PREFIXES:
        if name.startswith(prefix) and name[len(prefix) :] in names:
            return name[len(prefix) :]
    return None


def without_opt_shard(lay: ParamLayout) -> ParamLayout:
    return replace(lay, opt_shard_size=0, opt_shard_step=0)


def with_owner_split(
    name: str, per: Mapping[int, ParamLayout], layouts: Mapping[str, Mapping[int, ParamLayout]]
) -> dict[int, ParamLayout]:
    """An optimizer state's layouts with its parameter's uneven split where MindSpore omits it.

    MindSpore lists the states of a ``manual_split`` ``Gather`` table (``moment1.table``...)
    with the table's device matrix and tensor map but without ``param_split_shape`` /
    ``indices_offset``, while their shards hold the table's uneven rows (fixtures s18, s19).
    A state whose layout equals its parameter's apart from those two fields takes them.
    """
    owner = state_owner(name, layouts)
    if owner is None:
        return dict(per)
    out = dict(per)
    for stage, lay in per.items():
        own = layouts[owner].get(stage)
        if (own is not None and own.param_split_shape and not lay.param_split_shape
                and (own.dev_matrix, own.tensor_map) == (lay.dev_matrix, lay.tensor_map)):
            out[stage] = replace(lay, param_split_shape=own.param_split_shape, indices_offset=own.indices_offset)
    return out


def folded(per: Mapping[int, ParamLayout], shape: tuple[int, ...], name: str) -> dict[int, ParamLayout]:
    """Every stage's layout for the real ``shape`` (JSON expanded layouts folded)."""
    return {s: fold_layout(lay, shape, param=name) for s, lay in per.items()}
