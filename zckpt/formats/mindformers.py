"""MindFormers' per-iteration checkpoint layout ("Checkpoint 2.0", ``use_legacy_format: False``).

MindSpore Transformers saves each checkpoint as one directory per iteration
(``mindformers/checkpoint/utils.py``, ``metadata.py``)::

    checkpoint/
        latest_checkpointed_iteration.txt       the iteration to resume from
        iteration_00000010/                     (older releases: iter_00000010/)
            common.json                         epoch_num, step_num, global_step, loss_scale, ...
            metadata.json                       every parameter's layout and chunks, and which file holds each
            [prefix-]model-0000000-0000008.safetensors   rank 0's model weights (rank, rank count: 7 digits)
            [prefix-]opt-0000000-0000008.safetensors     rank 0's optimizer states
            ...

``metadata.json`` is ``{"state_dict_metadata": {name: {"properties": {"dtype", ...},
"global_shape", "axis_fragmentations", "layout": Layout.to_dict(), "chunk": [{"global_offset",
"local_shape"}]}}, "storage_data": {"('name', (offsets))": [{"file_name", "storage_rank"}]}}``,
where the layout is MindSpore's ``Layout.to_dict()``: ``device_matrix``, ``tensor_map``
(MindSpore's axis numbering), ``interleaved_parallel``, ``alias_name``, ``rank_list``.

zckpt reads such a directory as a sharded source: rank ``r`` is its model and optimizer
files together (:class:`MindFormersRankReader`), and the strategy is the metadata's layouts
(:func:`metadata_strategy`), checked against the chunks it records: a layout whose chunks
are not the boxes zckpt derives from it (optimizer sharding the layout does not state,
interleaved parallel) is refused, naming the parameter, rather than read wrongly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from zckpt.errors import CheckpointFormatError, StrategyError
from zckpt.formats.safetensors import SafetensorsReader
from zckpt.formats.shards import SafetensorsSetReader
from zckpt.formats.strategy import ParamLayout, StrategyMap, make_layout
from zckpt.layout import Box, all_boxes, resolve

METADATA = "metadata.json"
TRACKER = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"^iter(?:ation)?_(\d+)$")
RANK_FILE = re.compile(r"^(?:(?P<prefix>.+)-)?(?P<kind>model|opt)-(?P<rank>\d{7})-(?P<total>\d{7})\.safetensors$")


def find_iteration(root: Path) -> Path | None:
    """The iteration directory ``root`` stands for: ``root`` itself when it holds
    ``metadata.json`` and rank files, else the tracker's iteration, else the highest one."""
    if (root / METADATA).is_file() and any(RANK_FILE.match(p.name) for p in root.iterdir()):
        return root
    iters = {int(m.group(1)): p for p in root.iterdir() if (m := ITER_DIR.match(p.name)) and p.is_dir()}
    if not iters:
        return None
    tracker = root / TRACKER
    if tracker.is_file():
        text = tracker.read_text(encoding="utf-8").strip()
        if not text.isdigit() or int(text) not in iters:
            raise CheckpointFormatError(f"names iteration {text!r}, which has no directory here", path=tracker)
        chosen = iters[int(text)]
    else:
        chosen = iters[max(iters)]
    if not (chosen / METADATA).is_file():
        raise CheckpointFormatError(f"iteration directory has no {METADATA}", path=chosen)
    return chosen


def rank_files(iteration: Path) -> dict[int, Path]:
    """Rank -> its model file (or its optimizer file when it saved no model file)."""
    found: dict[int, dict[str, Path]] = {}
    totals: set[int] = set()
    for p in iteration.iterdir():
        m = RANK_FILE.match(p.name)
        if m and p.is_file():
            kinds = found.setdefault(int(m.group("rank")), {})
            if m.group("kind") in kinds:
                raise CheckpointFormatError(f"rank {int(m.group('rank'))} has two {m.group('kind')} files "
                                            f"({kinds[m.group('kind')].name}, {p.name}); keep one prefix",
                                            path=iteration)
            kinds[m.group("kind")] = p
            totals.add(int(m.group("total")))
    if len(totals) > 1:
        raise CheckpointFormatError(f"rank files disagree on the rank count: {sorted(totals)}", path=iteration)
    return {r: kinds["model"] if "model" in kinds else kinds["opt"] for r, kinds in sorted(found.items())}


