"""MindSpore's unified safetensors directory (written and read), load-time resharding
(``load_distributed_checkpoint`` without a network) and ``ckpt_to_safetensors`` /
``safetensors_to_ckpt``.

The oracle is the bundled example's ``dst/expected``: the shards MindSpore's own 4-rank
job holds (not produced by any converter), compared byte for byte.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import zckpt
import zckpt.parallel
from zckpt.core.errors import SourceError, UsageError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.opener import open_shard
from zckpt.formats.strategy import read_strategy
from zckpt.formats.unified import HYPER_FILE
from zckpt.jobs.loading import ShardSlicer, read_rank
from zckpt.store.store import Store

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SRC = EXAMPLE / "src" / "checkpoints"
SRC_STRATEGY = EXAMPLE / "src" / "strategy.ckpt"
DST_STRATEGY = EXAMPLE / "dst" / "strategy.ckpt"
EXPECTED = EXAMPLE / "dst" / "expected"
HYPER = {"global_step", "learning_rate", "momentum"}


def expected_rank(rank: int) -> dict[str, np.ndarray]:
    with CkptReader(EXPECTED / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
        return {n: np.array(r.array(n)) for n, e in r.entries.items() if e.kind == "tensor"}


def bits(a: np.ndarray | str) -> bytes:
    assert isinstance(a, np.ndarray)
    return np.ascontiguousarray(a).tobytes()


def assert_rank_file(path: Path, rank: int) -> None:
    """Every tensor of MindSpore's rank ``rank``, same shape and bytes, in ``path``."""
    want = expected_rank(rank)
    with open_shard(path) as r:
        assert set(want) <= set(r.entries), sorted(set(want) - set(r.entries))
        for name, arr in want.items():
            got = r.array(name)
            assert got.shape == arr.shape and bits(got) == bits(arr), (path, name)


@pytest.fixture(scope="module")
def unified(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("unified") / "u"
    zckpt.unified_safetensors(str(SRC), str(SRC_STRATEGY), str(out))
    return out


def test_unified_layout_is_mindsporess(unified: Path) -> None:
    names = sorted(p.name for p in unified.iterdir())
    assert names == ["hyper_param.safetensors", "param_name_map.json", "part0.safetensors"]
    doc = json.loads((unified / "param_name_map.json").read_text())
    assert set(doc) == {"metadata", "weight_map"}
    params = set(read_strategy(SRC_STRATEGY).layouts)
    assert set(doc["weight_map"]) == params and set(doc["weight_map"].values()) == {"part0.safetensors"}
    with open_shard(unified / "part0.safetensors") as part, open_shard(unified / "hyper_param.safetensors") as hyper:
        assert set(part.entries) == params and set(hyper.entries) == HYPER
        assert doc["metadata"]["total_size"] == sum(e.nbytes for e in part.entries.values())
        with CkptReader(SRC / "rank_0" / "checkpoint_0.ckpt") as src:
            for n in HYPER:  # hyper-parameters: rank 0's values, whole
                assert bits(hyper.array(n)) == bits(src.array(n))


def test_unified_parts_split_like_mindspore(tmp_path: Path) -> None:
    """ceil(total / part size) parts, largest tensors first to the lightest part; machine k
    of n writes its share only (machine 1 also the map and the hyper-parameters)."""
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(SRC), store, str(SRC_STRATEGY))
    from zckpt.jobs.unified import unify_store

    smap = read_strategy(SRC_STRATEGY)
    unify_store(store, tmp_path / "all", smap, part_bytes=10_000)
    doc = json.loads((tmp_path / "all" / "param_name_map.json").read_text())
    assert len(set(doc["weight_map"].values())) == 5  # 40320 bytes / 10000
    unify_store(store, tmp_path / "m2", smap, part_bytes=10_000, split_dst_file=(2, 2))
    assert sorted(p.name for p in (tmp_path / "m2").iterdir()) == ["part3.safetensors", "part4.safetensors"]
    renamed = tmp_path / "renamed"
    unify_store(store, renamed, smap, choice_func=lambda n: False if n.startswith("moments.") else "net." + n)
    doc = json.loads((renamed / "param_name_map.json").read_text())
    assert sorted(doc["weight_map"]) == sorted("net." + n for n in smap.layouts if not n.startswith("moments."))


