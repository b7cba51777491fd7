"""MindSpore's *unified* safetensors directory, read as one full (unsharded) checkpoint.

``mindspore.parallel.unified_safetensors`` merges a sharded job into whole tensors laid out
as (``mindspore/parallel/transform_safetensors.py``, 2.10):

* ``part<i>.safetensors``: the parameters the strategy lists, whole, spread over parts of
  about 3 GiB (metadata ``{"format": "ms"}``);
* ``hyper_param.safetensors``: the entries the strategy does not list (``global_step``,
  ``learning_rate``, ``momentum``...), whole;
* ``param_name_map.json``: ``{"metadata": {"total_size": N}, "weight_map": {name: "part<i>.safetensors"}}``
  (indent 4), naming the part of every parameter, but not the hyper-parameters.

``load_distributed_checkpoint(unified_safetensors_dir=...)`` reads such a directory; so
does zckpt, as a source of one rank with the full model: :class:`UnifiedSafetensorsReader`
is opened on the directory's ``param_name_map.json`` and offers every entry of the parts
and of ``hyper_param.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

from zckpt.core.errors import CheckpointFormatError
from zckpt.formats.safetensors import SafetensorsReader
from zckpt.formats.shard_reader import SafetensorsSetReader

MAP_FILE = "param_name_map.json"
HYPER_FILE = "hyper_param.safetensors"


def part_file(index: int) -> str:
    """The name MindSpore gives part ``index`` of a unified directory."""
    return f"part{index}.safetensors"


def find_unified(root: Path) -> Path | None:
    """``root/param_name_map.json`` when ``root`` is a unified directory, else ``None``."""
    index = root / MAP_FILE
    return index if index.is_file() else None


class UnifiedSafetensorsReader(SafetensorsSetReader):
    """Every entry of a unified directory: the parts through ``param_name_map.json``, plus
    ``hyper_param.safetensors`` when present (its entries must not also be in a part)."""

    def _read_index(self) -> dict[str, str]:
        weight_map = super()._read_index()
        hyper = self.path.parent / HYPER_FILE
        if hyper.is_file():
            with SafetensorsReader(hyper, verify_crc=False) as r:
                names = [n for n, e in r.entries.items() if e.kind == "tensor"]
            for n in names:
                if n in weight_map:
                    raise CheckpointFormatError(f"is in {HYPER_FILE} and in {weight_map[n]}", path=self.path, param=n)
                weight_map[n] = HYPER_FILE
        return weight_map
