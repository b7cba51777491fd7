"""MindFormers' per-iteration checkpoints as a source (no strategy file: metadata.json says it).

The iterations are written by ``tests/mindformers_writer.py``, a port of MindFormers 2.1's
writer (metadata layouts from MindSpore's ``_layout_process``, chunks as slice numbers,
``storage_data``, file names, ``common.json``). The rank files hold what MindSpore puts on each
rank: generated values cut by ``tests/oracle.py`` (optimizer parallel included), or the
shards MindSpore itself saved in fixture s22 (a MindFormers Qwen3 with pipeline and
optimizer parallel). Expected values: :func:`zckpt.jobs.generate_model.global_value`, s22's
``reference/global.ckpt`` and the bundled example's ``dst/expected``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import scenario
from mindformers_writer import MsParam, write_iteration
from oracle import read_layouts
from test_unified_loading import DST_STRATEGY, SRC, SRC_STRATEGY, assert_rank_file

import zckpt
from zckpt.core.errors import CheckpointFormatError, StrategyError
from zckpt.formats.ckpt import CkptReader
from zckpt.jobs.generate_model import global_value

DP4_MP2 = (4, 2)  # axis 1 = dp (4), axis 0 = mp (2)


def _opt_job() -> list[MsParam]:
    """8 ranks, dp 4 x mp 2, optimizer parallel full (-1), partial (2) and off."""
    weights = [
        MsParam("layer.w1", (16, 8), DP4_MP2, ((0,), (-1,)), -1),
        MsParam("layer.w2", (8, 16), DP4_MP2, ((-1,), (0,)), 2),
        MsParam("layer.bias", (16,), DP4_MP2, ((-1,),), 0),
        MsParam("layer.norm", (8,), DP4_MP2, ((-1,),), -1),
        MsParam("layer.scale", (4,), DP4_MP2, ((-1,),), 0, layout=False),
    ]
    states = [MsParam(f"{s}.{p.name}", p.shape, p.dev_matrix, p.tensor_map, p.opt_weight_shard_size, optimizer=True)
              for p in weights[:4] for s in ("adam_m", "adam_v")]
    return weights + states


def _pipeline_job() -> list[MsParam]:
    """2 stages of 4 ranks (dp 2 x mp 2), optimizer parallel on the second stage."""
    s0, s1 = (0, 1, 2, 3), (4, 5, 6, 7)
    return [MsParam("s0.w", (8, 8), (2, 2), ((1,), (0,)), 0, s0),
            MsParam("s1.w", (8, 8), (2, 2), ((0,), (-1,)), -1, s1),
            MsParam("adam_m.s1.w", (8, 8), (2, 2), ((0,), (-1,)), -1, s1, optimizer=True)]


def _step(value: int) -> dict[str, np.ndarray]:
    return {"global_step": np.array([value], np.int32)}


def _check_store(store: Path, params: list[MsParam]) -> None:
    st = zckpt.open_store(store)
    for p in params:
        got = np.asarray(st.array(p.name)[...])
        assert got.shape == p.shape and np.array_equal(got, global_value(p.name, p.shape, p.ms_type)), p.name


@pytest.mark.parametrize("balanced", [False, True])
def test_optimizer_parallel_iteration(tmp_path: Path, balanced: bool) -> None:
    params = _opt_job()
    it = write_iteration(tmp_path / "checkpoint", params, 8, balanced=balanced, extra_opt=_step(10), prefix="qwen")
    meta = json.loads((it / "metadata.json").read_text())["state_dict_metadata"]
    assert meta["layer.w1"]["layout"]["tensor_map"] == [[0, 1], -1]  # the optimizer split, folded by MindSpore
    assert meta["layer.w1"]["chunk"][0] == {"global_offset": [0], "local_shape": [2, 8]}
    zckpt.ingest(str(tmp_path / "checkpoint"), tmp_path / "s.zarr")
    _check_store(tmp_path / "s.zarr", params)
    st = zckpt.open_store(tmp_path / "s.zarr")
    common = {e.name: (e.ms_type, e.shape) for e in st.entries() if "." not in e.name}
    assert common == {"global_step": ("Int32", (1,)), "epoch_num": ("Int64", ()), "step_num": ("Int64", ()),
                      "loss_scale": ("Float32", ()), "global_batch_size": ("Int64", ()),
                      "consumed_samples": ("Int64", ())}
    assert st.array("loss_scale")[...] == np.float32(1024.0) and st.array("consumed_samples")[...] == 80
    assert st.array("global_step")[...].tolist() == [10]


def test_balanced_files_belong_to_their_storage_rank(tmp_path: Path) -> None:
    """With redundancy removed, file numbers count saving ranks: metadata's storage_rank decides."""
    params = [p for p in _opt_job() if p.name.endswith(("layer.bias", "layer.w2"))]  # replicated pieces only
    it = write_iteration(tmp_path / "c", params, 8, balanced=True)
    from zckpt.formats.mindformers import rank_file_sets

    zckpt.ingest(str(tmp_path / "c"), tmp_path / "s.zarr")
    _check_store(tmp_path / "s.zarr", params)
    doc = json.loads((it / "metadata.json").read_text())["storage_data"]
    owners = {rec["file_name"]: rec["storage_rank"] for recs in doc.values() for rec in recs}
    sets = rank_file_sets(it)
    assert any(int(f.split("-")[1]) != r for f, r in owners.items())  # a file numbered unlike its rank
    assert all(it / f in sets[r] for f, r in owners.items())


