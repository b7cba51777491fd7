"""Inputs that hold less than the job they claim to be: refused, or recorded, by name.

A pipeline job saves each stage's parameters on that stage's ranks only. A strategy that
describes fewer stages than the rank files hold (a strategy directory missing one stage's
files, a merged file with one stage's entries removed) would silently convert a part of the
model; a strategy naming only stages that have no rank file would convert nothing. Both are
cheap to see before any byte is written:

* :func:`refuse_stageless` refuses a strategy whose stages have no rank file at all, or
  (when the store must be complete) one of whose stages has none;
* :func:`left_behind` names the stages, ranks and parameters of rank files outside the
  strategy's stages, so that ingest reports (and the store records) what it did not take,
  as MindSpore's per-stage conversion does on purpose;
* :func:`refuse_unsupplied` fails an export or a transform whose destination strategy
  lists parameters the source cannot supply, naming them, instead of writing files
  without them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zckpt.core.errors import SourceError
from zckpt.formats.strategy import StrategyMap
from zckpt.io import remote
from zckpt.plan.entry_layouts import STATE_PREFIXES
from zckpt.plan.values import IngestPlan
from zckpt.sources.discovery import SourceFile, open_source

SHOWN = 12
"""Names listed in a message before ``and N more``."""


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _ranks_of(stage: int, stage_dev: int) -> str:
    return f"{stage * stage_dev}-{(stage + 1) * stage_dev - 1}" if stage_dev > 1 else str(stage * stage_dev)


def refuse_stageless(
    smap: StrategyMap, found: Mapping[int, SourceFile], files: Mapping[int, SourceFile], *, require_complete: bool
) -> None:
    """Refuse a strategy none of whose pipeline stages has a rank file (nothing would be
    converted: an empty store, files with 0 tensors), and, when the result must be complete,
    one that lists a stage with no rank file at all (its parameters would be absent)."""
    stage_dev = smap.stage_device_num()
    where = ", ".join(smap.sources) or None
    if not files:
        stages = list(smap.stages)
        raise SourceError(
            f"the strategy lists pipeline stage(s) {stages} only (source ranks "
            f"{', '.join(_ranks_of(s, stage_dev) for s in stages)} at {stage_dev} device(s) per stage), but none "
            f"of those rank files exists; the source holds ranks {sorted(found)}: the strategy belongs to other "
            "ranks than these shards", path=where)
    if not require_complete:
        return
    held = {r // stage_dev for r in files}
    for stage in smap.stages:
        if stage in held:
            continue
        params = sorted(n for n, per in smap.layouts.items() if stage in per)
        raise SourceError(
            f"the strategy lists pipeline stage {stage} (source ranks {_ranks_of(stage, stage_dev)}), but none of "
            f"its rank files exists: its {len(params)} parameter(s) {_names(params)} cannot be read",
            path=where)


@dataclass(frozen=True)
class LeftBehind:
    """Rank files outside the strategy's stages, and what they hold that is not converted."""

    stages: tuple[int, ...]
    ranks: tuple[int, ...]
    params: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"stages": list(self.stages), "ranks": list(self.ranks), "params": list(self.params)}



def left_behind(
    smap: StrategyMap,
    found: Mapping[int, SourceFile],
    files: Mapping[int, SourceFile],
    taken: Iterable[str],
    storage_options: remote.StorageOptions = None,
) -> LeftBehind | None:
    """What the rank files outside the strategy's stages hold that the plan does not take
    (one header per left-out stage is read: a stage's ranks hold the same names)."""
    ignored = sorted(set(found) - set(files))
    if not ignored:
        return None
    stage_dev = smap.stage_device_num()
    have = set(taken)
    firsts: dict[int, int] = {}
    for r in ignored:
        firsts.setdefault(r // stage_dev, r)
    params: dict[str, None] = {}
    for r in firsts.values():
        with open_source(found[r], storage_options, verify_crc=False) as reader:
            params.update((n, None) for n, e in reader.entries.items() if n not in have and e.kind == "tensor")
    return LeftBehind(tuple(sorted(firsts)), tuple(ignored), tuple(params))


def partial_record(plan: IngestPlan) -> dict[str, Any]:
    """What a store's source record adds about a partial source: the rank files left behind
    and the entries left out, only when there are any (other stores keep their fingerprint)."""
    out: dict[str, Any] = {}
    if plan.left_behind:
        out["left_behind"] = dict(plan.left_behind)
    if plan.left_out:
        out["left_out"] = list(plan.left_out)
    return out


def partial_line(record: Mapping[str, Any]) -> str:
    """A :class:`LeftBehind` record in words, for the ingest report."""
    params = list(record.get("params", []))
    return (f"partial: rank file(s) {record.get('ranks')} (pipeline stage(s) {record.get('stages')}, outside the "
            f"strategy's stages) hold {len(params)} parameter(s) not ingested: {_names(params)}; an export whose "
            "destination lists them will refuse")


def needed_params(dst: StrategyMap | None, ranks: Iterable[int]) -> list[str]:
    """The parameters the destination strategy lists for the pipeline stages of ``ranks``."""
    if dst is None:
        return []
    stage_dev = dst.stage_device_num()
    stages = {r // stage_dev for r in ranks}
    return [n for n, per in dst.layouts.items() if stages & set(per)]


def unsupplied(needed: Iterable[str], held: Iterable[str], left_out: Iterable[str] = ()) -> list[str]:
    """The needed names the source does not hold, apart from those a source may lack
    whole: optimizer and gradient-accumulation states of a family (``moments.``,
    ``accu_grads.``, ...) of which the source holds none (a checkpoint saved without that
    optimizer, or without pipeline accumulation), and entries the user left out
    (``choice_func``). A source that holds some states of a family must hold them all."""
    have = set(held)
    families = {p for p in STATE_PREFIXES for n in have if n.startswith(p)}
    skip = set(left_out)
    out = []
    for name in needed:
        if name in have or name in skip:
            continue
        family = next((p for p in STATE_PREFIXES if name.startswith(p)), None)
        if family is not None and family not in families:
            continue
        out.append(name)
    return sorted(out)


def refuse_unsupplied(
    needed: Iterable[str], held: Iterable[str], *, left_out: Iterable[str] = (),
    behind: Mapping[str, Any] | None = None, source: str | None = None, dst: StrategyMap | None = None,
) -> None:
    """Fail, naming them, when the destination strategy lists parameters the source lacks."""
    missing = unsupplied(needed, held, left_out)
    if not missing:
        return
    why = ""
    if behind:
        why = (f"; the source was ingested from its strategy's pipeline stages only: rank file(s) "
               f"{behind.get('ranks')} (stage(s) {behind.get('stages')}) were not")
    where = ", ".join(dst.sources) if dst is not None and dst.sources else None
    raise SourceError(
        f"the destination strategy lists {len(missing)} parameter(s) that {source or 'the source'} does not hold: "
        f"{_names(missing)}{why}; the files written would lack them (give the source strategy of every pipeline "
        "stage, or a destination strategy without them)", path=where)