def partner(path: Path) -> Path | None:
    """The other file of the same rank (model <-> opt), when present."""
    m = RANK_FILE.match(path.name)
    if m is None:
        return None
    other = "opt" if m.group("kind") == "model" else "model"
    prefix = f"{m.group('prefix')}-" if m.group("prefix") else ""
    cand = path.with_name(f"{prefix}{other}-{m.group('rank')}-{m.group('total')}.safetensors")
    return cand if cand.is_file() else None


def is_rank_file(path: Path) -> bool:
    """A MindFormers rank file in an iteration directory (``metadata.json`` beside it)."""
    return RANK_FILE.match(path.name) is not None and (path.parent / METADATA).is_file()


class MindFormersRankReader(SafetensorsSetReader):
    """One rank of a MindFormers iteration: its model and optimizer files as one shard."""

    def _read_index(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for p in (self.path, partner(self.path)):
            if p is None:
                continue
            with SafetensorsReader(p, verify_crc=False) as r:
                for n, e in r.entries.items():
                    if e.kind != "tensor":
                        continue
                    if n in out:
                        raise CheckpointFormatError(f"is in {out[n]} and in {p.name}", path=self.path, param=n)
                    out[n] = p.name
        return out


def _layout(name: str, meta: dict[str, Any], where: Path) -> tuple[int, ParamLayout]:
    lay = meta.get("layout")
    if not isinstance(lay, dict) or "device_matrix" not in lay or "tensor_map" not in lay:
        raise StrategyError("metadata gives no layout (device_matrix, tensor_map)", path=where, param=name)
    if lay.get("interleaved_parallel"):
        raise StrategyError("interleaved_parallel layouts are not supported", path=where, param=name)
    layout = make_layout(lay["device_matrix"], lay["tensor_map"], path=where, param=name)
    ranks = lay.get("rank_list") or list(range(layout.device_num))
    if len(ranks) != layout.device_num or sorted(ranks) != list(range(min(ranks), min(ranks) + len(ranks))):
        raise StrategyError(f"rank_list {ranks} is not one pipeline stage of {layout.device_num} consecutive ranks",
                            path=where, param=name)
    if min(ranks) % layout.device_num:
        raise StrategyError(f"rank_list {ranks} does not start a pipeline stage", path=where, param=name)
    return min(ranks) // layout.device_num, layout


def metadata_strategy(iteration: Path) -> StrategyMap:
    """The source strategy a MindFormers iteration records, checked against its chunks."""
    where = iteration / METADATA
    try:
        doc = json.loads(where.read_text(encoding="utf-8"))
        params = doc["state_dict_metadata"]
        assert isinstance(params, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as err:
        raise CheckpointFormatError(f"not MindFormers checkpoint metadata: {err!r}", path=where) from None
    layouts: dict[str, dict[int, ParamLayout]] = {}
    for name, meta in params.items():
        stage, layout = _layout(name, meta, where)
        shape = tuple(int(d) for d in meta.get("global_shape", ()))
        boxes = set(all_boxes(resolve(layout, shape, param=name)))
        for chunk in meta.get("chunk", []):
            offset = [int(x) for x in chunk["global_offset"]]
            box = Box(tuple(offset), tuple(o + int(s) for o, s in zip(offset, chunk["local_shape"], strict=True)))
            if box not in boxes:
                raise StrategyError(f"chunk at {offset} of shape {chunk['local_shape']} is not a piece of its layout "
                                    "(an optimizer split or an interleaved layout zckpt cannot derive): refused",
                                    path=where, param=name)
        layouts.setdefault(name, {})[stage] = layout
    return StrategyMap(layouts, (str(where),))
