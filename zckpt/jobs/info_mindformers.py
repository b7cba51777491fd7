"""``zckpt info`` on a MindFormers Checkpoint 2.0 directory (:mod:`zckpt.formats.mindformers`).

Why a module of its own: reading such a directory stops at the first thing it refuses, while a
user deciding what to do with a checkpoint needs the whole picture: which iteration is read and
why, ``common.json``, which files each rank saved (and whether the save is redundancy-free, with
fewer files than ranks), every parameter with its layout and the kind of file that holds it, and
beside that every refusal reading would meet (interleaved layouts, chunks the layout cannot
produce, files that disagree with ``metadata.json``), each named by file and parameter. Every
part is checked by the reading code itself (one check, two uses); its error is collected here
instead of raised. The text is :mod:`zckpt.jobs.info`'s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from zckpt.core.errors import ZckptError
from zckpt.formats.entries import EntryInfo
from zckpt.formats.mindformers import (
    COMMON,
    ITER_DIR,
    METADATA,
    RANK_FILE,
    TRACKER,
    Checked,
    MindFormersRankReader,
    common_entries,
    is_single_card,
    iteration_dirs,
    parameter_layout,
    rank_file_sets,
    read_metadata,
    storage_param,
    storage_problems,
    tracked_iteration,
)
from zckpt.formats.safetensors import SafetensorsReader
from zckpt.formats.strategy import ParamLayout

T = TypeVar("T")


def is_mindformers_dir(path: Path) -> bool:
    """A checkpoint directory MindFormers saves into (iterations, the tracker) or one iteration."""
    if (path / TRACKER).is_file() or iteration_dirs(path):
        return True
    files = any(RANK_FILE.match(p.name) for p in path.iterdir())
    return files and ((path / METADATA).is_file() or ITER_DIR.match(path.name) is not None)


class _Refusals:
    """What reading would refuse, collected: each a ZckptError's file, parameter and message."""

    def __init__(self) -> None:
        self.found: list[dict[str, str | None]] = []

    def attempt(self, what: Callable[[], T]) -> T | None:
        """``what()``, or ``None`` with its refusal recorded."""
        try:
            return what()
        except ZckptError as err:
            self.found.append({"file": err.path, "param": err.param, "reason": err.message})
            return None


def survey(path: Path) -> dict[str, Any]:
    """What ``path`` (a checkpoint directory or one iteration of it) holds, and what reading
    it would refuse (JSON-able)."""
    refused = _Refusals()
    iters = iteration_dirs(path)
    root = path if iters or (path / TRACKER).is_file() else path.parent
    tracker = _tracker(root, refused if root == path else _Refusals())
    named = tracker["iteration"] if tracker else None
    iteration = iters[max(iters) if named is None else named] if iters else (None if root == path else path)
    doc: dict[str, Any] = {"type": "mindformers", "path": str(path), "iteration": None, "iteration_dir": None,
                           "iterations": sorted(iteration_dirs(root)), "tracker": tracker, "common": None,
                           "ranks": {}, "files": {}, "job_ranks": 0, "saving": None, "parameters": [],
                           "not_in_metadata": [], "refused": refused.found}
    if iteration is None:
        return doc
    m = ITER_DIR.match(iteration.name)
    doc["iteration"], doc["iteration_dir"] = (int(m.group(1)) if m else None), str(iteration)
    doc["common"] = _common(iteration, refused)
    meta = refused.attempt(partial(read_metadata, iteration)) if (iteration / METADATA).is_file() else None
    if meta is None and not (iteration / METADATA).exists() and not is_single_card(iteration):
        refused.found.append({"file": str(iteration), "param": None,
                              "reason": f"no {METADATA}, and the files are not a single card's save"})
    doc["files"] = _file_counts(iteration)
    sets = refused.attempt(partial(rank_file_sets, iteration)) or {}
    checked: dict[str, Checked] = {}
    if meta is not None:
        doc["parameters"] = _parameters(iteration, meta, refused, checked)
    elif is_single_card(iteration):
        doc["parameters"] = _whole(sets, refused)
    if meta is not None:
        for problem in storage_problems(meta, checked, iteration / METADATA):
            refused.found.append({"file": problem.path, "param": problem.param, "reason": problem.message})
    doc["job_ranks"] = _job_ranks(meta) or 1
    doc["saving"] = _saving(meta, doc["job_ranks"], doc["files"])
    known = {p["name"] for p in doc["parameters"]} | set(doc["common"] or ())
    extra: set[str] = set()
    for r, files in sets.items():
        held = refused.attempt(partial(_entries, files[0])) or []
        doc["ranks"][str(r)] = {"files": [p.name for p in files], "bytes": sum(p.stat().st_size for p in files),
                                "entries": len(held)}
        extra.update(n for n in held if n not in known)
    doc["not_in_metadata"] = sorted(extra)
    return doc


