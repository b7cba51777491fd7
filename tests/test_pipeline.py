"""Pipeline-parallel sources and destinations, per-stage parts, optimizer states, uneven layouts.

MindSpore's fixtures s06/s07 prove the behaviour against real compiled jobs; generated
pipeline jobs cover what MindSpore cannot convert (a destination with another stage count).
"""

from __future__ import annotations

import dataclasses
import glob
from pathlib import Path

import numpy as np
import oracle
import pytest
from ckpt_compare import diff_dirs
from conftest import scenario
from hypothesis import given, settings
from hypothesis import strategies as st

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.core.layout import Box, rank_box, resolve
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.jobs.generate import write_model, write_pipeline_model
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef, global_value

PIPELINE = ["s06", "s07"]


@pytest.mark.parametrize("sid", PIPELINE)
@pytest.mark.parametrize("strategy", ["per-rank dir", "merged file"])
def test_pipeline_fixture_cli(sid: str, strategy: str, tmp_path: Path) -> None:
    d = scenario(sid)
    src = d / "src" / ("strategy" if strategy == "per-rank dir" else "strategy_merged.ckpt")
    store = tmp_path / "s.zarr"
    assert cli_main(["ingest", str(d / "src" / "checkpoints"), "--strategy", str(src), "--store", str(store),
                     "--verify-replicas"]) == 0
    assert cli_main(["export", str(store), "--strategy", str(d / "dst" / "strategy.ckpt"),
                     "--out", str(tmp_path / "o")]) == 0
    assert diff_dirs(d / "dst" / "expected", tmp_path / "o") == []


@pytest.mark.parametrize("sid", PIPELINE)
def test_pipeline_fixture_api(sid: str, tmp_path: Path) -> None:
    d = scenario(sid)
    zckpt.transform_checkpoints(str(d / "src" / "checkpoints"), str(tmp_path / "o"), "checkpoint_",
                                str(d / "src" / "strategy_merged.ckpt"), str(d / "dst" / "strategy.ckpt"))
    assert diff_dirs(d / "dst" / "expected", tmp_path / "o") == []


