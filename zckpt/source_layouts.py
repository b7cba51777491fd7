"""Source directories that are not ``rank_<r>/<file>``: found before the rank-directory rules.

* MindSpore's unified safetensors directory (``param_name_map.json``, ``part<i>.safetensors``,
  ``hyper_param.safetensors``; :mod:`zckpt.formats.unified`) is the full model: one source,
  rank 0, read through its ``param_name_map.json``.
"""

from __future__ import annotations

from pathlib import Path

from zckpt.formats.unified import find_unified


def discover_other_layout(root: Path) -> dict[int, Path | str] | None:
    """``{rank: shard}`` for a directory laid out in one of these ways, else ``None``."""
    unified = find_unified(root)
    if unified is not None:
        return {0: unified}
    return None
