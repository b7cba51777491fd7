"""Locate the source shards of a MindSpore job on disk.

MindSpore's layout is ``SRC_DIR/rank_<r>/<anything>.ckpt``; when a rank directory holds
several ``.ckpt`` files the last one in lexicographic order is the checkpoint, as in
``mindspore.transform_checkpoints``. Sharded safetensors jobs (``rank_<r>/*.safetensors``)
are found the same way (see :func:`zckpt.formats.shards.pick_rank_file`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from zckpt.errors import SourceError
from zckpt.formats.shards import check_single_format, pick_rank_file

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
        found = pick_rank_file(child)  # .ckpt or .safetensors, chosen as MindSpore does
        if found is not None:
            out[int(m.group(1))] = found
    if not out:
        raise SourceError("no rank_<r>/*.ckpt or rank_<r>/*.safetensors files found", path=root)
    check_single_format(out, root)
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
