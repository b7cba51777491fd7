"""End to end on MindSpore's own fixtures: CLI and API output equals dst/expected bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_compare import diff_dirs, diff_files
from conftest import scenario

import zckpt
from zckpt.cli import main as cli_main

# Non-pipeline scenarios whose destination MindSpore compiled (s03 has none, s06/s07 are pipeline).
PLAIN = ["s01", "s02", "s03b", "s04", "s05", "s08", "s09", "s10", "s11", "s14", "s15"]


def _strategy(side: Path) -> str | None:
    f = side / "strategy.ckpt"
    return str(f) if f.is_file() else None


@pytest.mark.parametrize("reader", ["zarr", "dask"])
@pytest.mark.parametrize("sid", PLAIN)
def test_cli_ingest_export_matches_expected(sid: str, reader: str, tmp_path: Path) -> None:
    d = scenario(sid)
    store = tmp_path / "store.zarr"
    args = ["ingest", str(d / "src" / "checkpoints"), "--store", str(store), "--verify-replicas"]
    src = _strategy(d / "src")
    if src:
        args += ["--strategy", src]
    assert cli_main(args) == 0
    exp = ["export", str(store), "--out", str(tmp_path / "out"), "--reader", reader, "--workers", "2"]
    dst = _strategy(d / "dst")
    if dst:
        exp += ["--strategy", dst]
    assert cli_main(exp) == 0
    assert diff_dirs(d / "dst" / "expected", tmp_path / "out") == []


@pytest.mark.parametrize("sid", PLAIN)
def test_api_transform_checkpoints_matches_expected(sid: str, tmp_path: Path) -> None:
    d = scenario(sid)
    zckpt.transform_checkpoints(
        str(d / "src" / "checkpoints"), str(tmp_path / "out"), "checkpoint_", _strategy(d / "src"), _strategy(d / "dst")
    )
    assert diff_dirs(d / "dst" / "expected", tmp_path / "out") == []
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".zckpt")], "temporary store left behind"


@pytest.mark.parametrize("sid", ["s01", "s03b", "s09"])
def test_api_transform_by_rank_with_needed_ranks_only(sid: str, tmp_path: Path) -> None:
    d = scenario(sid)
    src, dst = _strategy(d / "src"), _strategy(d / "dst")
    assert src and dst
    expected = d / "dst" / "expected"
    for rank_dir in sorted(expected.iterdir()):
        rank = int(rank_dir.name.split("_")[1])
        needed = zckpt.rank_list_for_transform(rank, src, dst)
        files = {r: str(d / "src" / "checkpoints" / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in needed}
        out = tmp_path / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"
        zckpt.transform_checkpoint_by_rank(rank, files, str(out), src, dst)
        assert diff_files(sorted(rank_dir.glob("*.ckpt"))[-1], out) == []


def test_cli_subprocess_round_trip(tmp_path: Path) -> None:
    """The installed console entry point, as a user runs it (s09: left-most replication axis + opt shard)."""
    d = scenario("s09")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = [sys.executable, "-m", "zckpt.cli"]
    store = tmp_path / "s.zarr"
    r1 = subprocess.run(
        [*run, "ingest", str(d / "src" / "checkpoints"), "--strategy", str(d / "src" / "strategy.ckpt"),
         "--store", str(store), "--json"],
        capture_output=True, text=True, env=env, check=False,
    )
    assert r1.returncode == 0, r1.stderr
    assert json.loads(r1.stdout)["complete"] is True
    r2 = subprocess.run(
        [*run, "export", str(store), "--strategy", str(d / "dst" / "strategy.ckpt"), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, env=env, check=False,
    )
    assert r2.returncode == 0, r2.stderr
    assert "rank 3" in r2.stdout
    assert diff_dirs(d / "dst" / "expected", tmp_path / "o") == []


def test_s12_unlisted_sharded_tensor_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """MindSpore copies step_table's source shard under the wrong shape; zckpt must refuse."""
    d = scenario("s12")
    store = tmp_path / "store.zarr"
    code = cli_main(["ingest", str(d / "src" / "checkpoints"), "--strategy", str(d / "src" / "strategy.ckpt"),
                     "--store", str(store)])
    err = capsys.readouterr().err
    assert code == 1
    assert "step_table" in err and "checkpoint_" in err
    assert not store.exists()
    with pytest.raises(zckpt.SourceError, match="step_table"):
        zckpt.transform_checkpoints(str(d / "src" / "checkpoints"), str(tmp_path / "out"), "checkpoint_",
                                    str(d / "src" / "strategy.ckpt"), str(d / "dst" / "strategy.ckpt"))
    assert not list((tmp_path / "out").rglob("*.ckpt"))


def test_s03b_16_to_24_which_mindspore_refuses(tmp_path: Path) -> None:
    d = scenario("s03b")
    meta = json.loads((d / "meta.json").read_text())
    assert "refused" in meta["mindspore_transform"]
    zckpt.transform_checkpoints(str(d / "src" / "checkpoints"), str(tmp_path / "o"), "checkpoint_",
                                str(d / "src" / "strategy.ckpt"), str(d / "dst" / "strategy.ckpt"))
    assert len(list((tmp_path / "o").glob("rank_*/*.ckpt"))) == 24
    assert diff_dirs(d / "dst" / "expected", tmp_path / "o") == []

