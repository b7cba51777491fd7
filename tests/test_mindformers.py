"""MindFormers' per-iteration checkpoints as a source (no strategy file: metadata.json says it).

The bundled example's 8 source ranks are laid out as MindFormers saves a job
(``iteration_<n>/`` with ``metadata.json``, ``common.json`` and per rank
``<prefix>-model-<r>-<N>.safetensors`` / ``<prefix>-opt-...``, names and JSON as in
``mindformers/checkpoint/utils.py`` and ``metadata.py``); reading it must give MindSpore's
own 4-rank destination (``dst/expected``), with and without deduplicated storage.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import save_file
from test_unified_loading import DST_STRATEGY, SRC, SRC_STRATEGY, assert_rank_file

import zckpt
from zckpt.errors import StrategyError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import read_strategy
from zckpt.layout import rank_box, resolve
from zckpt.loading import ShardSlicer, plan_rank, write_rank_file

N = 8


def layout_dict(dev: tuple[int, ...], tmap: tuple[tuple[int, ...], ...]) -> dict[str, object]:
    """MindSpore's ``Layout.to_dict()`` for a strategy layout (one stage, all ranks)."""
    flat = [a[0] if len(a) == 1 else (list(a) if a else -1) for a in tmap]
    alias = [f"a{i}" for i in range(len(dev))]
    return {"device_matrix": list(dev), "tensor_map": flat, "interleaved_parallel": False, "alias_name": alias,
            "rank_list": list(range(N))}


def write_iteration(root: Path, *, dedup: bool = False, prefix: str | None = "llama", step: int = 10) -> Path:
    """The example job saved as MindFormers' iteration ``step`` under ``root``."""
    it = root / f"iteration_{step:08d}"
    it.mkdir(parents=True)
    lead = f"{prefix}-" if prefix else ""  # MindFormers' names without a user prefix start with model-/opt-
    smap = read_strategy(SRC_STRATEGY)
    state: dict[str, dict[str, object]] = {}
    storage: dict[str, list[dict[str, object]]] = {}
    stored: set[tuple[str, tuple[int, ...]]] = set()
    for r in range(N):
        model, opt = {}, {}
        with CkptReader(SRC / f"rank_{r}" / f"checkpoint_{r}.ckpt") as src:
            for name in src.entries:
                arr = src.array(name).copy()
                lay = smap.layout(name)
                if lay is not None:
                    box = rank_box(resolve(lay, _global_shape(name), param=name), r)
                    key = (name, box.start)
                    meta = state.setdefault(name, {"properties": {"dtype": "Float32", "replica_id": 0},
                                                   "global_shape": list(_global_shape(name)),
                                                   "axis_fragmentations": [], "layout": layout_dict(
                                                       lay.dev_matrix, lay.tensor_map), "chunk": []})
                    chunk = {"global_offset": list(box.start), "local_shape": list(box.shape)}
                    if chunk not in meta["chunk"]:  # type: ignore[operator]
                        meta["chunk"].append(chunk)  # type: ignore[attr-defined]
                    if dedup and key in stored:
                        continue
                    stored.add(key)
                    fname = f"{lead}{'model' if name.startswith('layer') else 'opt'}-{r:07d}-{N:07d}.safetensors"
                    storage.setdefault(str((name, tuple(box.start))), []).append(
                        {"file_name": fname, "storage_rank": r})
                (model if name.startswith("layer") else opt)[name] = arr
        save_file(model, str(it / f"{lead}model-{r:07d}-{N:07d}.safetensors"), metadata={"format": "ms"})
        save_file(opt, str(it / f"{lead}opt-{r:07d}-{N:07d}.safetensors"), metadata={"format": "ms"})
    (it / "metadata.json").write_text(json.dumps({"state_dict_metadata": state, "storage_data": storage}, indent=4))
    (it / "common.json").write_text(json.dumps({"epoch_num": 1, "step_num": step, "global_step": step,
                                                "loss_scale": None, "global_batch_size": 8}))
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return it


def _global_shape(name: str) -> tuple[int, ...]:
    with CkptReader(Path(__file__).resolve().parents[1] / "docs" / "example" / "dst" / "expected" / "rank_0" /
                    "checkpoint_0.ckpt") as r:
        shard = r.entries[name].shape
    lay = read_strategy(DST_STRATEGY).layout(name)
    assert lay is not None
    from zckpt.layout import global_shape

    return global_shape(lay, shard, param=name)


@pytest.mark.parametrize("dedup", [False, True])
def test_mindformers_iteration_gives_mindsporess_destination(tmp_path: Path, dedup: bool) -> None:
    write_iteration(tmp_path / "checkpoint", dedup=dedup)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "checkpoint"), store)  # no strategy: metadata.json holds it
    zckpt.export(store, tmp_path / "dst", str(DST_STRATEGY))
    for r in range(4):
        assert_rank_file(tmp_path / "dst" / f"rank_{r}" / f"checkpoint_{r}.ckpt", r)


def test_mindformers_iteration_loads_a_rank_directly(tmp_path: Path) -> None:
    it = write_iteration(tmp_path / "checkpoint", step=20)
    out = tmp_path / "out"
    with ShardSlicer(str(it), None) as slicer:
        for r in range(4):
            entries = plan_rank(slicer, read_strategy(DST_STRATEGY), r, lambda _: True)
            write_rank_file(entries, slicer.read, out / f"{r}.safetensors", "safetensors")
            assert_rank_file(out / f"{r}.safetensors", r)


def test_mindformers_tracker_picks_the_iteration(tmp_path: Path) -> None:
    root = tmp_path / "checkpoint"
    write_iteration(root, step=10, prefix=None)
    (root / "iteration_00000020").mkdir()  # a later, incomplete save: the tracker says 10
    zckpt.ingest(str(root), tmp_path / "s.zarr")
    (root / "latest_checkpointed_iteration.txt").write_text("30")
    with pytest.raises(ValueError, match="iteration '30'"):
        zckpt.ingest(str(root), tmp_path / "t.zarr")


def test_mindformers_chunks_that_contradict_the_layout_are_refused(tmp_path: Path) -> None:
    it = write_iteration(tmp_path / "checkpoint")
    doc = json.loads((it / "metadata.json").read_text())
    doc["state_dict_metadata"]["layer2.weight"]["chunk"][0]["local_shape"][0] //= 2  # e.g. an unstated opt split
    (it / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(StrategyError, match="not a piece of its layout") as err:
        zckpt.ingest(str(it), tmp_path / "s.zarr")
    assert err.value.param == "layer2.weight"


def test_transform_checkpoints_takes_a_mindformers_directory(tmp_path: Path) -> None:
    """MindSpore's function name, a MindFormers source and no source strategy file."""
    write_iteration(tmp_path / "checkpoint")
    zckpt.transform_checkpoints(str(tmp_path / "checkpoint"), str(tmp_path / "dst"), "checkpoint_", None,
                                str(DST_STRATEGY))
    for r in range(4):
        assert_rank_file(tmp_path / "dst" / f"rank_{r}" / f"checkpoint_{r}.ckpt", r)