def _whole(sets: dict[int, tuple[Path, ...]], refused: _Refusals) -> list[dict[str, Any]]:
    """A single card's tensors, from its files' headers: each held whole."""
    out = []
    for f in (f for files in sets.values() for f in files):
        kind = m.group("kind") if (m := RANK_FILE.match(f.name)) else None
        for e in refused.attempt(partial(_tensors, f)) or []:
            out.append({"name": e.name, "file": kind, "dtype": e.ms_type, "global_shape": list(e.shape),
                        "layout": {"kind": "whole"}, "chunks": 1, "refused": None})
    return out


def _tensors(file: Path) -> list[EntryInfo]:
    with SafetensorsReader(file, verify_crc=False) as r:
        return [e for e in r.entries.values() if e.kind == "tensor"]


def _tracker(root: Path, refused: _Refusals) -> dict[str, Any] | None:
    """What ``latest_checkpointed_iteration.txt`` says, and the iteration it names if it does."""
    where = root / TRACKER
    if not where.is_file():
        return None
    text = where.read_bytes()[:200].decode("utf-8", "replace").strip()
    return {"file": str(where), "text": text, "iteration": refused.attempt(partial(tracked_iteration, root))}


def _common(iteration: Path, refused: _Refusals) -> dict[str, Any] | None:
    """``common.json`` as written (``null`` values too), after the checks reading makes."""
    where = iteration / COMMON
    if not where.is_file() or refused.attempt(partial(common_entries, iteration)) is None:
        return None
    doc = json.loads(where.read_text(encoding="utf-8"))
    return doc if isinstance(doc, dict) else None


def _file_counts(iteration: Path) -> dict[str, dict[str, int]]:
    """Per kind (model, opt): the files present, and the count their names give."""
    out: dict[str, dict[str, int]] = {}
    for p in iteration.iterdir():
        if m := RANK_FILE.match(p.name):
            kind = out.setdefault(m.group("kind"), {"present": 0, "named_total": 0})
            kind["present"] += 1
            kind["named_total"] = max(kind["named_total"], int(m.group("total")))
    return dict(sorted(out.items()))


def _entries(first: Path) -> list[str]:
    """A rank's entries as reading takes them (every file's header checked against metadata.json)."""
    with MindFormersRankReader(first, verify_crc=False) as r:
        return list(r.entries)