def test_pipeline_iteration_and_common_json(tmp_path: Path) -> None:
    params = _pipeline_job()
    write_iteration(tmp_path / "checkpoint", params, 8, step=30, loss_scale=None)
    zckpt.ingest(str(tmp_path / "checkpoint"), tmp_path / "s.zarr")
    _check_store(tmp_path / "s.zarr", params)
    names = {e.name for e in zckpt.open_store(tmp_path / "s.zarr").entries()}
    assert "loss_scale" not in names and "ckpt_status" not in names  # null in common.json
    assert zckpt.open_store(tmp_path / "s.zarr").array("global_step")[...].tolist() == [30]


def test_a_file_value_that_contradicts_common_json_is_refused(tmp_path: Path) -> None:
    write_iteration(tmp_path / "checkpoint", _opt_job(), 8, extra_opt=_step(9))  # common.json says 10
    with pytest.raises(CheckpointFormatError, match="common.json says") as err:
        zckpt.ingest(str(tmp_path / "checkpoint"), tmp_path / "s.zarr")
    assert err.value.param == "global_step"


def test_chunks_that_contradict_the_layout_are_refused(tmp_path: Path) -> None:
    it = write_iteration(tmp_path / "checkpoint", _opt_job(), 8)
    doc = json.loads((it / "metadata.json").read_text())
    doc["state_dict_metadata"]["layer.w2"]["chunk"][0]["local_shape"][0] //= 2  # an optimizer split not stated
    (it / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(StrategyError, match="not a piece of its layout") as err:
        zckpt.ingest(str(it), tmp_path / "s.zarr")
    assert err.value.param == "layer.w2"
    doc["state_dict_metadata"]["layer.w2"]["chunk"][0]["local_shape"][0] *= 2
    doc["state_dict_metadata"]["layer.w1"]["chunk"][0]["global_offset"] = [0, 0]  # per-dim offsets: not MindFormers'
    (it / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(StrategyError, match="slice") as err:
        zckpt.ingest(str(it), tmp_path / "t.zarr")
    assert err.value.param == "layer.w1"


def test_tracker_picks_the_iteration(tmp_path: Path) -> None:
    root = tmp_path / "checkpoint"
    write_iteration(root, _pipeline_job(), 8, step=10)
    (root / "iteration_00000020").mkdir()  # a later, incomplete save: the tracker says 10
    zckpt.ingest(str(root), tmp_path / "s.zarr")
    (root / "latest_checkpointed_iteration.txt").write_text("30")
    with pytest.raises(ValueError, match="iteration '30'"):
        zckpt.ingest(str(root), tmp_path / "t.zarr")


def _example_job() -> list[MsParam]:
    """The bundled example's 8-rank layouts, as MindSpore's compiler would report them."""
    out = []
    with CkptReader(SRC / "rank_0" / "checkpoint_0.ckpt") as r0:
        for name, lay in read_layouts(SRC_STRATEGY).items():
            dev = lay["dev"]
            assert lay["opt"] == 0  # no optimizer split: the global shape is the shard times its pieces
            pieces = [math.prod(dev[len(dev) - 1 - a] for a in axes if a >= 0) for axes in lay["map"]]
            shape = tuple(s * n for s, n in zip(r0.entries[name].shape, pieces, strict=True))
            out.append(MsParam(name, shape, tuple(dev), tuple(tuple(a) for a in lay["map"]), lay["opt"],
                               optimizer=not name.startswith("layer")))
    return out


def _example_shards(p: MsParam, rank: int) -> np.ndarray:
    with CkptReader(SRC / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
        return r.array(p.name).copy()


def _example_extra(rank: int) -> dict[str, np.ndarray]:
    listed = set(read_layouts(SRC_STRATEGY))
    with CkptReader(SRC / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
        return {n: r.array(n).copy() for n, e in r.entries.items() if n not in listed and e.kind == "tensor"}


@pytest.mark.parametrize("balanced", [False, True])
def test_mindsporess_own_shards_give_its_destination(tmp_path: Path, balanced: bool) -> None:
    """The example's MindSpore-written shards saved as MindFormers does: MindSpore's 4-rank
    destination (``dst/expected``) through a store and through transform_checkpoints."""
    write_iteration(tmp_path / "checkpoint", _example_job(), 8, balanced=balanced, shards=_example_shards,
                    extra_opt=_example_extra, step=1, global_step=0)
    zckpt.ingest(str(tmp_path / "checkpoint"), tmp_path / "s.zarr")
    zckpt.export(tmp_path / "s.zarr", tmp_path / "dst", str(DST_STRATEGY))
    zckpt.transform_checkpoints(str(tmp_path / "checkpoint"), str(tmp_path / "api"), "checkpoint_", None,
                                str(DST_STRATEGY))
    for r in range(4):
        assert_rank_file(tmp_path / "dst" / f"rank_{r}" / f"checkpoint_{r}.ckpt", r)
        assert_rank_file(tmp_path / "api" / f"rank_{r}" / f"checkpoint_{r}.ckpt", r)


def test_mindformers_qwen3_s22_shards(tmp_path: Path) -> None:
    """Fixture s22 (MindFormers 2.1 Qwen3, 2 pipeline stages x 2 ranks, optimizer parallel on the
    norms, MindSpore-sliced shards) saved as MindFormers 2.1 saves it (no ``accu_grads.*``:
    they belong to the train wrapper, not to a saved cell): the store equals the stand-alone
    job's values (``reference/global.ckpt``)."""
    d = scenario("s22")
    params: list[MsParam] = []
    for rank in range(4):
        stage = (rank // 2 * 2, rank // 2 * 2 + 1)
        for name, lay in read_layouts(d / "src" / "strategy" / f"strategy_{rank}.ckpt").items():
            if name.startswith("accu_grads.") or any(p.name == name for p in params):
                continue
            with CkptReader(d / "reference" / "global.ckpt") as ref:
                shape, ms_type = ref.entries[name].shape, ref.entries[name].ms_type
            params.append(MsParam(name, shape, tuple(lay["dev"]), tuple(tuple(a) for a in lay["map"]), lay["opt"],
                                  stage, optimizer=name.startswith(("adam_m.", "adam_v.")), ms_type=ms_type))

    def shards(p: MsParam, rank: int) -> np.ndarray:
        with CkptReader(d / "src" / "checkpoints" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            return r.array(p.name).copy()

    def extra(rank: int) -> dict[str, np.ndarray]:
        with CkptReader(d / "src" / "checkpoints" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            return {"global_step": r.array("global_step").copy()}

    write_iteration(tmp_path / "checkpoint", params, 4, shards=shards, extra_opt=extra, step=1, global_step=0)
    zckpt.ingest(str(tmp_path / "checkpoint"), tmp_path / "s.zarr")
    st = zckpt.open_store(tmp_path / "s.zarr")
    assert any(p.opt_weight_shard_size for p in params)
    with CkptReader(d / "reference" / "global.ckpt") as ref:
        for p in params:
            assert np.asarray(st.array(p.name)[...]).tobytes() == ref.array(p.name).tobytes(), p.name


@pytest.mark.mindspore
def test_layout_port_is_mindsporess(tmp_path: Path) -> None:
    """mindformers_writer.layout_process gives what MindSpore's own _layout_process reports, for
    the optimizer-shard kinds of the jobs above and s22's (full, partial with a split axis, off)."""
    from mindformers_writer import layout_process
    from mindspore_env import run_ms_tool

    cases = {f"{p.name}/{i}": p for i, p in enumerate(_opt_job() + _pipeline_job()) if p.layout}
    cases["s22.norm"] = MsParam("n", (64,), (1, 1, 2), ((-1,),), -1, (2, 3))
    cases["partial.inner"] = MsParam("x", (16, 4), (2, 4, 2), ((0,), (-1,)), 2)
    cases["partial.outer"] = MsParam("x", (16, 4), (4, 2, 2), ((-1,), (0,)), 4)
    spec = {c: {"dev_matrix": p.dev_matrix, "tensor_map": p.tensor_map, "opt": p.opt_weight_shard_size,
                "rank_list": list(p.rank_list) or list(range(math.prod(p.dev_matrix)))} for c, p in cases.items()}
    (tmp_path / "cases.json").write_text(json.dumps(spec))
    theirs = run_ms_tool("ms_layouts.py", str(tmp_path / "cases.json"))
    for case, p in cases.items():
        assert json.loads(json.dumps(layout_process(p))) == theirs[case], case


def test_a_rank_loads_straight_from_an_iteration(tmp_path: Path) -> None:
    """load_distributed_checkpoint's reader (ShardSlicer): each destination rank's slices read
    straight from the iteration's files (saved with redundancy removed)."""
    from zckpt.formats.strategy import read_strategy
    from zckpt.jobs.loading import ShardSlicer, plan_rank, write_rank_file

    it = write_iteration(tmp_path / "checkpoint", _example_job(), 8, shards=_example_shards,
                         extra_opt=_example_extra, step=20, global_step=0, balanced=True)
    with ShardSlicer(str(it), None) as slicer:
        for r in range(4):
            entries = plan_rank(slicer, read_strategy(DST_STRATEGY), r, lambda _: True)
            write_rank_file(entries, slicer.read, tmp_path / "out" / f"{r}.safetensors", "safetensors")
            assert_rank_file(tmp_path / "out" / f"{r}.safetensors", r)
