"""Locate the source shards of a MindSpore job on disk.

MindSpore's layout is ``SRC_DIR/rank_<r>/<anything>.ckpt``; when a rank directory holds
several ``.ckpt`` files the last one in lexicographic order is the checkpoint, as in
``mindspore.transform_checkpoints``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from zckpt.errors import SourceError

_RANK_DIR = re.compile(r"^rank_(\d+)$")


def discover_rank_files(src_dir: str | Path) -> dict[int, Path]:
    """Map rank id to its checkpoint file; refuses a directory with no rank files."""
    root = Path(src_dir)
    if not root.is_dir():
        raise SourceError("source checkpoint directory does not exist or is not a directory", path=root)
    out: dict[int, Path] = {}
    for child in root.iterdir():
        m = _RANK_DIR.match(child.name)
        if not m or not child.is_dir():
            continue
        files = sorted(p for p in child.glob("*.ckpt") if p.is_file())
        if files:
            out[int(m.group(1))] = files[-1]
    if not out:
        raise SourceError("no rank_<r>/*.ckpt files found", path=root)
    return dict(sorted(out.items()))


def check_rank_map(files: Mapping[int, str | Path]) -> dict[int, Path]:
    """Validate an explicit ``{rank: file}`` map (MindSpore's checkpoint_files_map)."""
    out: dict[int, Path] = {}
    for rank, path in files.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise SourceError(f"rank key {rank!r} must be a non-negative int")
        p = Path(path)
        if not p.is_file():
            raise SourceError(f"checkpoint file of rank {rank} does not exist", path=p)
        out[rank] = p
    return dict(sorted(out.items()))