def test_unified_directory_loads_as_mindsporess_ranks(unified: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert zckpt.load_distributed_checkpoint(None, predict_strategy=str(DST_STRATEGY), format="safetensors",
                                             unified_safetensors_dir=str(unified), dst_safetensors_dir=str(out))
    for r in range(4):
        assert_rank_file(out / f"rank_{r}" / "net.safetensors", r)
    zckpt.load_distributed_checkpoint(None, predict_strategy=str(DST_STRATEGY), format="safetensors",
                                      unified_safetensors_dir=str(unified), dst_safetensors_dir=str(tmp_path / "c"),
                                      rank_id=2, output_format="ckpt")
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["rank_2"]
    assert_rank_file(tmp_path / "c" / "rank_2" / "net.ckpt", 2)


def test_unified_directory_is_an_ingest_source(unified: Path, tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(unified), store)  # one full source: no strategy
    zckpt.export(store, tmp_path / "dst", str(DST_STRATEGY))
    for r in range(4):
        assert_rank_file(tmp_path / "dst" / f"rank_{r}" / f"checkpoint_{r}.ckpt", r)


def test_rank_slices_from_shards_and_from_a_store(tmp_path: Path) -> None:
    dst = read_strategy(DST_STRATEGY)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(SRC), store, str(SRC_STRATEGY))
    with ShardSlicer(str(SRC), str(SRC_STRATEGY)) as slicer:
        for r in range(4):
            want = expected_rank(r)
            for source in (slicer, Store.open(store)):
                got = read_rank(source, dst, r, want.__contains__)
                assert set(got) == set(want)
                assert all(bits(got[n]) == bits(want[n]) and got[n].shape == want[n].shape for n in want)


def test_shard_slicer_refuses_missing_regions() -> None:
    files = {r: SRC / f"rank_{r}" / f"checkpoint_{r}.ckpt" for r in range(8) if r != 5}
    with pytest.raises(SourceError):
        ShardSlicer(files, str(SRC_STRATEGY))


def test_load_distributed_checkpoint_refusals(unified: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'format' and 'output_format'"):
        zckpt.load_distributed_checkpoint(None, format="npz")
    with pytest.raises(ValueError, match="unified_safetensors_dir"):
        zckpt.load_distributed_checkpoint(None, format="safetensors")
    with pytest.raises(ValueError, match="checkpoint_filenames must be None"):
        zckpt.load_distributed_checkpoint(None, ["a.ckpt"], format="safetensors", unified_safetensors_dir=str(unified))
    with pytest.raises(ValueError, match="dst_safetensors_dir"):
        zckpt.load_distributed_checkpoint(None, format="safetensors", unified_safetensors_dir=str(unified))
    with pytest.raises(ValueError, match="param_name_map.json"):
        zckpt.load_distributed_checkpoint(None, format="safetensors", unified_safetensors_dir=str(tmp_path),
                                          dst_safetensors_dir=str(tmp_path / "o"))


def test_ckpt_to_safetensors_and_back(tmp_path: Path) -> None:
    st = tmp_path / "st"
    zckpt.ckpt_to_safetensors(str(SRC), str(st), processes_num=2)
    back = tmp_path / "back"
    zckpt.safetensors_to_ckpt(str(st), str(back), name_map={"layer1.weight": "l1"})
    for r in range(8):
        with CkptReader(SRC / f"rank_{r}" / f"checkpoint_{r}.ckpt") as src, \
                open_shard(st / f"rank_{r}" / f"checkpoint_{r}.safetensors") as mid, \
                CkptReader(back / f"rank_{r}" / f"checkpoint_{r}.ckpt") as end:
            for name, e in src.entries.items():
                assert mid.entries[name].ms_type == e.ms_type and bits(mid.array(name)) == bits(src.array(name))
                new = "l1" if name == "layer1.weight" else name
                assert bits(end.array(new)) == bits(src.array(name))
    one = tmp_path / "one"
    zckpt.ckpt_to_safetensors(str(SRC / "rank_3" / "checkpoint_3.ckpt"), str(one), file_name_regex="_3")
    assert [p.name for p in one.iterdir()] == ["checkpoint_3.safetensors"]


def test_file_conversion_refusals(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="valid path"):
        zckpt.ckpt_to_safetensors(str(tmp_path / "absent"))
    with pytest.raises(UsageError, match="must be a directory"):
        zckpt.ckpt_to_safetensors(str(SRC), str(tmp_path / "x.safetensors"))
    with pytest.raises(UsageError, match="must be a .safetensors file"):
        zckpt.safetensors_to_ckpt(str(SRC / "rank_0" / "checkpoint_0.ckpt"))
    with pytest.raises(UsageError, match="starting with 'rank'"):
        zckpt.ckpt_to_safetensors(str(tmp_path))
    with pytest.raises(UsageError, match="regular expression"):
        zckpt.ckpt_to_safetensors(str(SRC / "rank_0" / "checkpoint_0.ckpt"), str(tmp_path), file_name_regex="nomatch")


def test_parallel_namespace_is_mindsporess() -> None:
    for name in ("convert_checkpoints", "convert_checkpoint_by_rank", "rank_list_for_convert", "unified_safetensors",
                 "load_distributed_checkpoint", "transform_checkpoints", "load_segmented_checkpoints"):
        assert callable(getattr(zckpt.parallel, name)), name
    assert zckpt.parallel.rank_list_for_convert(0, str(SRC_STRATEGY), str(DST_STRATEGY)) == \
        zckpt.rank_list_for_transform(0, str(SRC_STRATEGY), str(DST_STRATEGY))


def test_name_map_renames_as_mindspore_does(unified: Path, tmp_path: Path) -> None:
    """``name_map`` is ``{network name: checkpoint name}``; with ``return_param_dict`` the
    slices come back instead of being loaded (no MindSpore needed)."""
    want = expected_rank(1)
    got = zckpt.load_distributed_checkpoint(object(), predict_strategy=str(DST_STRATEGY), format="safetensors",
                                            unified_safetensors_dir=str(unified), rank_id=1,
                                            name_map={"net.l1": "layer1.weight"}, return_param_dict=True)
    assert "layer1.weight" not in got and bits(got["net.l1"]) == bits(want["layer1.weight"])
    assert all(bits(got[n]) == bits(want[n]) for n in want if n != "layer1.weight")
    out = tmp_path / "o"
    zckpt.load_distributed_checkpoint(None, predict_strategy=str(DST_STRATEGY), format="safetensors",
                                      unified_safetensors_dir=str(unified), dst_safetensors_dir=str(out), rank_id=1,
                                      name_map={"net.l1": "layer1.weight"}, output_format="ckpt")
    with CkptReader(out / "rank_1" / "net.ckpt") as r:
        assert "layer1.weight" not in r.entries and bits(r.array("net.l1")) == bits(want["layer1.weight"])


def test_transform_checkpoints_takes_a_unified_directory(unified: Path, tmp_path: Path) -> None:
    zckpt.transform_checkpoints(str(unified), str(tmp_path / "dst"), "checkpoint_", None, str(DST_STRATEGY))
    for r in range(4):
        assert_rank_file(tmp_path / "dst" / f"rank_{r}" / f"checkpoint_{r}.ckpt", r)


def test_unified_safetensors_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="can not be a file"):
        zckpt.unified_safetensors(str(SRC / "rank_0" / "checkpoint_0.ckpt"), str(SRC_STRATEGY), str(tmp_path / "a"))
    mixed = tmp_path / "mixed"
    shutil.copytree(SRC, mixed)
    zckpt.ckpt_to_safetensors(str(mixed / "rank_1" / "checkpoint_1.ckpt"))
    (mixed / "rank_1" / "checkpoint_1.ckpt").unlink()
    with pytest.raises(SourceError, match="both ckpt file and safetensors"):
        zckpt.unified_safetensors(str(mixed), str(SRC_STRATEGY), str(tmp_path / "b"))
    with pytest.raises(UsageError, match="choice_func"):
        zckpt.unified_safetensors(str(SRC), str(SRC_STRATEGY), str(tmp_path / "c"), choice_func=lambda n: 3)
    with pytest.raises(TypeError, match="src_strategy_file"):
        zckpt.unified_safetensors(str(SRC), 5, str(tmp_path / "d"))  # type: ignore[arg-type]


