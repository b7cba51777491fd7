"""MindSpore-compatible functions: swap ``import mindspore as ms`` for ``import zckpt as ms``.

Signatures, defaults and the TypeError/ValueError cases follow MindSpore's API reference.
``transform_checkpoints`` and ``transform_checkpoint_by_rank`` write each destination file
straight from the source shards (:mod:`zckpt.jobs.transform`, the direct path: no intermediate
copy, bounded memory, any M -> N); ``process_num`` is the number of files written at once
(local Dask workers).

Beyond MindSpore, every path may be an fsspec URL (``s3://bucket/ckpts``, ``memory://...``)
with the filesystem's options in the keyword-only ``storage_options``. URLs take the same
direct path: source shards are read where they are, by byte range, and each destination file
is uploaded as it is written (a multipart upload on S3, visible under its name once
complete); nothing of the model is written to local disk.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from zckpt.core.errors import SourceError, UsageError
from zckpt.io import remote
from zckpt.jobs.transform import TransformOptions, transform, transform_rank
from zckpt.jobs.transform import is_single_stage_conversion as is_single_stage_conversion  # re-export
from zckpt.plan.merge import merge_pipeline_strategys as merge_pipeline_strategys  # re-export (MindSpore name)
from zckpt.plan.ranklist import rank_list_for_transform_maps
from zckpt.sources.strategies import load_strategy
from zckpt.store.store import Store
from zckpt.write.destinations import destination


def __getattr__(name: str) -> Any:
    """``load_segmented_checkpoints`` (MindSpore's name), re-exported from
    :mod:`zckpt.jobs.segmented` on first use: that module reads stores through Zarr."""
    if name == "load_segmented_checkpoints":
        from zckpt.jobs.segmented import load_segmented_checkpoints  # a public name loaded on first use

        return load_segmented_checkpoints
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _exists(path: str | os.PathLike[str], storage_options: remote.StorageOptions) -> bool:
    if isinstance(path, str) and remote.is_remote(path):
        return remote.exists(remote.locate(path, storage_options, UsageError), UsageError)
    return remote.local_path(path).exists()


def _check_strategy_arg(value: object, what: str, storage_options: remote.StorageOptions = None) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"The {what} should be a str, but got {type(value).__name__}.")
    if isinstance(value, (str, os.PathLike)) and not _exists(value, storage_options):
        raise UsageError(f"{what} does not exist", path=str(value))


def _check_rank_id(rank_id: object) -> None:
    if not isinstance(rank_id, int) or isinstance(rank_id, bool):
        raise TypeError(f"The rank_id should be a int, but got {type(rank_id).__name__}.")
    if rank_id < 0:
        raise UsageError(f"rank_id {rank_id} must not be negative")


def transform_checkpoints(
    src_checkpoints_dir: str,
    dst_checkpoints_dir: str,
    ckpt_prefix: str,
    src_strategy_file: str | None = None,
    dst_strategy_file: str | None = None,
    process_num: int = 1,
    output_format: str = "ckpt",
    *,
    storage_options: remote.StorageOptions = None,
    file_suffix: str | None = None,
    iteration: int | None = None,
    remove_redundancy: bool = False,
) -> None:
    """Convert a whole job: ``dst_checkpoints_dir/rank_<r>/<ckpt_prefix><r>.ckpt`` for every rank.

    Unlike MindSpore there is no divisibility requirement between the device counts.
    Directories and strategy files may be URLs (``storage_options``: see the module).
    A rank directory holding several checkpoint files is read as MindSpore reads it unless
    that would be a guess (``net-9_100.ckpt`` against ``net-10_100.ckpt``): then this refuses,
    and ``file_suffix`` (keyword only, as in MindSpore's ``unified_safetensors``) chooses.
    ``process_num`` files are written at once (Dask thread workers); ``output_format``
    ``"safetensors"`` writes ``<ckpt_prefix><r>.safetensors`` from any source, ``"mindformers"`` a
    MindFormers Checkpoint 2.0 ``iteration_XXXXXXXX/`` of the whole destination job
    (``<ckpt_prefix>-model-RRRRRRR-NNNNNNN.safetensors``, ...; ``iteration`` and
    ``remove_redundancy``, keyword only: see :class:`~zckpt.jobs.export_job.ExportOptions`). Local paths and
    URLs take the direct path (:mod:`zckpt.jobs.transform`); a MindFormers iteration is written to a local
    directory only.
    """
    if not isinstance(ckpt_prefix, str):
        raise TypeError("The ckpt_prefix should be a str.")
    _check_strategy_arg(src_strategy_file, "src_strategy_file", storage_options)
    _check_strategy_arg(dst_strategy_file, "dst_strategy_file", storage_options)
    if not _is_dir(src_checkpoints_dir, storage_options):
        raise NotADirectoryError(f"src_checkpoints_dir {src_checkpoints_dir} is not a directory.")
    if output_format not in ("ckpt", "safetensors", "mindformers"):
        raise UsageError(f"output_format must be 'ckpt', 'safetensors' or 'mindformers', got {output_format!r}")
    if not isinstance(process_num, int) or isinstance(process_num, bool) or process_num < 1:
        raise UsageError(f"process_num must be a positive int, got {process_num!r}")
    dest = destination(os.fspath(dst_checkpoints_dir), storage_options)
    if dest.is_file():
        raise NotADirectoryError(f"dst_checkpoints_dir {dst_checkpoints_dir} is not a directory.")
    dest.create()
    src_map = load_strategy(src_strategy_file, storage_options)
    dst_map = load_strategy(dst_strategy_file, storage_options)
    transform(src_checkpoints_dir, dest.url, src_map, dst_map,
              options=TransformOptions(prefix=ckpt_prefix, overwrite=True, format=output_format,
                                       workers=process_num, file_suffix=file_suffix, iteration=iteration,
                                       remove_redundancy=remove_redundancy, storage_options=storage_options))


def _is_dir(path: str | os.PathLike[str], storage_options: remote.StorageOptions) -> bool:
    text = os.fspath(path)
    if remote.is_remote(text):
        return remote.isdir(remote.locate(text, storage_options, SourceError), SourceError)
    return remote.local_path(text).is_dir()


def transform_checkpoint_by_rank(
    rank_id: int,
    checkpoint_files_map: Mapping[int, str],
    save_checkpoint_file_name: str,
    src_strategy_file: str | None = None,
    dst_strategy_file: str | None = None,
    *,
    storage_options: remote.StorageOptions = None,
) -> None:
    """Convert one destination rank from the source files given in ``{rank: file}``.

    The map needs only the ranks :func:`rank_list_for_transform` names; a missing region is
    reported with the parameter it belongs to. Files may be URLs (``storage_options``: see
    the module); a URL destination is uploaded as it is written, visible once complete.
    """
    if not isinstance(checkpoint_files_map, dict):
        raise TypeError("The checkpoint_files_map should be a dict.")
    _check_rank_id(rank_id)
    if not isinstance(save_checkpoint_file_name, str):
        raise TypeError("The save_checkpoint_file_name should be a str.")
    if not save_checkpoint_file_name.endswith(".ckpt"):
        raise UsageError(f"The save_checkpoint_file_name {save_checkpoint_file_name} should end with .ckpt")
    _check_strategy_arg(src_strategy_file, "src_strategy_file", storage_options)
    _check_strategy_arg(dst_strategy_file, "dst_strategy_file", storage_options)
    for rank, path in checkpoint_files_map.items():
        if not _exists(path, storage_options):
            raise UsageError(f"Checkpoint file {path} in rank {rank} does not exist")
    src_map = load_strategy(src_strategy_file, storage_options)
    dst_map = load_strategy(dst_strategy_file, storage_options)
    transform_rank(checkpoint_files_map, rank_id, save_checkpoint_file_name, src_map, dst_map,
                   options=TransformOptions(overwrite=True, storage_options=storage_options))


def rank_list_for_transform(
    rank_id: int,
    src_strategy_file: str | None = None,
    dst_strategy_file: str | None = None,
    *,
    storage_options: remote.StorageOptions = None,
) -> list[int]:
    """Source ranks whose checkpoints destination ``rank_id`` needs (MindSpore's order: descending).
    Strategy files may be URLs."""

    _check_rank_id(rank_id)
    _check_strategy_arg(src_strategy_file, "src_strategy_file", storage_options)
    _check_strategy_arg(dst_strategy_file, "dst_strategy_file", storage_options)
    if src_strategy_file is None:
        return [0]
    ranks: list[int] = rank_list_for_transform_maps(
        rank_id, load_strategy(src_strategy_file, storage_options), load_strategy(dst_strategy_file, storage_options)
    )
    return ranks


def open_store(path: str | os.PathLike[str]) -> Store:
    """Open a zckpt store read-only (its arrays are plain Zarr v3)."""

    return Store.open(path)


