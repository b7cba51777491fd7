"""How the commands speak: a report as JSON or as lines, sizes, rates and rank lists people read at a glance.

Every command ends by printing one report, the same document with ``--json`` as the lines
without it; the words those lines share (``1.5 KiB``, ``0-3, 8``, the files kept and
written, the source file chosen in a rank directory) are made here, once. What each
command reports is :mod:`zckpt.cli.commands`; nothing here reads a file or an argument.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': sizes people can read at a glance."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def rate(n: int, seconds: float) -> str:
    return f"{human_bytes(n / seconds)}/s" if seconds > 0 else "-"


def emit(doc: dict[str, Any], as_json: bool, lines: Sequence[str], *, quiet: bool = False) -> None:
    """The report: JSON with ``--json``, else its lines, none with ``--quiet``."""
    if as_json:
        print(json.dumps(doc, indent=1))
    elif not quiet:
        for line in lines:
            print(line)


def files_line(r: Any, tail: str = "") -> str:
    """How many rank files an export or transform kept (complete from an earlier run of the
    same job) and wrote, and what writing them took."""
    counts = f"rank files: {r.kept} kept, {len(r.ranks)} written"
    if not r.ranks:
        return counts + (": already complete, nothing to do" if r.kept else "")
    return (f"{counts}, {human_bytes(r.bytes_written)} in {r.seconds:.2f} s "
            f"({rate(r.bytes_written, r.seconds)}){tail}")


def files_doc(r: Any) -> dict[str, Any]:
    return {"out_dir": r.out_dir, "seconds": r.seconds, "kept": r.kept, "written": len(r.ranks),
            "ranks": [{"rank": x.rank, "path": x.path, "tensors": x.tensors, "bytes": x.bytes} for x in r.ranks]}


def source_lines(rank_files: dict[int, str], choices: dict[int, Any], same_as_rank0: Sequence[int],
                 limit: int = 8) -> list[str]:
    """What was read from SRC_DIR, where it was a choice: the file picked in each rank
    directory that held several (the first ``limit``; all are in the JSON report)."""
    lines = []
    for r, c in list(choices.items())[:limit]:
        lines.append(f"rank {r}: chose {rank_files[r]} among {len(c.candidates)} files ({c.rule})")
    if len(choices) > limit:
        lines.append(f"... and {len(choices) - limit} more rank directories with several files (see --json)")
    if same_as_rank0:
        lines.append(f"no source strategy: rank file(s) {list(same_as_rank0)} hold the same entries and bytes as "
                     "rank_0, which is read as the full model")
    return lines


def choices_json(choices: dict[int, Any]) -> dict[str, Any]:
    return {str(r): {"file": c.name, "candidates": list(c.candidates), "rule": c.rule} for r, c in choices.items()}


def rank_ranges(ranks: Sequence[int] | np.ndarray) -> str:
    """``[0, 1, 2, 3, 8, 10, 11]`` -> ``"0-3, 8, 10-11"``: a 4 096-rank list stays one short line."""
    import numpy as np  # after run() has set ONE_THREAD: see zckpt.cli.main

    a = np.asarray(ranks, dtype=np.int64)
    if a.size == 0:
        return "none"
    cut = np.flatnonzero(np.diff(a) != 1) + 1
    starts, ends = a[np.concatenate(([0], cut))], a[np.concatenate((cut - 1, [a.size - 1]))]
    return ", ".join(str(s) if s == e else f"{s}-{e}" for s, e in zip(starts.tolist(), ends.tolist(), strict=True))
