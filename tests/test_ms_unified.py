"""Cross-checks with MindSpore itself (its own virtualenv, skipped when absent):

* MindSpore's ``unified_safetensors`` output read by zckpt (as a load source and as an
  ingest source) gives MindSpore's destination shards;
* zckpt's ``unified_safetensors`` output loaded by MindSpore's ``load_distributed_checkpoint``
  gives the same shards;
* ``zckpt.load_distributed_checkpoint`` on a Cell sets the values MindSpore's own function
  sets (``format="ckpt"`` from the source shards, ``format="safetensors"`` from a unified
  directory), run inside MindSpore's environment.

The oracle for shard values is the example's ``dst/expected`` (MindSpore's own 4-rank job).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mindspore_env import require_ms_python, run_ms_tool
from test_unified_loading import DST_STRATEGY, SRC, SRC_STRATEGY, assert_rank_file, expected_rank

import zckpt
from zckpt.formats.opener import open_shard
from zckpt.jobs.loading import ShardSlicer

pytestmark = pytest.mark.mindspore


def test_zckpt_reads_mindsporess_unified_directory(tmp_path: Path) -> None:
    require_ms_python()
    doc = run_ms_tool("ms_unified.py", "unify", str(SRC), str(SRC_STRATEGY), str(tmp_path / "ms"))
    unified = Path(doc["unified"])
    assert {"param_name_map.json", "hyper_param.safetensors", "part0.safetensors"} <= set(doc["files"])
    with open_shard(unified / "hyper_param.safetensors") as hyper:
        assert {"global_step", "learning_rate", "momentum"} <= set(hyper.entries)
    out = tmp_path / "out"
    zckpt.load_distributed_checkpoint(None, predict_strategy=str(DST_STRATEGY), format="safetensors",
                                      unified_safetensors_dir=str(unified), dst_safetensors_dir=str(out))
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(unified), store)
    zckpt.export(store, tmp_path / "dst", str(DST_STRATEGY))
    for r in range(4):
        assert_rank_file(out / f"rank_{r}" / "net.safetensors", r)
        assert_rank_file(tmp_path / "dst" / f"rank_{r}" / f"checkpoint_{r}.ckpt", r)


def test_mindspore_loads_zckpts_unified_directory(tmp_path: Path) -> None:
    """One part (unified_safetensors) and five parts (unify_store from a store, small parts)."""
    require_ms_python()
    from zckpt.formats.strategy import read_strategy
    from zckpt.jobs.unified import unify_store

    unified = tmp_path / "unified"
    zckpt.unified_safetensors(str(SRC), str(SRC_STRATEGY), str(unified))
    zckpt.ingest(str(SRC), tmp_path / "s.zarr", str(SRC_STRATEGY))
    unify_store(tmp_path / "s.zarr", tmp_path / "parts", read_strategy(SRC_STRATEGY), part_bytes=10_000)
    assert len(list((tmp_path / "parts").glob("part*.safetensors"))) == 5
    for src in (unified, tmp_path / "parts"):
        out = tmp_path / f"out_{src.name}"
        run_ms_tool("ms_unified.py", "save", str(src), str(DST_STRATEGY), str(out), "0", "1", "2", "3")
        for r in range(4):
            assert_rank_file(out / f"rank_{r}" / "net.safetensors", r)


def _load_both(tmp_path: Path, shapes: dict[str, tuple[list[int], str]], args: dict[str, object],
               function: str = "load_distributed_checkpoint") -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "shapes.json").write_text(json.dumps(shapes))
    (tmp_path / "args.json").write_text(json.dumps({"mindspore": args, "zckpt": args, "out": str(tmp_path),
                                                    "function": function}))
    doc = run_ms_tool("ms_unified.py", "net", str(tmp_path / "shapes.json"), str(tmp_path / "args.json"))
    if "skip" in doc:
        pytest.skip(doc["skip"])
    with np.load(tmp_path / "mindspore.npz") as a, np.load(tmp_path / "zckpt.npz") as b:
        return dict(a), dict(b)


def test_load_distributed_checkpoint_into_a_cell_like_mindspore(tmp_path: Path) -> None:
    require_ms_python()
    files = [str(SRC / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in range(8)]
    with ShardSlicer(str(SRC), str(SRC_STRATEGY)) as s:
        full = {t.name: (list(t.shape), "float32") for t in s.tensors if t.name.startswith("layer")}
    theirs, ours = _load_both(tmp_path / "ckpt", full, {"checkpoint_filenames": files, "predict_strategy": None,
                                                         "train_strategy_filename": str(SRC_STRATEGY)})
    assert set(theirs) == set(ours) == set(full)
    for name in full:
        assert np.array_equal(theirs[name], ours[name]), name
        assert not np.all(ours[name] == 0), name  # loaded, not the Cell's zeros

    unified = tmp_path / "unified"
    zckpt.unified_safetensors(str(SRC), str(SRC_STRATEGY), str(unified))
    want = expected_rank(0)  # communication not initialised: both load rank 0's slices
    shapes = {n: (list(a.shape), "float32") for n, a in want.items() if n.startswith("layer")}
    theirs, ours = _load_both(tmp_path / "st", shapes, {"format": "safetensors", "unified_safetensors_dir":
                                                         str(unified), "predict_strategy": str(DST_STRATEGY)})
    for name in shapes:
        assert np.array_equal(theirs[name], ours[name]) and np.array_equal(ours[name], want[name]), name


def test_zckpt_verifies_mindsporess_own_exports(tmp_path: Path) -> None:
    """MindSpore's transform_checkpoints output (.ckpt, its own entry order; safetensors from
    safetensors sources) checked value by value against zckpt's store of the same job."""
    require_ms_python()
    doc = run_ms_tool("ms_unified.py", "unify", str(SRC), str(SRC_STRATEGY), str(tmp_path / "ms"))
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(SRC), store, str(SRC_STRATEGY))
    from zckpt.jobs.verify import verify

    for fmt, src in (("ckpt", str(SRC)), ("safetensors", doc["st"])):
        out = tmp_path / f"ms_{fmt}"
        got = run_ms_tool("ms_unified.py", "transform", src, str(SRC_STRATEGY), str(DST_STRATEGY), str(out), fmt)
        assert any(f.endswith(f".{fmt}") for f in got["files"])
        report = verify(store, against=out, dst_strategy=str(DST_STRATEGY), any_order=True)
        assert report.ok and report.export_files == 4, [m.render() for m in report.mismatches]