def test_info_names_the_sources_ingest_reads(unified: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zckpt.cli.main import main

    assert main(["info", str(unified)]) == 0
    out = capsys.readouterr().out
    assert "1 rank(s)" in out and "param_name_map.json" in out


def test_hyper_param_holds_rank0s_accu_grads_as_mindspore_writes_them(tmp_path: Path) -> None:
    """MindSpore 2.10's unified_safetensors (``_save_hyper_param``) puts every entry of rank 0's
    file that no part holds into hyper_param.safetensors, as rank 0 saved it: the shards of
    ``accu_grads.*`` (fixture s07: pipeline, optimizer parallel) and of the parameters
    ``choice_func`` drops, under their own names; the parts and the map hold neither."""
    from conftest import scenario

    d = scenario("s07")
    src, strategy = d / "src" / "checkpoints", d / "src" / "strategy_merged.ckpt"
    drop = "moments.layer1.weight"
    zckpt.unified_safetensors(str(src), str(strategy), str(tmp_path / "u"),
                              choice_func=lambda n: n != drop and "net." + n)
    weight_map = json.loads((tmp_path / "u" / "param_name_map.json").read_text())["weight_map"]
    assert not any("accu_grads" in n or n == "net." + drop for n in weight_map)
    with CkptReader(src / "rank_0" / "checkpoint_0.ckpt") as r0, open_shard(tmp_path / "u" / HYPER_FILE) as hyper:
        in_parts = {n for n in r0.entries if "net." + n in weight_map}
        want = sorted(set(r0.entries) - in_parts)
        assert any(n.startswith("accu_grads.") for n in want) and drop in want
        assert sorted(hyper.entries) == want
        for n in want:
            assert hyper.array(n).shape == r0.array(n).shape and bits(hyper.array(n)) == bits(r0.array(n)), n
