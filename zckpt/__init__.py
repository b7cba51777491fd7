"""zckpt: reshard MindSpore distributed checkpoints through a global-coordinate Zarr v3 store.

The MindSpore-named functions are drop-in replacements (``import zckpt as ms``); ``ingest``,
``export`` and ``open_store`` expose the store path directly; ``zckpt.transform.transform``
(options :class:`TransformOptions`) is the direct path the MindSpore-named functions take.
"""

from zckpt.api import (
    load_segmented_checkpoints,
    merge_pipeline_strategys,
    open_store,
    rank_list_for_transform,
    transform_checkpoint_by_rank,
    transform_checkpoints,
)
from zckpt.errors import (
    CheckpointFormatError,
    LayoutError,
    OutputError,
    SourceError,
    StoreError,
    StrategyError,
    UsageError,
    ZckptError,
)
from zckpt.export import ExportOptions, ExportReport, export
from zckpt.file_convert import ckpt_to_safetensors, safetensors_to_ckpt
from zckpt.ingest import IngestOptions, IngestReport, ingest
from zckpt.loading import load_distributed_checkpoint
from zckpt.parallel import convert_checkpoint_by_rank, convert_checkpoints
from zckpt.segmented import SegmentedCheckpoint, load_slice, open_segmented
from zckpt.transform import TransformOptions, TransformReport
from zckpt.unified import unified_safetensors

__version__ = "0.1.0"

__all__ = [
    "CheckpointFormatError",
    "ExportOptions",
    "ExportReport",
    "IngestOptions",
    "IngestReport",
    "LayoutError",
    "OutputError",
    "SegmentedCheckpoint",
    "SourceError",
    "StoreError",
    "StrategyError",
    "TransformOptions",
    "TransformReport",
    "UsageError",
    "ZckptError",
    "ckpt_to_safetensors",
    "convert_checkpoint_by_rank",
    "convert_checkpoints",
    "export",
    "ingest",
    "load_distributed_checkpoint",
    "load_segmented_checkpoints",
    "load_slice",
    "merge_pipeline_strategys",
    "open_segmented",
    "open_store",
    "rank_list_for_transform",
    "safetensors_to_ckpt",
    "transform_checkpoint_by_rank",
    "transform_checkpoints",
    "unified_safetensors",
]
