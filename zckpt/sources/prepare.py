"""Preparing a job from its source shards: found, indexed and planned, before any byte moves.

Ingest, transform, loading, verify and the dry run all begin the same way: the strategy is
loaded, the rank files are found, those outside the strategy's stages are set aside (or
refused when they are plainly more ranks of the same stage), every index is read once and
the ingest plan is made. That is this module, and nothing that needs a store or an engine:
where work runs and what is written are the jobs' business. It is in two steps
(:func:`find_sources`, then :func:`plan_sources`) so that a job may start work that waits for
nothing but the files found (ingest's helper process) while their indexes are read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypedDict, Unpack

from zckpt.core.errors import SourceError, UsageError, ZckptError
from zckpt.formats.entries import EntryInfo
from zckpt.formats.strategy import StrategyMap
from zckpt.io import remote
from zckpt.io.read_ahead import Order
from zckpt.plan.ingest_plan import build_ingest_plan
from zckpt.plan.values import IngestPlan
from zckpt.sources.discovery import SourceFile, SourceSet, check_rank_map, discover_sources, open_source
from zckpt.sources.indexes import IndexReading
from zckpt.sources.layouts import implied_strategy
from zckpt.sources.partial_inputs import left_behind, partial_record, refuse_stageless
from zckpt.sources.strategies import StrategyArg, load_strategy
from zckpt.sources.unsharded import SameModel, check_same_model

MiB = 1024 * 1024


def resolve_sources(
    src: str | Path | Mapping[int, str | Path], storage_options: remote.StorageOptions = None,
    file_suffix: str | None = None,
) -> SourceSet:
    if isinstance(src, Mapping):
        if file_suffix is not None:
            raise UsageError("file_suffix chooses files in rank directories; it does not apply to a {rank: file} map")
        return SourceSet(check_rank_map(src, storage_options))
    return discover_sources(src, storage_options, file_suffix)


def entry_filter(choice_func: Callable[[str], bool] | None) -> Callable[[str], bool] | None:
    """MindSpore's ``choice_func`` as a predicate that insists on a bool (a str would rename the
    entry in MindSpore's ``unified_safetensors``, which ingest does not do)."""
    if choice_func is None:
        return None
    if not callable(choice_func):
        raise TypeError(f"The choice_func should be callable, but got {type(choice_func).__name__}.")

    def keep(name: str) -> bool:
        out = choice_func(name)
        if not isinstance(out, bool):
            raise UsageError(f"choice_func must return a bool, got {type(out).__name__} (renaming entries is not "
                             "supported at ingest)", param=name)
        return out

    return keep