def _union_of_parts(rank_dir: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    out: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for part in sorted(rank_dir.glob("*_part*.ckpt")):
        with CkptReader(part) as r:
            for name, e in r.entries.items():
                value = (e.ms_type, e.shape, r.array(name).tobytes())
                assert out.setdefault(name, value) == value, f"{name} differs between parts"
    return out


@pytest.mark.parametrize("sid", PIPELINE)
def test_per_stage_parts_api(sid: str, tmp_path: Path) -> None:
    """transform_checkpoints with one stage's strategy file, as MindSpore's tutorial shows."""
    d = scenario(sid)
    files = sorted(glob.glob(str(d / "src" / "strategy" / "*.ckpt")))
    stage_files = [files[0], files[-1]]
    for f in stage_files:
        zckpt.transform_checkpoints(str(d / "src" / "checkpoints"), str(tmp_path / "o"), "checkpoint_", f,
                                    str(d / "dst" / "strategy.ckpt"))
    expected = d / "dst" / "expected"
    for rank_dir in sorted(expected.iterdir()):
        r = int(rank_dir.name.split("_")[1])
        parts = sorted(p.name for p in (tmp_path / "o" / rank_dir.name).iterdir())
        assert parts == [f"checkpoint_{r}_part0.ckpt", f"checkpoint_{r}_part1.ckpt"]
        got = _union_of_parts(tmp_path / "o" / rank_dir.name)
        with CkptReader(next(rank_dir.glob("*.ckpt"))) as e:
            want = {n: (x.ms_type, x.shape, e.array(n).tobytes()) for n, x in e.entries.items()}
        assert got == want


def test_per_stage_cli_from_whole_store(tmp_path: Path) -> None:
    d = scenario("s06")
    store = tmp_path / "s.zarr"
    assert cli_main(["ingest", str(d / "src" / "checkpoints"), "--strategy", str(d / "src" / "strategy"),
                     "--store", str(store)]) == 0
    assert cli_main(["export", str(store), "--strategy", str(d / "dst" / "strategy.ckpt"), "--per-stage",
                     "--out", str(tmp_path / "o")]) == 0
    for rank_dir in sorted((d / "dst" / "expected").iterdir()):
        with CkptReader(next(rank_dir.glob("*.ckpt"))) as e:
            want = {n: (x.ms_type, x.shape, e.array(n).tobytes()) for n, x in e.entries.items()}
        assert _union_of_parts(tmp_path / "o" / rank_dir.name) == want
    verify = ["verify", str(store), "--against", str(tmp_path / "o"),
              "--dst-strategy", str(d / "dst" / "strategy.ckpt")]
    assert cli_main(verify) == 0
    part = sorted((tmp_path / "o").glob("rank_*/*_part1.ckpt"))[0]
    with CkptReader(part) as r:
        name = next(n for n, e in r.entries.items() if e.kind == "tensor" and e.nbytes)
        offset = r.entry(name).segments[0].offset
    data = bytearray(part.read_bytes())
    data[offset] ^= 0x40
    part.write_bytes(bytes(data))
    assert cli_main(verify) == 1
    part.unlink()
    assert cli_main(verify) == 1


@pytest.mark.parametrize("sid", ["s01", "s02", "s05", "s06", "s07", "s08", "s09", "s10", "s11", "s14", "s15"])
def test_store_holds_the_reference_values(sid: str, tmp_path: Path) -> None:
    """Every array of the store equals MindSpore's unsharded reference, pipeline sources included."""
    d = scenario(sid)
    src = d / "src" / "strategy.ckpt"
    strategy = str(src) if src.is_file() else (str(d / "src" / "strategy") if (d / "src" / "strategy").is_dir()
                                                else None)
    zckpt.ingest(str(d / "src" / "checkpoints"), tmp_path / "s.zarr", strategy)
    st = zckpt.open_store(tmp_path / "s.zarr")
    with CkptReader(d / "reference" / "global.ckpt") as ref:
        names = [e.name for e in st.entries()]
        assert set(names) <= set(ref.entries)
        for e in st.entries():
            assert (e.ms_type, e.shape) == (ref.entries[e.name].ms_type, ref.entries[e.name].shape), e.name
            assert np.asarray(st.array(e.name)[...]).tobytes() == ref.array(e.name).tobytes(), e.name


# --------------------------------------------------------------- generated pipeline jobs


def _stages(rng: np.random.Generator, n: int, shared: bool = True) -> list[list[TensorDef]]:
    def t(name: str, shape: tuple[int, ...], ms_type: str) -> TensorDef:
        return TensorDef(name, shape, ms_type, random_layout(rng, shape, n))

    emb = (48, 24)
    s0 = [t("embedding.weight", emb, "Float32"), t("l0.w", (24, 48), "BFloat16"),
          t("moments.l0.w", (24, 48), "Float32")]
    s1 = [t("l1.w", (48, 24), "Float16"), t("l1.b", (24,), "Float32"), t("moments.l1.w", (48, 24), "Float32")]
    if shared:
        s1.append(t("embedding.weight", emb, "Float32"))
    return [s0, s1]


def _expected(name: str, shape: tuple[int, ...], ms_type: str, layouts: dict[str, oracle.Layout], key: str,
              rank: int) -> bytes:
    """Stage-local ``rank``'s slice of ``name`` as ``tests/oracle.py`` cuts it from the raw
    fields of the strategy file's item ``key`` (a merged file's ``<stage>-<name>``), not
    as :mod:`zckpt.core.layout` does; the whole value where the file lists no ``key``."""
    return np.ascontiguousarray(oracle.cut(global_value(name, shape, ms_type), layouts, key, rank)).tobytes()


def test_pipeline_to_pipeline_with_another_stage_count(tmp_path: Path) -> None:
    """2 stages x 4 ranks -> 3 stages x 2 ranks: what MindSpore's per-stage mode cannot do."""
    rng = np.random.default_rng(11)
    model = write_pipeline_model(tmp_path / "src", _stages(rng, 4), stage_device_num=4)
    all_defs = {t.name: t for s in model.stages for t in s}
    dst_stage = {"embedding.weight": [0, 2], "l0.w": [0], "moments.l0.w": [0], "l1.w": [1], "moments.l1.w": [1],
                 "l1.b": [2]}
    layouts: dict[str, dict[int, object]] = {}
    for name, stages in dst_stage.items():
        t = all_defs[name]
        for s in stages:
            layouts.setdefault(name, {})[s] = random_layout(rng, t.shape, 2)
    dst = tmp_path / "dst_strategy.ckpt"
    dst.write_bytes(encode_strategy(StrategyMap(layouts=layouts), merged=True))  # type: ignore[arg-type]
    store = tmp_path / "s.zarr"
    assert cli_main(["ingest", str(tmp_path / "src"), "--strategy", str(model.strategy_dir), "--store", str(store),
                     "--verify-replicas"]) == 0
    assert cli_main(["export", str(store), "--strategy", str(dst), "--out", str(tmp_path / "o")]) == 0
    order = [e.name for e in zckpt.open_store(store).entries()]
    raw = oracle.read_layouts(dst)
    assert set(raw) == {f"{s}-{n}" for n, stages in dst_stage.items() for s in stages}
    for rank in range(6):
        stage = rank // 2
        with CkptReader(tmp_path / "o" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            want = [n for n in all_defs if stage in dst_stage[n]]
            assert [n for n in r.names() if n in all_defs] == [n for n in order if n in want]
            for n in want:
                t = all_defs[n]
                assert r.array(n).tobytes() == _expected(n, t.shape, t.ms_type, raw, f"{stage}-{n}", rank % 2), n
            assert "learning_rate" in r.entries


def test_pipeline_to_none_and_to_plain(tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    model = write_pipeline_model(tmp_path / "src", _stages(rng, 2), stage_device_num=2)
    all_defs = {t.name: t for s in model.stages for t in s}
    zckpt.transform_checkpoints(str(tmp_path / "src"), str(tmp_path / "full"), "c_", str(model.merged_strategy), None)
    with CkptReader(tmp_path / "full" / "rank_0" / "c_0.ckpt") as r:
        for n, t in all_defs.items():
            assert r.array(n).tobytes() == _expected(n, t.shape, t.ms_type, {}, n, 0)
    layouts = {n: {0: random_layout(rng, t.shape, 3)} for n, t in all_defs.items()}
    (tmp_path / "d.ckpt").write_bytes(encode_strategy(StrategyMap(layouts=layouts)))  # type: ignore[arg-type]
    zckpt.transform_checkpoints(str(tmp_path / "src"), str(tmp_path / "o"), "c_", str(model.merged_strategy),
                                str(tmp_path / "d.ckpt"))
    raw = oracle.read_layouts(tmp_path / "d.ckpt")
    assert set(raw) == set(all_defs)
    for rank in range(3):
        with CkptReader(tmp_path / "o" / f"rank_{rank}" / f"c_{rank}.ckpt") as r:
            for n, t in all_defs.items():
                assert r.array(n).tobytes() == _expected(n, t.shape, t.ms_type, raw, n, rank), n


def test_shared_parameter_copies_must_agree(tmp_path: Path) -> None:
    rng = np.random.default_rng(13)
    model = write_pipeline_model(tmp_path / "src", _stages(rng, 2), stage_device_num=2)
    victim = model.rank_files[3]  # a stage-1 rank holding the tied embedding
    with CkptReader(victim) as r:
        seg = r.entries["embedding.weight"].segments[0]
    data = bytearray(victim.read_bytes())
    data[seg.offset + 1] ^= 0x40
    victim.write_bytes(bytes(data))
    with pytest.raises(zckpt.SourceError, match="shared by several pipeline stages") as err:
        zckpt.ingest(str(tmp_path / "src"), tmp_path / "s.zarr", str(model.strategy_dir))
    assert err.value.param == "embedding.weight" and "rank_3" in str(err.value)
    assert not (tmp_path / "s.zarr").exists()


def test_missing_stage_rank_is_named(tmp_path: Path) -> None:
    rng = np.random.default_rng(14)
    model = write_pipeline_model(tmp_path / "src", _stages(rng, 2, shared=False), stage_device_num=2)
    import shutil

    shutil.rmtree(model.rank_files[2].parent)
    with pytest.raises(zckpt.SourceError, match="missing source rank"):
        zckpt.ingest(str(tmp_path / "src"), tmp_path / "s.zarr", str(model.merged_strategy))


# ---------------------------------------------------------------- optimizer states


def test_unlisted_optimizer_state_takes_its_parameters_layout(tmp_path: Path) -> None:
    lay = make_layout((2, 2), [[1], [0]])
    w = TensorDef("w", (8, 6), "Float32", lay)
    m = TensorDef("moments.w", (8, 6), "Float32", lay)
    model = write_model(tmp_path / "src", [w, m], device_num=4)
    smap = StrategyMap(layouts={"w": {0: lay}})  # the state is not listed
    (tmp_path / "s.ckpt").write_bytes(encode_strategy(smap))
    dst = StrategyMap(layouts={"w": {0: make_layout((2,), [[], [0]])}})
    (tmp_path / "d.ckpt").write_bytes(encode_strategy(dst))
    zckpt.ingest(str(tmp_path / "src"), tmp_path / "st.zarr", str(tmp_path / "s.ckpt"))
    entry = zckpt.open_store(tmp_path / "st.zarr").entry("moments.w")
    assert entry.shape == (8, 6) and entry.note and "layout of w" in entry.note
    zckpt.export(tmp_path / "st.zarr", tmp_path / "o", str(tmp_path / "d.ckpt"))
    for r in range(2):
        with CkptReader(tmp_path / "o" / f"rank_{r}" / f"checkpoint_{r}.ckpt") as f:
            box = Box((0, 3 * r), (8, 3 * r + 3))
            assert f.array("moments.w").tobytes() == np.ascontiguousarray(
                global_value("moments.w", (8, 6), "Float32")[box.slices()]).tobytes()
    assert model.strategy_path is not None


def test_unlisted_state_with_unprovable_layout_is_refused(tmp_path: Path) -> None:
    lay = make_layout((2,), [[0], []])
    other = make_layout((2,), [[], [0]])  # the state is really split the other way
    w = TensorDef("w", (8, 8), "Float32", lay)
    m = TensorDef("moments.w", (8, 4), "Float32", other)
    write_model(tmp_path / "src", [w, m], device_num=2)
    (tmp_path / "s.ckpt").write_bytes(encode_strategy(StrategyMap(layouts={"w": {0: lay}})))
    with pytest.raises(zckpt.SourceError, match="not listed") as err:
        zckpt.ingest(str(tmp_path / "src"), tmp_path / "st.zarr", str(tmp_path / "s.ckpt"))
    assert err.value.param == "moments.w"


# ---------------------------------------------------------------- uneven and field layouts


def test_param_split_shape_uneven_rows(tmp_path: Path) -> None:
    """An uneven split of dimension 0 (e.g. a vocabulary of 10 rows over 2 ranks as 6 + 4)."""
    src_lay = make_layout((2,), [[0], []], param_split_shape=[6, 4], indices_offset=[0, 6])
    table = TensorDef("table", (10, 4), "Float32", src_lay)
    gv = global_value("table", (10, 4), "Float32")
    for r, rows in enumerate([(0, 6), (6, 10)]):
        assert rank_box(resolve(src_lay, (10, 4)), r) == Box((rows[0], 0), (rows[1], 4))
    model = write_model(tmp_path / "src", [table], device_num=2)
    dst = StrategyMap(layouts={"table": {0: make_layout((2,), [[], [0]])}})
    (tmp_path / "d.ckpt").write_bytes(encode_strategy(dst))
    zckpt.transform_checkpoints(str(tmp_path / "src"), str(tmp_path / "o"), "c_", str(model.strategy_path),
                                str(tmp_path / "d.ckpt"))
    for r in range(2):
        with CkptReader(tmp_path / "o" / f"rank_{r}" / f"c_{r}.ckpt") as f:
            assert f.array("table").tobytes() == np.ascontiguousarray(gv[:, 2 * r : 2 * r + 2]).tobytes()
    back = StrategyMap(layouts={"table": {0: src_lay}})
    (tmp_path / "back.ckpt").write_bytes(encode_strategy(back))
    zckpt.transform_checkpoints(str(tmp_path / "o"), str(tmp_path / "b"), "c_", str(tmp_path / "d.ckpt"),
                                str(tmp_path / "back.ckpt"))
    with CkptReader(tmp_path / "b" / "rank_1" / "c_1.ckpt") as f:
        assert f.array("table").tobytes() == np.ascontiguousarray(gv[6:]).tobytes()


def test_bad_param_split_shape_is_refused_and_field_ignored() -> None:
    with pytest.raises(zckpt.LayoutError, match="adds up to 9 rows"):
        resolve(make_layout((2,), [[0], []], param_split_shape=[5, 4]), (10, 4))
    with pytest.raises(zckpt.LayoutError, match="3 entries but the layout cuts dimension 0 into 2 pieces"):
        resolve(make_layout((2, 2), [[1], [0]], param_split_shape=[5, 5, 5]), (10, 4))
    with pytest.raises(zckpt.LayoutError, match="running row offsets"):
        resolve(make_layout((2,), [[0], []], param_split_shape=[6, 4], indices_offset=[0, 5]), (10, 4))
    # field (MatMul field_size) does not change a slice (fixture s20; see zckpt.core.layout)
    plain = make_layout((2,), [[0], []])
    field = dataclasses.replace(plain, field_size=39)
    assert [rank_box(resolve(field, (10, 4)), r) for r in range(2)] == [Box((0, 0), (5, 4)), Box((5, 0), (10, 4))]


def _is_subsequence(sub: list[str], seq: list[str]) -> bool:
    it = iter(seq)
    return all(x in it for x in sub)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from("abcdefghijklmnop"), unique=True, max_size=12), st.data())
def test_merge_orders_keeps_both_orders(universe: list[str], data: st.DataObject) -> None:
    from zckpt.plan.entry_order import merge_orders

    first = [x for x in universe if data.draw(st.booleans())]
    second = [x for x in universe if data.draw(st.booleans())]
    merged = merge_orders(first, second)
    assert sorted(merged) == sorted(set(first) | set(second))
    assert _is_subsequence(first, merged) and _is_subsequence(second, merged)


def test_merge_orders_rebuilds_the_network_order() -> None:
    from zckpt.plan.entry_order import merge_orders

    stage0 = ["l1", "l2", "global_step", "lr", "moments.l1", "moments.l2"]
    stage1 = ["l3", "global_step", "lr", "moments.l3"]
    assert merge_orders(stage0, stage1) == ["l1", "l2", "l3", "global_step", "lr", "moments.l1", "moments.l2",
                                            "moments.l3"]


@pytest.mark.mindspore
@pytest.mark.parametrize("sid", PIPELINE)
def test_mindspore_loads_zckpt_parts_as_the_expected_rank(sid: str, tmp_path: Path) -> None:
    """MindSpore's load_segmented_checkpoints on zckpt's per-stage parts gives dst/expected's values."""
    import hashlib
    import json

    from mindspore_env import require_ms_python, run_ms_tool

    require_ms_python()
    d = scenario(sid)
    for f in sorted(glob.glob(str(d / "src" / "strategy" / "*.ckpt")))[:: 2 if sid == "s07" else 4]:
        zckpt.transform_checkpoints(str(d / "src" / "checkpoints"), str(tmp_path / "o"), "checkpoint_", f,
                                    str(d / "dst" / "strategy.ckpt"))
    ranks = sorted((d / "dst" / "expected").iterdir())
    job = tmp_path / "job.json"
    job.write_text(json.dumps([{"dir": str(tmp_path / "o" / r.name)} for r in ranks]))
    loaded = run_ms_tool("ms_segmented_load.py", str(job))
    for rank_dir, result in zip(ranks, loaded, strict=True):
        with CkptReader(next(rank_dir.glob("*.ckpt"))) as e:
            want = {n: {"kind": "tensor", "dtype": x.ms_type, "shape": list(x.shape),
                        "sha256": hashlib.sha256(e.array(n).tobytes()).hexdigest()} for n, x in e.entries.items()}
        assert result.get("entries") == want, rank_dir.name
