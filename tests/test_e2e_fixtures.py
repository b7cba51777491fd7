"""End to end on MindSpore's own fixtures: CLI and API output equals dst/expected bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ckpt_compare import diff_dirs, diff_files, entry_digest
from conftest import scenario

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.formats.ckpt import CkptReader

# Non-pipeline scenarios whose destination MindSpore compiled (s03 has none, s06/s07/s21/s22 are
# pipeline, s12 is refused). s16/s17: multi-axis maps (protobuf / JSON expanded form); s18/s19:
# manual_split table as source / destination; s20: MatMul field_size.
PLAIN = ["s01", "s02", "s03b", "s04", "s05", "s08", "s09", "s10", "s11", "s14", "s15",
         "s16", "s17", "s18", "s19", "s20"]
# Pipeline sources: (per-rank strategy directory, merged file).
PIPELINE = ["s06", "s07", "s21", "s22"]
# Destination entry order that no source file records: MindFormers' AdamW groups the weights
# with decay before the norms across both stages (s22), so only values, not order, are checked.
ORDER_NOT_IN_SOURCES = {"s22"}


def _strategy(side: Path) -> str | None:
    for name in ("strategy.ckpt", "strategy.json"):
        if (side / name).is_file():
            return str(side / name)
    return None


def _same_entries(expected: Path, got: Path) -> list[str]:
    """diff_dirs without the entry order: every rank holds the same names, dtypes, shapes and bytes."""
    problems = []
    for rd in sorted(p for p in expected.iterdir() if p.name.startswith("rank_")):
        rank = int(rd.name.split("_")[1])
        with CkptReader(sorted(rd.glob("*.ckpt"))[-1]) as e, CkptReader(got / rd.name / f"checkpoint_{rank}.ckpt") as g:
            if sorted(e.entries) != sorted(g.entries):
                problems.append(f"{rd.name}: entries {sorted(g.entries)} != {sorted(e.entries)}")
                continue
            problems += [f"{rd.name}: {n}" for n in e.entries if entry_digest(e, n) != entry_digest(g, n)]
    return problems


def _diff(sid: str, expected: Path, got: Path) -> list[str]:
    return _same_entries(expected, got) if sid in ORDER_NOT_IN_SOURCES else diff_dirs(expected, got)


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


@pytest.mark.parametrize("sid", ["s01", "s05", "s09", "s16"])
def test_cli_ingest_export_transform_with_helper_processes_match_expected(sid: str, tmp_path: Path) -> None:
    """Part of the ranks and of the files written by a second process (zckpt.run.helper)."""
    d = scenario(sid)
    store = tmp_path / "store.zarr"
    args = ["ingest", str(d / "src" / "checkpoints"), "--store", str(store), "--helper", "--quiet"]
    src = _strategy(d / "src")
    if src:
        args += ["--strategy", src]
    assert cli_main(args) == 0
    exp = ["export", str(store), "--out", str(tmp_path / "out"), "--helper", "--quiet"]
    dst = _strategy(d / "dst")
    if dst:
        exp += ["--strategy", dst]
    assert cli_main(exp) == 0
    assert diff_dirs(d / "dst" / "expected", tmp_path / "out") == []
    direct = ["transform", str(d / "src" / "checkpoints"), "--out", str(tmp_path / "direct"), "--helper", "--quiet"]
    direct += ["--src-strategy", src] if src else []
    direct += ["--dst-strategy", dst] if dst else []
    assert cli_main(direct) == 0
    assert diff_dirs(d / "dst" / "expected", tmp_path / "direct") == []


@pytest.mark.parametrize("sid", PLAIN)
def test_api_transform_checkpoints_matches_expected(sid: str, tmp_path: Path) -> None:
    d = scenario(sid)
    zckpt.transform_checkpoints(
        str(d / "src" / "checkpoints"), str(tmp_path / "out"), "checkpoint_", _strategy(d / "src"), _strategy(d / "dst")
    )
    assert diff_dirs(d / "dst" / "expected", tmp_path / "out") == []
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".zckpt")], "temporary store left behind"


@pytest.mark.parametrize("sid", ["s01", "s03b", "s09", "s16", "s17", "s18", "s19", "s20"])
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



@pytest.mark.parametrize("strategy", ["per-rank dir", "merged file"])
@pytest.mark.parametrize("sid", PIPELINE)
def test_pipeline_sources_cli_and_api(sid: str, strategy: str, tmp_path: Path) -> None:
    """Pipeline sources through the CLI (ingest + export) and transform_checkpoints."""
    d = scenario(sid)
    src = d / "src" / ("strategy" if strategy == "per-rank dir" else "strategy_merged.ckpt")
    dst = _strategy(d / "dst")
    assert dst
    store = tmp_path / "store.zarr"
    assert cli_main(["ingest", str(d / "src" / "checkpoints"), "--strategy", str(src), "--store", str(store),
                     "--verify-replicas", "--quiet"]) == 0
    assert cli_main(["export", str(store), "--strategy", dst, "--out", str(tmp_path / "cli"), "--quiet"]) == 0
    assert _diff(sid, d / "dst" / "expected", tmp_path / "cli") == []
    zckpt.transform_checkpoints(str(d / "src" / "checkpoints"), str(tmp_path / "api"), "checkpoint_", str(src), dst)
    assert _diff(sid, d / "dst" / "expected", tmp_path / "api") == []


# s03 (8 -> 3) has no MindSpore destination: its store is checked here; s12 is refused (above).
SET2 = ["s16", "s17", "s18", "s19", "s20", "s21", "s22"]


@pytest.mark.parametrize("sid", ["s03", *SET2])
def test_store_equals_mindspore_reference(sid: str, tmp_path: Path) -> None:
    """Every array ingest stores equals the stand-alone job's unsharded value (reference/global.ckpt);
    accu_grads.* (pipeline only) are checked by the export tests, the reference has none."""
    d = scenario(sid)
    src = _strategy(d / "src") or (str(d / "src" / "strategy") if (d / "src" / "strategy").is_dir() else None)
    zckpt.ingest(str(d / "src" / "checkpoints"), tmp_path / "s.zarr", src)
    st = zckpt.open_store(tmp_path / "s.zarr")
    compared = 0
    with CkptReader(d / "reference" / "global.ckpt") as ref:
        for e in st.entries():
            if e.name not in ref.entries:
                assert e.name.startswith("accu_grads."), e.name
                continue
            r = ref.entries[e.name]
            assert (e.ms_type, e.shape) == (r.ms_type, r.shape), e.name
            if e.kind == "tensor":
                assert np.asarray(st.array(e.name)[...]).tobytes() == ref.array(e.name).tobytes(), e.name
                compared += 1
    assert compared > 0


@pytest.mark.parametrize("sid", SET2)
def test_direct_transform_cli_matches_expected(sid: str, tmp_path: Path) -> None:
    """The direct path (``zckpt transform``, no store) on the layout kinds of set 2."""
    d = scenario(sid)
    src = _strategy(d / "src") or str(d / "src" / "strategy")
    dst = _strategy(d / "dst")
    assert dst
    assert cli_main(["transform", str(d / "src" / "checkpoints"), "--src-strategy", src, "--dst-strategy", dst,
                     "--out", str(tmp_path / "o"), "--quiet"]) == 0
    assert _diff(sid, d / "dst" / "expected", tmp_path / "o") == []
