"""``zckpt verify``'s file checks: the source shards and an export's rank files against the store.

* **sources** -- every source shard equals its box of the store, byte for byte (the boxes
  come from the same plan ingest uses), replicas included. The store's digests are not keyed
  (an edit can recompute them); this comparison is what finds such a consistent forgery
  (``zckpt verify STORE --sources SRC_DIR``).
* **exports** -- every destination rank file (``.ckpt``, ``.safetensors`` or a split
  safetensors index) holds exactly the entries the export plan gives it, in order (unless
  ``any_order``; safetensors files have no order), with the store's dtype, the slice's
  shape and the slice's bytes.

Both read a file through its :class:`~zckpt.formats.shard_reader.ShardReader` and compare
each entry with its region of the store band by band (:func:`compare_tensor`); the store's
own consistency is :mod:`zckpt.jobs.verify_store`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from zckpt.core.errors import ZckptError
from zckpt.core.layout import Box
from zckpt.formats.opener import open_shard
from zckpt.formats.shard_reader import INDEX_SUFFIX, ShardReader
from zckpt.formats.strategy import StrategyMap
from zckpt.jobs.export_job import ExportOptions, output_jobs
from zckpt.jobs.verify_report import MiB, VerifyReport
from zckpt.plan.export_plan import build_export_plan
from zckpt.sources.prepare import prepare_ingest
from zckpt.sources.strategies import load_strategy
from zckpt.store.manifest import EntryRecord
from zckpt.store.store import Store


def first_difference(a: np.ndarray, b: np.ndarray) -> tuple[int, ...] | None:
    """Index of the first element whose bytes differ (``None``: identical bytes)."""
    if a.shape != b.shape or a.dtype.itemsize != b.dtype.itemsize:
        return ()
    ua = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    ub = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    diff = np.flatnonzero(ua != ub)
    if not diff.size:
        return None
    flat = int(diff[0]) // max(1, a.dtype.itemsize)
    return tuple(int(i) for i in np.unravel_index(flat, a.shape)) if a.shape else ()


def compare_tensor(
    reader: ShardReader, name: str, arr: Any, box: Box, block_bytes: int
) -> tuple[int, tuple[int, ...] | None]:
    """Compare a file's tensor with the store's region ``box``, band by band.

    Returns the bytes compared and the global index of the first differing element
    (``None`` when equal).
    """
    if box.ndim == 0:
        mine = reader.array(name)
        return mine.nbytes, (None if first_difference(mine, np.asarray(arr[()])) is None else ())
    if box.size == 0:
        return 0, None
    rest = box.slices()[1:]
    done = 0
    for r0, block in reader.row_blocks(name, block_bytes):
        start = box.start[0] + r0
        stored = np.asarray(arr[(slice(start, start + block.shape[0]), *rest)])
        at = first_difference(block, stored)
        done += block.nbytes
        if at is not None:
            if not at:
                return done, tuple(box.start)
            return done, tuple(a + o for a, o in zip(at, (start, *box.start[1:]), strict=True))
    return done, None


def _where(index: tuple[int, ...], box: Box) -> str:
    return f"region {box.to_json()}, first difference at element {list(index)}"


def _compare_entry(
    check: str,
    reader: ShardReader,
    store: Store,
    e: EntryRecord,
    box: Box,
    report: VerifyReport,
    block_bytes: int,
    count: Callable[[int], None],
) -> None:
    """One entry of a file against the store: kind, dtype, shape and bytes."""
    mine = reader.entries.get(e.name)
    if mine is None:
        report.add(check, "entry is missing from the file", file=reader.path, param=e.name)
        return
    if mine.kind != e.kind:
        report.add(check, f"file holds a {mine.kind} entry, the store a {e.kind}", file=reader.path, param=e.name)
        return
    try:
        if e.kind == "str":
            if reader.string(e.name) != e.value:
                report.add(check, "string value differs from the store's", file=reader.path, param=e.name)
            return
        arr = store.array(e.name)
        if e.kind == "map":
            body = reader.map_bytes(e.name)
            count(len(body))
            if body != np.asarray(arr[...]).tobytes():
                report.add(check, "map entry bytes differ from the store's", file=reader.path, param=e.name)
            return
        if mine.ms_type != e.ms_type:
            report.add(check, f"dtype {mine.ms_type} but the store holds {e.ms_type}", file=reader.path,
                       param=e.name)
            return
        if mine.shape != box.shape:
            report.add(check, f"shape {list(mine.shape)} but its region {box.to_json()} of the store has shape "
                              f"{list(box.shape)}", file=reader.path, param=e.name)
            return
        done, at = compare_tensor(reader, e.name, arr, box, block_bytes)
        count(done)
        if at is not None:
            report.add(check, "bytes differ from the store's", file=reader.path, param=e.name,
                       region=_where(at, box))
    except ZckptError as err:
        report.add(check, err.message, file=err.path or reader.path, param=err.param or e.name)


def check_sources(
    store: Store,
    src: str | Path,
    strategy: str | Path | StrategyMap | None,
    report: VerifyReport,
    *,
    block_bytes: int = 64 * MiB,
    file_suffix: str | None = None,
    choice_func: Callable[[str], bool] | None = None,
) -> None:
    """Every source shard (writers and replicas alike) equals its box of the store; the file
    read in a rank directory holding several is recorded in the report."""

    try:
        prepared = prepare_ingest(src, strategy, file_suffix=file_suffix, choice_func=choice_func,
                                  block_bytes=block_bytes)
    except ZckptError as err:
        report.add_error("source", err)
        return
    plan = prepared.plan
    report.source_choices = {r: (str(prepared.sources.files[r]), c.candidates, c.rule)
                             for r, c in prepared.sources.several().items()}
    entries = {e.name: e for e in store.entries()}
    for t in plan.tensors:
        e = entries.get(t.name)
        if e is None:
            report.add("source", "in the source checkpoints but not in the store", file=store.url, param=t.name)
        elif t.kind != e.kind or (t.kind == "tensor" and (t.ms_type, t.shape) != (e.ms_type, e.shape)):
            report.add("source", f"source gives {t.kind} {t.ms_type}{list(t.shape)}, the store holds "
                                 f"{e.kind} {e.ms_type}{list(e.shape)}", file=store.url, param=t.name)
    for name in sorted(set(entries) - {t.name for t in plan.tensors}):
        report.add("source", "in the store but in no source checkpoint", file=store.url, param=name)
    todo: dict[int, list[tuple[str, Box]]] = {}
    for w in plan.writes:
        todo.setdefault(w.rank, []).append((w.name, w.box))
    for c in plan.checks:
        todo.setdefault(c.rank, []).append((c.name, c.box))

    def count(n: int) -> None:
        report.source_bytes += n

    for rank in sorted(todo):
        path = plan.rank_files[rank]
        try:
            with open_shard(path) as reader:
                report.source_files += 1
                for name, box in todo[rank]:
                    e = entries.get(name)
                    if e is not None:
                        _compare_entry("source", reader, store, e, box, report, block_bytes, count)
        except ZckptError as err:
            report.add("source", err.message, file=err.path or path, param=err.param)


def check_export(
    store: Store,
    out_dir: str | Path,
    strategy: str | Path | StrategyMap | None,
    report: VerifyReport,
    *,
    prefix: str = "checkpoint_",
    block_bytes: int = 64 * MiB,
    per_stage: bool | None = None,
    any_order: bool = False,
) -> None:
    """Every destination file holds exactly its plan's entries, in order, with the store's
    bytes. ``per_stage`` checks ``<prefix><r>_part<s>.ckpt`` parts instead of one file per
    rank; ``None`` decides from what the directory holds. A rank saved as safetensors
    (``<prefix><r>.safetensors`` or its split index) is compared the same way, except for
    the order of its entries, which that format does not keep; ``any_order`` accepts
    ``.ckpt`` entries in any order too."""
    try:
        plan = build_export_plan(store.specs(), load_strategy(strategy))
    except ZckptError as err:
        report.add_error("export", err)
        return
    out = Path(out_dir)
    if per_stage is None:
        per_stage = any(out.glob(f"rank_*/{prefix}*_part*.ckpt")) and not any(
            (out / f"rank_{r.rank}" / f"{prefix}{r.rank}.ckpt").is_file() for r in plan.ranks)
    entries = {e.name: e for e in store.entries()}
    expected = set()

    def count(n: int) -> None:
        report.export_bytes += n

    for rank, path in output_jobs(store, plan, out, ExportOptions(prefix=prefix, per_stage=per_stage)):
        what = f"destination rank {rank.rank}'s {'part' if per_stage else 'file'}"
        path = _saved_as(path)
        expected.add(path)
        if not path.is_file():
            report.add("export", f"{what} is missing", file=path)
            continue
        try:
            with open_shard(path) as reader:
                report.export_files += 1
                want = [s.name for s in rank.slices]
                have = list(reader.entries)
                ordered = path.suffix == ".ckpt" and not any_order
                if (have if ordered else sorted(have)) != (want if ordered else sorted(want)):
                    report.add("export", _order_problem(have, want), file=path)
                for s in rank.slices:
                    _compare_entry("export", reader, store, entries[s.name], s.box, report, block_bytes, count)
        except ZckptError as err:
            report.add("export", err.message, file=err.path or path, param=err.param)
    found = [*out.glob(f"rank_*/{prefix}*.ckpt"), *out.glob(f"rank_*/{prefix}*.safetensors"),
             *out.glob(f"rank_*/{prefix}*{INDEX_SUFFIX}")]
    parts = {p.parent / n for p in found if p.name.endswith(INDEX_SUFFIX) for n in _index_files(p)}
    for extra in sorted(set(found) - parts):
        if extra not in expected:
            report.add("export", "file is not part of this destination layout", file=extra)


def _saved_as(ckpt_path: Path) -> Path:
    """Where a rank's file is: the ``.ckpt``, else its ``.safetensors``, else a split index."""
    if ckpt_path.is_file():
        return ckpt_path
    for cand in (ckpt_path.with_suffix(".safetensors"), ckpt_path.with_name(ckpt_path.stem + INDEX_SUFFIX)):
        if cand.is_file():
            return cand
    return ckpt_path


def _index_files(index: Path) -> list[str]:
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
        return sorted({str(v) for v in doc["weight_map"].values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _order_problem(have: list[str], want: list[str]) -> str:
    missing = [n for n in want if n not in set(have)]
    extra = [n for n in have if n not in set(want)]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} entr{'y' if len(missing) == 1 else 'ies'} ({missing[:3]!r})")
        if extra:
            parts.append(f"holds {len(extra)} unexpected ({extra[:3]!r})")
        return "file " + " and ".join(parts)
    i = next(i for i, (a, b) in enumerate(zip(have, want, strict=True)) if a != b)
    return f"entries are out of order: position {i} holds {have[i]!r}, the plan puts {want[i]!r} there"
