"""zckpt: reshard MindSpore distributed checkpoints through a global-coordinate Zarr v3 store.

The MindSpore-named functions are drop-in replacements (``import zckpt as ms``); ``ingest``,
``export`` and ``open_store`` expose the store path directly.
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
from zckpt.ingest import IngestOptions, IngestReport, ingest
from zckpt.segmented import SegmentedCheckpoint, load_slice, open_segmented

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
    "UsageError",
    "ZckptError",
    "export",
    "ingest",
    "load_segmented_checkpoints",
    "load_slice",
    "merge_pipeline_strategys",
    "open_segmented",
    "open_store",
    "rank_list_for_transform",
    "transform_checkpoint_by_rank",
    "transform_checkpoints",
]