def test_bf16_loads_into_a_cell_like_mindspore(tmp_path: Path) -> None:
    """bf16 shards (a generated 2-rank job) loaded by both into bfloat16 Parameters, through
    load_distributed_checkpoint (merged whole) and load_segmented_checkpoints(net=)."""
    require_ms_python()
    from sf_models import TWO

    from zckpt.formats.strategy import make_layout
    from zckpt.jobs.generate import write_model
    from zckpt.jobs.generate_model import TensorDef

    split = make_layout(TWO, [[0], []])
    model = write_model(tmp_path / "src", [TensorDef("w.bf16", (8, 4), "BFloat16", split),
                                           TensorDef("w.f32", (6, 4), "Float32", split)], device_num=2)
    full = {"w.bf16": ([8, 4], "bfloat16"), "w.f32": ([6, 4], "float32")}
    files = [str(tmp_path / "src" / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in range(2)]
    theirs, ours = _load_both(tmp_path / "dist", full, {"checkpoint_filenames": files, "predict_strategy": None,
                                                        "train_strategy_filename": str(model.strategy_path)})
    for name in full:
        assert np.array_equal(theirs[name], ours[name]) and np.any(ours[name] != 0), name
    half = {"w.bf16": ([4, 4], "bfloat16"), "w.f32": ([3, 4], "float32")}
    theirs, ours = _load_both(tmp_path / "seg", half, {"ckpt_file_dir": str(tmp_path / "src" / "rank_1")},
                              function="load_segmented_checkpoints")
    for name in half:
        assert np.array_equal(theirs[name], ours[name]) and np.any(ours[name] != 0), name


def test_file_suffix_picks_mindsporess_file(tmp_path: Path) -> None:
    """unified_safetensors' choice of each rank's file, for every form of file_suffix, is
    MindSpore's (its own _collect_safetensor_files asked on the same directory)."""
    require_ms_python()
    from zckpt.core.errors import SourceError
    from zckpt.jobs.unified import collect_rank_files

    names = ["net_rank_0-1_10.safetensors", "net_rank_0-2_20.safetensors", "net_rank_0-12_5.safetensors",
             "net_0-3_30.safetensors", "net_rank_0_3-3_30.safetensors"]
    for r in range(2):
        (tmp_path / f"rank_{r}").mkdir()
        for n in names:
            (tmp_path / f"rank_{r}" / n).write_bytes(b"")
    suffixes = [None, "2_20", "-2_20", "_0-1_10", "0-2_20", "_5", "5", "3_30", "_3-3_30", "1_10_x", "9_99"]
    theirs = run_ms_tool("ms_unified.py", "collect", str(tmp_path), json.dumps(suffixes))
    for suffix in suffixes:
        try:
            ours: object = {str(r): p.name for r, p in collect_rank_files(tmp_path, suffix).items()}
        except SourceError:
            ours = "ValueError"
        assert ours == theirs[str(suffix)], suffix


def test_load_distributed_checkpoint_from_a_store_into_a_cell(tmp_path: Path) -> None:
    """``store=``: the rank's slices read from a zckpt store (chunks only) equal what
    MindSpore's own function loads from the unified directory of the same job. Needs zckpt's
    store readable under MindSpore's numpy 1.26 and the zarr it resolves there."""
    require_ms_python()
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(SRC), store, str(SRC_STRATEGY))
    unified = tmp_path / "unified"
    zckpt.unified_safetensors(str(SRC), str(SRC_STRATEGY), str(unified))
    want = expected_rank(0)
    shapes = {n: (list(a.shape), "float32") for n, a in want.items() if n.startswith("layer")}
    common = {"format": "safetensors", "predict_strategy": str(DST_STRATEGY)}
    tmp_path.joinpath("st").mkdir()
    (tmp_path / "st" / "shapes.json").write_text(json.dumps(shapes))
    (tmp_path / "st" / "args.json").write_text(json.dumps({
        "mindspore": {**common, "unified_safetensors_dir": str(unified)},
        "zckpt": {**common, "store": str(store)}, "out": str(tmp_path / "st")}))
    doc = run_ms_tool("ms_unified.py", "net", str(tmp_path / "st" / "shapes.json"), str(tmp_path / "st" / "args.json"))
    if "skip" in doc:
        pytest.skip(doc["skip"])
    with np.load(tmp_path / "st" / "mindspore.npz") as a, np.load(tmp_path / "st" / "zckpt.npz") as b:
        for name in shapes:
            assert np.array_equal(a[name], b[name]) and np.array_equal(b[name], want[name]), name


