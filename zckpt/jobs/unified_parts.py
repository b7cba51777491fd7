"""The plan of a unified safetensors directory: which entry goes to which part, under which name.

MindSpore's ``unified_safetensors`` spreads the parameters over ``ceil(total / 3 GiB)``
parts (at most one per parameter), each to the part with the fewest bytes so far, largest
first; ``choice_func`` renames or drops entries; ``split_dst_file=(k, n)`` gives machine ``k``
its share of the parts. This module decides all of that from the entries' specs alone, so
that the two ways of writing the directory (from the source shards, from a zckpt store:
:mod:`zckpt.jobs.unified`) lay out the same parts and the same ``param_name_map.json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from zckpt.core.errors import UsageError
from zckpt.formats.strategy import StrategyMap
from zckpt.formats.unified import part_file
from zckpt.plan.entry_layouts import state_owner
from zckpt.plan.values import TensorSpec
from zckpt.write.safetensors_file import no_safetensors_form

PART_BYTES = 3 * 1024**3
"""MindSpore's target size of one part."""

ChoiceFunc = Callable[[str], "bool | str"]

Names = tuple[tuple[str, str], ...]
"""Entries of one file as ``(source name, name in the file)``."""


def split_weights(sizes: Sequence[tuple[str, int]], groups: int) -> list[list[str]]:
    """MindSpore's ``_split_weight_dict``: largest first, each to the lightest group so far."""
    out: list[list[str]] = [[] for _ in range(groups)]
    total = [0] * groups
    for name, size in sorted(sizes, key=lambda t: -t[1]):
        i = total.index(min(total))
        out[i].append(name)
        total[i] += size
    return out


def machine_share(count: int, split_dst_file: tuple[int, int]) -> range:
    """The part indices machine ``k`` of ``n`` writes (MindSpore's split of ``count`` parts)."""
    k, n = split_dst_file
    avg, rem = divmod(count, n)
    start = avg * (k - 1) + min(k - 1, rem)
    return range(start, start + avg + (1 if k <= rem else 0))


def check_split(split_dst_file: object) -> tuple[int, int] | tuple[()]:
    """``split_dst_file`` as ``()`` or ``(k, n)`` with ``1 <= k <= n``, else refused."""
    if split_dst_file == () or split_dst_file is None:
        return ()
    ok = (isinstance(split_dst_file, (tuple, list)) and len(split_dst_file) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in split_dst_file)
          and 1 <= split_dst_file[0] <= split_dst_file[1])
    if not ok:
        raise UsageError(f"split_dst_file must be () or (k, n) with 1 <= k <= n, got {split_dst_file!r}")
    return (int(split_dst_file[0]), int(split_dst_file[1]))  # type: ignore[index]


def renamed(name: str, choice_func: ChoiceFunc | None) -> str | None:
    """The name ``choice_func`` gives an entry: ``None`` to leave it out."""
    if choice_func is None:
        return name
    out = choice_func(name)
    if isinstance(out, bool):
        return name if out else None
    if isinstance(out, str):
        return out
    raise UsageError(f"For 'unified_safetensors', the return value type of the function 'choice_func' must be bool "
                     f"or str, but got {type(out)}.", param=name)


def is_parameter(t: TensorSpec, strategy: StrategyMap | None) -> bool:
    """A parameter goes to a part: listed by the strategy, or an optimizer state of a listed
    one; without a strategy, any entry of more than one element."""
    if strategy is None:
        return math.prod(t.shape) > 1
    return t.name in strategy.layouts or state_owner(t.name, strategy.layouts) is not None


@dataclass(frozen=True)
class Part:
    """One file of the directory: its name and entries."""

    file: str
    names: Names


@dataclass(frozen=True)
class UnifiedPlan:
    """What one machine writes of a unified directory."""

    parts: tuple[Part, ...]
    """This machine's share of the parts."""
    in_parts: frozenset[str]
    """Source names of every part's entries (all machines')."""
    hyper: Names
    """The whole tensors no part holds (the hyper-parameters, when no rank 0 file gives them)."""
    strings: Names
    """The string entries (into ``hyper_param.safetensors``'s metadata, likewise)."""
    weight_map: dict[str, str]
    """``param_name_map.json``'s ``weight_map``: each part entry's name to its part's file."""
    total_size: int
    first_machine: bool
    """This machine also writes ``param_name_map.json`` and ``hyper_param.safetensors``."""

    def name_map(self) -> bytes:
        """``param_name_map.json`` as MindSpore writes it (indent 4)."""
        doc = {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}
        return json.dumps(doc, indent=4).encode("utf-8")


def plan_unified(specs: Iterable[TensorSpec], strategy: StrategyMap | None, *, choice_func: ChoiceFunc | None,
                 split_dst_file: tuple[int, int] | tuple[()], part_bytes: int) -> UnifiedPlan:
    """The parts of ``specs`` (in the order the sources list them: ties in size keep it) as
    MindSpore splits them; ``accu_grads.*`` are never merged into a part. A MapParameter
    that would be written is refused by name (safetensors has no form for it)."""
    params: list[tuple[str, str, int]] = []
    hyper: list[tuple[str, str]] = []
    strings: list[tuple[str, str]] = []
    for t in specs:
        if t.name.startswith("accu_grads"):
            continue
        out = renamed(t.name, choice_func)
        if out is None:
            continue
        if t.kind == "str":
            strings.append((t.name, out))
        elif t.kind != "tensor":
            raise no_safetensors_form(t.name, error=UsageError)
        elif is_parameter(t, strategy):
            params.append((t.name, out, t.nbytes))
        else:
            hyper.append((t.name, out))
    count = min(max(1, math.ceil(sum(p[2] for p in params) / part_bytes)), len(params)) if params else 0
    groups = split_weights([(p[0], p[2]) for p in params], count) if count else []
    rename = {p[0]: p[1] for p in params}
    share = machine_share(count, split_dst_file) if split_dst_file else range(count)
    return UnifiedPlan(
        parts=tuple(Part(part_file(i), tuple((n, rename[n]) for n in groups[i])) for i in share),
        in_parts=frozenset(rename),
        hyper=tuple(hyper),
        strings=tuple(strings),
        weight_map={rename[n]: part_file(i) for i, g in enumerate(groups) for n in g},
        total_size=sum(p[2] for p in params),
        first_machine=not split_dst_file or split_dst_file[0] == 1,
    )
