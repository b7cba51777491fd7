"""The MindSpore-compatible API's argument checks, open_store, and the plan/info commands."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import zckpt
from zckpt.cli.main import main as cli_main

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SRC = EXAMPLE / "src" / "checkpoints"
SRC_S = str(EXAMPLE / "src" / "strategy.ckpt")
DST_S = str(EXAMPLE / "dst" / "strategy.ckpt")


def _files(ranks: list[int]) -> dict[int, str]:
    return {r: str(SRC / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in ranks}


def test_transform_checkpoint_by_rank_argument_errors(tmp_path: Path) -> None:
    out = str(tmp_path / "o.ckpt")
    with pytest.raises(TypeError, match="checkpoint_files_map"):
        zckpt.transform_checkpoint_by_rank(0, [SRC], out, SRC_S, DST_S)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rank_id"):
        zckpt.transform_checkpoint_by_rank("0", _files([0]), out, SRC_S, DST_S)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="save_checkpoint_file_name"):
        zckpt.transform_checkpoint_by_rank(0, _files([0]), 5, SRC_S, DST_S)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\.ckpt"):
        zckpt.transform_checkpoint_by_rank(0, _files([0]), str(tmp_path / "o.bin"), SRC_S, DST_S)
    with pytest.raises(TypeError, match="src_strategy_file"):
        zckpt.transform_checkpoint_by_rank(0, _files([0]), out, 3, DST_S)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not exist"):
        zckpt.transform_checkpoint_by_rank(0, {0: str(tmp_path / "nope.ckpt")}, out, SRC_S, DST_S)
    with pytest.raises(ValueError, match="dst_strategy_file"):
        zckpt.transform_checkpoint_by_rank(0, _files([0]), out, SRC_S, str(tmp_path / "missing.ckpt"))
    assert not (tmp_path / "o.ckpt").exists()


def test_rank_list_and_transform_checkpoints_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="rank_id"):
        zckpt.rank_list_for_transform(1.0, SRC_S, DST_S)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dst_strategy_file"):
        zckpt.rank_list_for_transform(0, SRC_S, ["x"])  # type: ignore[arg-type]
    assert zckpt.rank_list_for_transform(0, None, DST_S) == [0]
    with pytest.raises(TypeError, match="ckpt_prefix"):
        zckpt.transform_checkpoints(str(SRC), str(tmp_path / "o"), 1, SRC_S, DST_S)  # type: ignore[arg-type]
    with pytest.raises(NotADirectoryError):
        zckpt.transform_checkpoints(str(tmp_path / "none"), str(tmp_path / "o"), "c_", SRC_S, DST_S)
    with pytest.raises(zckpt.ZckptError):
        zckpt.transform_checkpoints(str(tmp_path), str(tmp_path / "o"), "c_", SRC_S, DST_S)


def test_transform_checkpoints_prefix_and_by_rank_missing_ranks(tmp_path: Path) -> None:
    zckpt.transform_checkpoints(str(SRC), str(tmp_path / "o"), "net_", SRC_S, DST_S)
    assert sorted(p.name for p in (tmp_path / "o").glob("rank_*/*.ckpt")) == [f"net_{r}.ckpt" for r in range(4)]
    needed = zckpt.rank_list_for_transform(1, SRC_S, DST_S)
    assert needed == sorted(needed, reverse=True)
    with pytest.raises(zckpt.SourceError, match="none of which is in checkpoint_files_map"):
        zckpt.transform_checkpoint_by_rank(1, _files([0]), str(tmp_path / "r1.ckpt"), SRC_S, DST_S)
    assert not (tmp_path / "r1.ckpt").exists()


def test_open_store_reads_global_values(tmp_path: Path) -> None:
    zckpt.ingest(str(SRC), tmp_path / "s.zarr", SRC_S)
    st = zckpt.open_store(tmp_path / "s.zarr")
    assert st.complete
    names = [e.name for e in st.entries()]
    assert names[:3] == ["layer1.weight", "layer2.weight", "layer2.bias"]
    w = np.asarray(st.array("layer1.weight")[...])
    assert w.shape == (32, 48) and w.dtype == np.float32
    with pytest.raises(zckpt.StoreError, match="not a zarr store"):
        zckpt.open_store(tmp_path)


def test_plan_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["ranks"]) == {"0", "1", "2", "3"}
    for r, ranks in doc["ranks"].items():
        assert ranks == sorted(zckpt.rank_list_for_transform(int(r), SRC_S, DST_S))
    assert cli_main(["plan", "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--rank", "2"]) == 0
    assert capsys.readouterr().out.startswith("destination rank 2: source ranks")


def test_info_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["info", str(SRC / "rank_0" / "checkpoint_0.ckpt"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["type"] == "ckpt" and doc["entries"][0]["name"] == "layer1.weight"
    assert cli_main(["info", SRC_S]) == 0
    assert "layer1.weight" in capsys.readouterr().out
    shutil.copytree(SRC, tmp_path / "src")
    zckpt.ingest(str(tmp_path / "src"), tmp_path / "s.zarr", SRC_S)
    assert cli_main(["info", str(tmp_path / "s.zarr")]) == 0
    assert "complete: True" in capsys.readouterr().out
    assert cli_main(["info", str(tmp_path / "nothing")]) == 1  # a missing path is a refusal, not a usage error


@pytest.mark.parametrize(("args", "what"), [
    (["verify", "STORE", "s3://bucket/src"], "sources"),
    (["verify", "STORE", "--against", "s3://bucket/out"], "exports"),
])
def test_verify_refuses_remote_sources_and_exports_clearly(args: list[str], what: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """verify reads a store at a URL, but compares sources and exports as local files only: a
    URL there gets one clear error (before the store is even opened), not a report about
    paths that do not exist."""
    args = [str(tmp_path / "s.zarr") if a == "STORE" else a for a in args]
    assert cli_main(args) == 1  # a refusal of the input: 2 is for a command line that cannot be read
    err = capsys.readouterr().err
    assert f"reads {what} from local paths only" in err and "is a URL" in err and "s3://bucket/" in err, err