def relevant_ranks(files: Mapping[int, SourceFile], smap: StrategyMap | None) -> dict[int, SourceFile]:
    """The source files the strategy describes: rank 0 alone without a strategy (the full
    model), else the ranks of the pipeline stages the strategy lists (a single stage's
    strategy file converts that stage only, as in MindSpore's per-stage conversion)."""
    if smap is None:
        return {r: p for r, p in files.items() if r == 0}
    stage_dev = smap.stage_device_num()
    stages = set(smap.stages)
    return {r: p for r, p in files.items() if r // stage_dev in stages}


def _refuse_foreign_strategy(
    smap: StrategyMap,
    found: Mapping[int, SourceFile],
    files: Mapping[int, SourceFile],
    indexes: Mapping[int, Mapping[str, object]],
    storage_options: remote.StorageOptions = None,
) -> None:
    """Refuse a strategy that describes fewer devices than the job that wrote the files.

    Rank files beyond the strategy's stages are normally another pipeline stage's (other
    parameters). When the first of them holds every parameter the strategy lists, they are
    more ranks of the same stage: reading only the described ranks as the whole job would
    make every global shape wrong.
    """
    ignored = sorted(set(found) - set(files))
    if not ignored or not files:
        return
    listed = set(smap.layouts) & set(indexes[min(files)])
    if not listed:
        return
    with open_source(found[ignored[0]], storage_options, verify_crc=False) as r:
        held = set(r.entries)
    if listed <= held:
        raise SourceError(
            f"the strategy describes {smap.device_num()} device(s), but rank file(s) {ignored} beyond them hold "
            f"the same {len(listed)} parameter(s): the strategy belongs to a smaller job than these shards",
            path=", ".join(smap.sources) or None,
        )


@dataclass(frozen=True)
class PreparedIngest:
    """A plan with what was decided about the sources on the way, for the report."""

    plan: IngestPlan
    strategy: StrategyMap | None
    sources: SourceSet
    same_model: SameModel
    indexes: Mapping[int, Mapping[str, EntryInfo]] = field(default_factory=dict)
    """The index of every source file planned from (where each entry's payload lies), so
    that readers of the shards need not parse them again."""


@dataclass(frozen=True)
class FoundSources:
    """The first step of :func:`prepare_ingest`: the strategy and the rank files to plan
    from, found and checked, their indexes not read yet."""

    strategy: StrategyMap | None
    sources: SourceSet
    files: Mapping[int, SourceFile]
    """The rank files the strategy describes (:func:`relevant_ranks`)."""
    same_model: SameModel
    keep: Callable[[str], bool] | None
    require_complete: bool
    storage_options: remote.StorageOptions = None


def find_sources(
    src: str | Path | Mapping[int, str | Path],
    strategy: StrategyArg,
    *,
    require_complete: bool = True,
    storage_options: remote.StorageOptions = None,
    file_suffix: str | None = None,
    choice_func: Callable[[str], bool] | None = None,
    block_bytes: int = 64 * MiB,
) -> FoundSources:
    """The strategy and the rank files it describes. Without a strategy, rank files besides
    rank 0's must be the same model byte for byte (:mod:`zckpt.sources.unsharded`), else this refuses."""
    smap = load_strategy(strategy, storage_options)
    if smap is None:
        smap = implied_strategy(src)  # a MindFormers iteration records its own
    sources = resolve_sources(src, storage_options, file_suffix)
    found = sources.files
    keep = entry_filter(choice_func)
    same = SameModel((), 0)
    if smap is None:
        same = check_same_model(found, storage_options, block_bytes=block_bytes, keep=keep)
    files = relevant_ranks(found, smap)
    if smap is not None:
        refuse_stageless(smap, found, files, require_complete=require_complete)
    return FoundSources(smap, sources, files, same, keep, require_complete, storage_options)


Settle = Callable[[], "PreparedIngest | None"]
"""The second value of :func:`plan_sources_early`."""


def plan_sources(
    found: FoundSources, *, verify_crc: bool = True, while_reading: Callable[[], object] | None = None,
    order: Order = "starts",
) -> PreparedIngest:
    """The second step of :func:`prepare_ingest`: every index read (``order``: see
    :class:`~zckpt.sources.indexes.IndexReading`), the plan made (:func:`plan_sources_early`,
    settled)."""
    prepared, settle = plan_sources_early(found, verify_crc=verify_crc, while_reading=while_reading, order=order)
    return settle() or prepared


def plan_sources_early(
    found: FoundSources, *, verify_crc: bool = True, while_reading: Callable[[], object] | None = None,
    order: Order = "starts",
) -> tuple[PreparedIngest, Settle]:
    """:func:`plan_sources` that returns as soon as there is a plan. Where the files are read
    ahead before they are walked, that plan is made from the indexes expected of them (each
    like the first file of its pipeline stage), while the disk reads; the caller may prepare
    its work from it meanwhile. The second value then reads the indexes to the end and answers
    ``None`` where every file holds the expected index, else the plan made from the files
    (the first one must not be used then). Elsewhere the plan is made from the files and the
    second value answers ``None``."""
    smap = found.strategy
    stage_dev = smap.stage_device_num() if smap is not None else 0
    reading = IndexReading(found.files, verify_crc=verify_crc, storage_options=found.storage_options, order=order,
                           group=lambda rank: rank // stage_dev if stage_dev else None)
    reading.start(while_reading)
    early = None
    if reading.guess is not None:
        with contextlib.suppress(ZckptError):  # a plan refused on a guess is made again from the files
            early = _plan(found, reading.guess)
    if early is None:
        return _plan(found, reading.finish()), lambda: None

    def settle() -> PreparedIngest | None:
        indexes = reading.finish()
        return None if reading.as_guessed() else _plan(found, indexes)

    return early, settle


def _plan(found: FoundSources, indexes: dict[int, dict[str, EntryInfo]]) -> PreparedIngest:
    smap, files, keep, so = found.strategy, found.files, found.keep, found.storage_options
    left_out: set[str] = set()
    if keep is not None:
        left_out = {n for idx in indexes.values() for n in idx if not keep(n)}
        indexes = {r: {n: e for n, e in idx.items() if n not in left_out} for r, idx in indexes.items()}
    every = found.sources.files
    if smap is not None:
        _refuse_foreign_strategy(smap, every, files, indexes, so)
    plan = build_ingest_plan(
        indexes, {r: str(p) for r, p in files.items()}, smap, require_complete=found.require_complete
    )
    behind = (left_behind(smap, every, files, [*(t.name for t in plan.tensors), *left_out], so)
              if smap is not None else None)
    plan = replace(plan, ignored_ranks=tuple(sorted(set(every) - set(files) - set(found.same_model.ranks))),
                   left_behind=behind.to_json() if behind is not None else {}, left_out=tuple(sorted(left_out)))
    return PreparedIngest(plan, smap, found.sources, found.same_model, indexes)


class FindArgs(TypedDict, total=False):
    """The keywords of :func:`find_sources`, which :func:`prepare_ingest` passes on."""

    require_complete: bool
    storage_options: remote.StorageOptions
    file_suffix: str | None
    choice_func: Callable[[str], bool] | None
    block_bytes: int


def prepare_ingest(
    src: str | Path | Mapping[int, str | Path], strategy: StrategyArg, *, verify_crc: bool = True,
    order: Order = "starts", **find: Unpack[FindArgs],
) -> PreparedIngest:
    """Find the sources and plan the ingest (:func:`find_sources`, then :func:`plan_sources`)."""
    return plan_sources(find_sources(src, strategy, **find), verify_crc=verify_crc, order=order)


@dataclass(frozen=True)
class StoreSource:
    """What a store records of its sources beside their tensors: the value of each string
    entry, the byte size of each MapParameter (its one opaque array) and the provenance
    record (files, sizes, strategy, stages) that is part of the store's fingerprint."""

    strings: Mapping[str, str]
    map_sizes: Mapping[str, int]
    record: Mapping[str, Any]


def store_source(plan: IngestPlan, smap: StrategyMap | None,
                 storage_options: remote.StorageOptions = None) -> StoreSource:
    """The :class:`StoreSource` of a plan (string and MapParameter entries are read here)."""
    strings: dict[str, str] = {}
    for w in [x for x in plan.writes if plan.kind_of(x.name) == "str"]:
        with open_source(plan.rank_files[w.rank], storage_options, verify_crc=False) as r:
            strings[w.name] = r.string(w.name)
    map_sizes: dict[str, int] = {}
    for mw in plan.writes:
        if plan.kind_of(mw.name) == "map":
            with open_source(plan.rank_files[mw.rank], storage_options, verify_crc=False) as r:
                map_sizes[mw.name] = len(r.map_bytes(mw.name))
    return StoreSource(strings, map_sizes, _source_record(plan, smap, storage_options))


def _source_record(
    plan: IngestPlan, smap: StrategyMap | None, storage_options: remote.StorageOptions = None
) -> dict[str, Any]:
    files = {}
    for rank, p in plan.rank_files.items():
        if remote.is_remote(p):
            files[str(rank)] = {"path": p, "size": remote.size(remote.locate(p, storage_options, SourceError),
                                                               SourceError)}
            continue
        path = Path(p)
        files[str(rank)] = {"path": str(path.resolve()), "size": path.stat().st_size}
    return {
        "strategy_files": list(smap.sources) if smap is not None else None,
        "stage_device_num": plan.stage_device_num,
        "stages": list(smap.stages) if smap is not None else [0],
        "rank_files": files,
    } | partial_record(plan)

