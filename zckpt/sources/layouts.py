"""Source directories that are not ``rank_<r>/<file>``: found before the rank-directory rules.

* MindSpore's unified safetensors directory (``param_name_map.json``, ``part<i>.safetensors``,
  ``hyper_param.safetensors``; :mod:`zckpt.formats.unified`) is the full model: one source,
  rank 0, read through its ``param_name_map.json``.
* MindFormers' per-iteration checkpoint (a checkpoint directory with
  ``iteration_<n>/`` directories, or one of those; :mod:`zckpt.formats.mindformers`): one
  source per rank (its model and optimizer files), and the strategy its ``metadata.json``
  records (:func:`implied_strategy`), so that no strategy file is needed.
"""

from __future__ import annotations

from pathlib import Path

from zckpt.formats.mindformers import find_iteration, is_single_card, metadata_strategy, rank_files
from zckpt.formats.strategy import StrategyMap
from zckpt.formats.unified import find_unified


def discover_other_layout(root: Path) -> dict[int, Path | str] | None:
    """``{rank: shard}`` for a directory laid out in one of these ways, else ``None``."""
    unified = find_unified(root)
    if unified is not None:
        return {0: unified}
    iteration = find_iteration(root)
    if iteration is not None:
        return dict(rank_files(iteration))
    return None


def implied_strategy(src: object) -> StrategyMap | None:
    """The strategy a source directory records itself (MindFormers' ``metadata.json``), if any;
    none where it lists no layout (every tensor held whole: a single card's job)."""
    if not isinstance(src, (str, Path)) or "://" in str(src) or not Path(src).is_dir():
        return None
    iteration = find_iteration(Path(src))
    if iteration is None or is_single_card(iteration):  # one rank, whole tensors: no strategy
        return None
    smap = metadata_strategy(iteration)
    return smap if smap.layouts else None  # a metadata.json of whole tensors (zckpt's one-rank save)
