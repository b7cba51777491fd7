"""``mindspore.parallel``'s checkpoint functions under the same path: ``import zckpt.parallel``.

MindSpore 2.10 exports its resharding functions from ``mindspore.parallel`` (the
``convert_*`` names are 2.10's current ones, thin aliases of the ``transform_*`` names, as
here) and most of them from ``mindspore`` as well (``zckpt``'s top level). Same signatures,
defaults and raise cases; docs/mindspore-api.md maps each one.
"""

from __future__ import annotations

from zckpt.api import (
    load_segmented_checkpoints,
    merge_pipeline_strategys,
    rank_list_for_transform,
    transform_checkpoint_by_rank,
    transform_checkpoints,
)
from zckpt.jobs.loading import load_distributed_checkpoint
from zckpt.jobs.unified import unified_safetensors

rank_list_for_convert = rank_list_for_transform
"""The source ranks a destination rank needs (2.10's name of ``rank_list_for_transform``)."""

convert_checkpoint_by_rank = transform_checkpoint_by_rank
"""Convert one destination rank (2.10's name of ``transform_checkpoint_by_rank``)."""

convert_checkpoints = transform_checkpoints
"""Convert a whole job (2.10's name of ``transform_checkpoints``)."""


__all__ = [
    "convert_checkpoint_by_rank",
    "convert_checkpoints",
    "load_distributed_checkpoint",
    "load_segmented_checkpoints",
    "merge_pipeline_strategys",
    "rank_list_for_convert",
    "rank_list_for_transform",
    "transform_checkpoint_by_rank",
    "transform_checkpoints",
    "unified_safetensors",
]