def _parameters(iteration: Path, meta: dict[str, Any], refused: _Refusals,
                checked: dict[str, Checked]) -> list[dict[str, Any]]:
    """Each parameter of ``metadata.json`` as reading checks it (those it accepts also into ``checked``)."""
    kinds: dict[str, set[str]] = {}
    for key, records in meta.get("storage_data", {}).items():
        for rec in records:
            if m := RANK_FILE.match(str(rec.get("file_name", "")) if isinstance(rec, dict) else ""):
                kinds.setdefault(storage_param(key), set()).add(m.group("kind"))
    out = []
    for name, entry in meta["state_dict_metadata"].items():
        found = refused.attempt(partial(parameter_layout, name, entry, iteration / METADATA))
        shape, staged = found or ((), None)
        why = refused.found[-1]["reason"] if found is None else None
        if found is not None:
            checked[name] = found
        e = entry if isinstance(entry, dict) else {}
        props, chunks = e.get("properties"), e.get("chunk")
        out.append({"name": name, "file": "+".join(sorted(kinds.get(name, ()))) or None,
                    "dtype": props.get("dtype") if isinstance(props, dict) else None,
                    "global_shape": list(shape) if why is None else e.get("global_shape"),
                    "layout": _layout_doc(e.get("layout"), staged, why),
                    "chunks": len(chunks) if isinstance(chunks, list) else None, "refused": why})
    return out


def _layout_doc(lay: Any, staged: tuple[int, ParamLayout] | None, why: str | None) -> dict[str, Any]:
    """The layout as metadata.json gives it, and its kind: ``whole`` (no layout, or no dimension
    cut), ``split``, or ``split, dim 0 folded`` (several device axes on the first dimension: how
    MindSpore writes an optimizer shard into a layout; a split over several axes reads the same)."""
    doc: dict[str, Any] = {"kind": "whole"}
    if isinstance(lay, dict):
        doc.update({k: lay.get(k) for k in ("device_matrix", "tensor_map", "rank_list", "interleaved_parallel")})
    if why is not None:
        doc["kind"] = "refused"
    elif staged is not None:
        stage, layout = staged
        dev = layout.dev_matrix
        pieces = [math.prod(dev[len(dev) - 1 - a] for a in axes) for axes in layout.tensor_map]
        folded = bool(layout.tensor_map) and len(layout.tensor_map[0]) > 1
        doc.update(kind="whole" if math.prod(pieces) == 1 else "split, dim 0 folded" if folded else "split",
                   stage=stage, pieces=pieces)
    return doc


def _job_ranks(meta: dict[str, Any] | None) -> int:
    """The ranks of the job that saved: every rank a layout's ``rank_list`` or a piece's
    ``rank_group`` / ``storage_rank`` names."""
    ranks: set[Any] = set()
    for entry in (meta or {}).get("state_dict_metadata", {}).values():
        lay = entry.get("layout") if isinstance(entry, dict) else None
        if isinstance(lay, dict) and isinstance(lay.get("rank_list"), list):
            ranks.update(lay["rank_list"])
    for records in (meta or {}).get("storage_data", {}).values():
        for rec in (r for r in records if isinstance(r, dict)):
            group = rec.get("rank_group")
            ranks.update([*(group if isinstance(group, list) else []), rec.get("storage_rank")])
    return len({r for r in ranks if isinstance(r, int)})


def _saving(meta: dict[str, Any] | None, job_ranks: int, files: dict[str, dict[str, int]]) -> str:
    """How the pieces were saved: by every rank that holds them, or once each (redundancy-free)."""
    counts = ", ".join(f"{k['present']} {kind}" for kind, k in files.items())
    if meta is None:
        return f"a single card's save (no {METADATA}: whole tensors); files {counts}"
    shared = once = 0
    for records in meta.get("storage_data", {}).values():
        groups = [rec.get("rank_group") for rec in records if isinstance(rec, dict)]
        held_by = max((len(g) for g in groups if isinstance(g, list)), default=1)
        shared += held_by > 1
        once += held_by > 1 and len(records) < held_by
    if once:
        how = f"redundancy-free: {once} of the {shared} pieces several ranks hold saved once"
    elif shared:
        how = "every rank saves the pieces it holds"
    else:
        how = "no piece is held by two ranks (nothing redundant to leave out)"
    fewer = any(k["named_total"] < job_ranks for k in files.values())
    return f"{how}; files {counts} for {job_ranks} ranks" + (": fewer files than ranks" if fewer else "")
