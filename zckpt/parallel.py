"""``mindspore.parallel``'s checkpoint functions under the same path: ``import zckpt.parallel``.

MindSpore 2.10 exports its resharding functions from ``mindspore.parallel`` (the
``convert_*`` names are 2.10's current ones, thin aliases of the ``transform_*`` names, as
here) and most of them from ``mindspore`` as well (``zckpt``'s top level). Same signatures,
defaults and raise cases; docs/mindspore-api.md maps each one.
"""

from __future__ import annotations

from zckpt import api
from zckpt.api import (
    load_segmented_checkpoints,
    merge_pipeline_strategys,
    rank_list_for_transform,
    transform_checkpoint_by_rank,
    transform_checkpoints,
)
from zckpt.jobs.loading import load_distributed_checkpoint
from zckpt.jobs.unified import unified_safetensors


def rank_list_for_convert(
    rank_id: int, src_strategy_file: str | None = None, dst_strategy_file: str | None = None
) -> list[int]:
    """The source ranks destination ``rank_id`` needs (2.10's name of ``rank_list_for_transform``)."""
    return api.rank_list_for_transform(rank_id, src_strategy_file, dst_strategy_file)


def convert_checkpoint_by_rank(
    rank_id: int,
    checkpoint_files_map: dict[int, str],
    save_checkpoint_file_name: str,
    src_strategy_file: str | None = None,
    dst_strategy_file: str | None = None,
) -> None:
    """Convert one destination rank (2.10's name of ``transform_checkpoint_by_rank``)."""
    api.transform_checkpoint_by_rank(rank_id, checkpoint_files_map, save_checkpoint_file_name, src_strategy_file,
                                     dst_strategy_file)


def convert_checkpoints(
    src_checkpoints_dir: str,
    dst_checkpoints_dir: str,
    ckpt_prefix: str,
    src_strategy_file: str | None = None,
    dst_strategy_file: str | None = None,
    process_num: int = 1,
    output_format: str = "ckpt",
) -> None:
    """Convert a whole job (2.10's name of ``transform_checkpoints``)."""
    api.transform_checkpoints(src_checkpoints_dir, dst_checkpoints_dir, ckpt_prefix, src_strategy_file,
                              dst_strategy_file, process_num, output_format)


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