def test_unified_directory_equals_mindsporess_with_accu_grads(tmp_path: Path) -> None:
    """Fixture s07 (pipeline, optimizer parallel, ``accu_grads.*`` saved): zckpt's
    unified_safetensors on MindSpore's own safetensors shards writes what MindSpore's does:
    the same files and map, the same hyper_param.safetensors (rank 0's accu_grads shards
    included), the same whole parameters."""
    require_ms_python()
    from conftest import scenario

    d = scenario("s07")
    strategy = str(d / "src" / "strategy_merged.ckpt")
    doc = run_ms_tool("ms_unified.py", "unify", str(d / "src" / "checkpoints"), strategy, str(tmp_path / "ms"))
    theirs, ours = Path(doc["unified"]), tmp_path / "ours"
    zckpt.unified_safetensors(doc["st"], strategy, str(ours))
    assert sorted(p.name for p in ours.iterdir()) == sorted(doc["files"])
    assert json.loads((ours / "param_name_map.json").read_text()) == json.loads(
        (theirs / "param_name_map.json").read_text())
    for name in doc["files"]:
        if not name.endswith(".safetensors"):
            continue
        with open_shard(theirs / name) as a, open_shard(ours / name) as b:
            assert sorted(a.entries) == sorted(b.entries), name
            for n in a.entries:
                assert a.array(n).shape == b.array(n).shape and a.array(n).tobytes() == b.array(n).tobytes(), n
    with open_shard(ours / "hyper_param.safetensors") as hyper:
        assert any(n.startswith("accu_grads.") for n in hyper.entries)
