"""The silent cases of source discovery, refused or made explicit (issue 14, deliverable 5).

* Without a source strategy rank_0 is the full model: other rank files must be the same
  model byte for byte, else ingest refuses naming a parameter that differs and the ranks.
* A rank directory holding several checkpoint files: MindSpore's choice, reported (text and
  JSON), ``file_suffix`` to choose, and a refusal where MindSpore's rules would be a guess.

MindSpore's own ``_collect_safetensor_files`` is the oracle for the selection rules when its
virtualenv is present (``ZCKPT_MS_PYTHON``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from mindspore_env import run_ms_tool

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.core.errors import SourceError, UsageError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.ckpt_writer import CkptWriter
from zckpt.formats.rank_files import choose_rank_file
from zckpt.jobs.ingest import IngestOptions
from zckpt.store.store import Store

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SHARDED = EXAMPLE / "src" / "checkpoints"  # MindSpore's 8 ranks, each a different shard


def _model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((64, 8)).astype(np.float32),
        "b": rng.standard_normal(8).astype(np.float32),
        "moment1.w": rng.standard_normal((64, 8)).astype(np.float32),
        "global_step": np.array(7, np.int32),
    }


def _write(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    types = {np.dtype(np.float32): "Float32", np.dtype(np.int32): "Int32"}
    with CkptWriter(path) as w:
        for name, a in tensors.items():
            w.write_array(name, types[a.dtype], a)
    return path


def _job(root: Path, models: list[dict[str, np.ndarray]]) -> Path:
    for r, m in enumerate(models):
        _write(root / f"rank_{r}" / f"checkpoint_{r}.ckpt", m)
    return root


def _store_values(store: Path) -> dict[str, bytes]:
    st = Store.open(store)
    return {e.name: np.asarray(st.array(e.name)[...]).tobytes() for e in st.entries() if e.kind == "tensor"}


# --- no strategy: rank_0 is the full model -------------------------------------------------

def test_sharded_job_without_strategy_refused_naming_a_parameter(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SourceError, match="pass the source strategy") as info:
        zckpt.ingest(str(SHARDED), tmp_path / "s.zarr")
    err = info.value
    assert err.param is not None and err.path is not None
    other = Path(err.path)
    rank = int(other.parent.name.split("_")[1])
    assert rank != 0 and f"rank {rank}" in err.message and "rank_0" in err.message
    with CkptReader(SHARDED / "rank_0" / "checkpoint_0.ckpt") as a, CkptReader(other) as b:
        ea, eb = a.entries[err.param], b.entries[err.param]
        differs = ea.shape != eb.shape or a.array(err.param).tobytes() != b.array(err.param).tobytes()
    assert differs  # the parameter named really differs between the two files named
    assert not (tmp_path / "s.zarr").exists()
    assert cli_main(["ingest", str(SHARDED), "--store", str(tmp_path / "c.zarr")]) == 1
    assert f"parameter {err.param!r}" in capsys.readouterr().err


def test_identical_ranks_without_strategy_accepted_and_reported(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    m = _model()
    src = _job(tmp_path / "dp", [m, m, m, m])  # data parallel: every rank saves the same model
    report = zckpt.ingest(str(src), tmp_path / "s.zarr")
    assert report.complete and report.same_as_rank0 == (1, 2, 3) and report.ignored_ranks == ()
    assert _store_values(tmp_path / "s.zarr") == {n: a.tobytes() for n, a in m.items()}
    assert cli_main(["ingest", str(src), "--store", str(tmp_path / "c.zarr"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["same_as_rank0"] == [1, 2, 3]
    assert cli_main(["ingest", str(src), "--store", str(tmp_path / "d.zarr")]) == 0
    assert "[1, 2, 3] hold the same entries and bytes as rank_0" in capsys.readouterr().out


def test_rank0_alone_without_strategy(tmp_path: Path) -> None:
    m = _model()
    report = zckpt.ingest(str(_job(tmp_path / "one", [m])), tmp_path / "s.zarr")
    assert report.complete and report.same_as_rank0 == ()
    assert _store_values(tmp_path / "s.zarr") == {n: a.tobytes() for n, a in m.items()}


@pytest.mark.parametrize("change", ["last_row", "signed_zero", "extra_entry", "missing_entry", "shape"])
def test_any_difference_refused(tmp_path: Path, change: str) -> None:
    """A difference in the last block of the last rank, invisible to a value comparison
    (-0.0 == 0.0), or in the headers: always refused, naming the parameter and the rank."""
    m = _model()
    odd = {n: a.copy() for n, a in m.items()}
    param = "moment1.w"
    if change == "last_row":
        odd[param][-1, -1] = np.nextafter(odd[param][-1, -1], np.float32(np.inf))
    elif change == "signed_zero":
        m[param][-1, -1] = 0.0
        odd[param][-1, -1] = -0.0
    elif change == "extra_entry":
        param = "adam_v.w"
        odd[param] = np.zeros(3, np.float32)
    elif change == "missing_entry":
        del odd[param]
    else:
        odd[param] = odd[param][:32]
    src = _job(tmp_path / "j", [m, m, m, odd])
    # blocks of 256 bytes: the last row of moment1.w is in its last block
    with pytest.raises(SourceError, match="rank 3") as info:
        zckpt.ingest(str(src), tmp_path / "s.zarr", options=IngestOptions(block_bytes=512))
    assert info.value.param == param
    assert Path(str(info.value.path)).parent.name == "rank_3"


def test_choice_func_limits_what_is_compared_and_stored(tmp_path: Path) -> None:
    m = _model()
    odd = {**m, "moment1.w": m["moment1.w"] + 1}
    src = _job(tmp_path / "j", [m, odd])
    keep = lambda name: not name.startswith("moment1.")  # noqa: E731
    report = zckpt.ingest(str(src), tmp_path / "s.zarr", options=IngestOptions(choice_func=keep))
    assert report.same_as_rank0 == (1,)
    assert set(_store_values(tmp_path / "s.zarr")) == {"w", "b", "global_step"}
    with pytest.raises(UsageError, match="must return a bool"):
        zckpt.ingest(str(src), tmp_path / "t.zarr", options=IngestOptions(choice_func=lambda n: n.upper()))  # type: ignore[arg-type,return-value]


def test_prefix_options_are_choice_func_on_the_command_line(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    m = _model()
    src = _job(tmp_path / "j", [m, {**m, "moment1.w": m["moment1.w"] + 1}])
    assert cli_main(["ingest", str(src), "--store", str(tmp_path / "s.zarr"), "--filter-prefix", "moment1."]) == 0
    assert set(_store_values(tmp_path / "s.zarr")) == {"w", "b", "global_step"}
    assert cli_main(["ingest", str(src), "--store", str(tmp_path / "t.zarr"), "--specify-prefix", "w",
                     "--specify-prefix", "b"]) == 0
    assert set(_store_values(tmp_path / "t.zarr")) == {"w", "b"}
    assert cli_main(["verify", str(tmp_path / "t.zarr"), str(src), "--specify-prefix", "w",
                     "--specify-prefix", "b"]) == 0
    capsys.readouterr()
    assert cli_main(["verify", str(tmp_path / "t.zarr"), str(src)]) == 1  # unfiltered: rank 1 differs
    assert "rank_0 and rank 1 hold different values" in capsys.readouterr().out


# --- several files in a rank directory --------------------------------------------------------

def _saved_twice(root: Path, names: tuple[str, str], ranks: int = 2) -> list[dict[str, np.ndarray]]:
    """Every rank directory holds two checkpoints (two steps, different values)."""
    models = [_model(1), _model(2)]
    for r in range(ranks):
        for name, m in zip(names, models, strict=True):
            _write(root / f"rank_{r}" / name, m)
    return models


def test_modelcheckpoint_names_refused_where_mindspore_would_take_the_older(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """net-9_100.ckpt sorts after net-10_100.ckpt: MindSpore would take step 9."""
    older, newer = _saved_twice(tmp_path / "j", ("net-9_100.ckpt", "net-10_100.ckpt"))
    with pytest.raises(SourceError, match="file-suffix") as info:
        zckpt.ingest(str(tmp_path / "j"), tmp_path / "s.zarr")
    assert "net-9_100.ckpt" in info.value.message and "net-10_100.ckpt" in info.value.message
    report = zckpt.ingest(str(tmp_path / "j"), tmp_path / "s.zarr", options=IngestOptions(file_suffix="10_100"))
    assert {r: c.name for r, c in report.file_choices.items()} == {0: "net-10_100.ckpt", 1: "net-10_100.ckpt"}
    assert _store_values(tmp_path / "s.zarr") == {n: a.tobytes() for n, a in newer.items()}
    report = zckpt.ingest(str(tmp_path / "j"), tmp_path / "o.zarr", options=IngestOptions(file_suffix="-9_100"))
    assert _store_values(tmp_path / "o.zarr") == {n: a.tobytes() for n, a in older.items()}
    args = ["ingest", str(tmp_path / "j"), "--file-suffix", "10_100", "--store"]
    assert cli_main([*args, str(tmp_path / "c.zarr")]) == 0
    out = capsys.readouterr().out
    assert f"rank 0: chose {tmp_path / 'j' / 'rank_0' / 'net-10_100.ckpt'} among 2 files" in out
    assert cli_main([*args, str(tmp_path / "d.zarr"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["file_choices"]["1"]["file"] == "net-10_100.ckpt"
    assert doc["file_choices"]["1"]["candidates"] == ["net-10_100.ckpt", "net-9_100.ckpt"]
    assert doc["rank_files"]["1"].endswith("rank_1/net-10_100.ckpt")


def test_unambiguous_choice_among_several_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, newer = _saved_twice(tmp_path / "j", ("net-1_100.ckpt", "net-2_100.ckpt"))
    report = zckpt.ingest(str(tmp_path / "j"), tmp_path / "s.zarr")
    assert {r: c.name for r, c in report.file_choices.items()} == {0: "net-2_100.ckpt", 1: "net-2_100.ckpt"}
    assert _store_values(tmp_path / "s.zarr") == {n: a.tobytes() for n, a in newer.items()}
    assert cli_main(["ingest", str(tmp_path / "j"), "--store", str(tmp_path / "c.zarr")]) == 0
    assert "rank 1: chose " in capsys.readouterr().out
    assert cli_main(["info", str(tmp_path / "j"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["file_choices"]["1"]["candidates"] == ["net-1_100.ckpt", "net-2_100.ckpt"]
    # a single file per directory: nothing to report
    m = _model()
    report = zckpt.ingest(str(_job(tmp_path / "k", [m, m])), tmp_path / "t.zarr")
    assert report.file_choices == {} and set(report.rank_files) == {0, 1}


def test_ranks_from_different_steps_refused(tmp_path: Path) -> None:
    _saved_twice(tmp_path / "j", ("net-1_5.ckpt", "net-2_5.ckpt"))
    (tmp_path / "j" / "rank_1" / "net-2_5.ckpt").unlink()  # rank 1 stopped saving earlier
    with pytest.raises(SourceError, match="different training steps"):
        zckpt.ingest(str(tmp_path / "j"), tmp_path / "s.zarr")
    report = zckpt.ingest(str(tmp_path / "j"), tmp_path / "s.zarr", options=IngestOptions(file_suffix="1_5"))
    assert report.complete


def test_file_suffix_matching_nothing_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _saved_twice(tmp_path / "j", ("net-1_5.ckpt", "net-2_5.ckpt"))
    with pytest.raises(SourceError, match="no .ckpt file ends with"):
        zckpt.ingest(str(tmp_path / "j"), tmp_path / "s.zarr", options=IngestOptions(file_suffix="3_5"))
    with pytest.raises(UsageError, match="does not apply"):
        zckpt.ingest({0: str(tmp_path / "j" / "rank_0" / "net-1_5.ckpt")}, tmp_path / "s.zarr",
                     options=IngestOptions(file_suffix="1_5"))


def test_verify_reports_the_chosen_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _saved_twice(tmp_path / "j", ("net-9_100.ckpt", "net-10_100.ckpt"))
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "j"), store, options=IngestOptions(file_suffix="10_100"))
    assert cli_main(["verify", str(store), str(tmp_path / "j"), "--file-suffix", "10_100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["source_file_choices"]["0"]["file"].endswith("rank_0/net-10_100.ckpt")
    # the other step is a mismatch, and without a suffix the choice is refused, not guessed
    assert cli_main(["verify", str(store), str(tmp_path / "j"), "--file-suffix", "9_100"]) == 1
    assert "bytes differ" in capsys.readouterr().out
    assert cli_main(["verify", str(store), str(tmp_path / "j")]) == 1
    assert "file-suffix" in capsys.readouterr().out


def test_transform_checkpoints_refuses_the_ambiguous_directory(tmp_path: Path) -> None:
    shutil.copytree(SHARDED, tmp_path / "src")
    rank3 = tmp_path / "src" / "rank_3"
    shutil.copy(rank3 / "checkpoint_3.ckpt", rank3 / "checkpoint_3_old.ckpt")  # a backup copy beside it
    args = (str(tmp_path / "src"), str(tmp_path / "dst"), "checkpoint_", str(EXAMPLE / "src" / "strategy.ckpt"),
            str(EXAMPLE / "dst" / "strategy.ckpt"))
    with pytest.raises(SourceError, match="checkpoint_3_old.ckpt"):
        zckpt.transform_checkpoints(*args)
    for r in range(8):  # the job saved at step 9 and, in other bytes, at step 10
        rank = tmp_path / "src" / f"rank_{r}"
        for f in rank.iterdir():
            f.unlink()
        shutil.copy(SHARDED / f"rank_{r}" / f"checkpoint_{r}.ckpt", rank / "net-9_1.ckpt")
        shutil.copy(SHARDED / f"rank_{(r + 1) % 8}" / f"checkpoint_{(r + 1) % 8}.ckpt", rank / "net-10_1.ckpt")
    with pytest.raises(SourceError, match="file_suffix"):
        zckpt.transform_checkpoints(*args)
    zckpt.transform_checkpoints(*args, file_suffix="9_1")
    for r in range(4):
        got = (tmp_path / "dst" / f"rank_{r}" / f"checkpoint_{r}.ckpt").read_bytes()
        assert got == (EXAMPLE / "dst" / "expected" / f"rank_{r}" / f"checkpoint_{r}.ckpt").read_bytes()


# --- the selection rules, against MindSpore's -------------------------------------------------

CASES: dict[str, tuple[list[str], str, str | None]] = {
    "one": (["net-1_1.safetensors"], "safetensors", None),
    "numbers": (["net-2_100.safetensors", "net-10_5.safetensors", "net-9_900.safetensors"], "safetensors", None),
    "hidden": (["net-1_1.safetensors", ".net-9_9.safetensors"], "safetensors", None),
    "epoch_step": (["net-1_100.safetensors", "net-2_100.safetensors"], "safetensors", "1_100"),
    "dash_epoch_step": (["net-1_100.safetensors", "net-11_100.safetensors"], "safetensors", "-1_100"),
    "shortest": (["net-1_100.safetensors", "net_rank_0-1_100.safetensors", "a-2_5.safetensors"],
                 "safetensors", "_100"),
    "task": (["net_0-1_100.safetensors", "net_rank_0-1_100.safetensors"], "safetensors", "0-1_100"),
    "unique_text": (["net-1_100.safetensors", "net-1_100_lora.safetensors"], "safetensors", "lora"),
    "ckpt_suffix": (["net-9_100.ckpt", "net-10_100.ckpt"], "ckpt", "10_100"),
    "ckpt_step": (["m-1_5.ckpt", "m-1_15.ckpt", "mm-2_5.ckpt"], "ckpt", "5"),
    "tied_step": (["m-1_5.ckpt", "m-2_5.ckpt"], "ckpt", "5"),
    "no_match": (["net-1_100.safetensors"], "safetensors", "2_100"),
    "tied_shortest": (["a-1_100.safetensors", "b-1_100.safetensors"], "safetensors", "1_100"),
    "text_ambiguous": (["x_lora.safetensors", "y_lora.safetensors"], "safetensors", "lora"),
}


def _zckpt_pick(names: list[str], suffix: str | None) -> str | None:
    try:
        got = choose_rank_file(names, "rank_0", "rank_0", suffix)
    except SourceError:
        return "refused"
    return None if got is None else got.name


def test_selection_rules_by_hand() -> None:
    """What MindSpore 2.10's transform_safetensors.py does, read by hand."""
    assert {c: _zckpt_pick(n, s) for c, (n, _, s) in CASES.items()} == {
        "one": "net-1_1.safetensors", "numbers": "net-10_5.safetensors", "hidden": "net-1_1.safetensors",
        "epoch_step": "net-1_100.safetensors", "dash_epoch_step": "net-1_100.safetensors",
        "shortest": "net-1_100.safetensors", "task": "net_0-1_100.safetensors",
        "unique_text": "net-1_100_lora.safetensors", "ckpt_suffix": "net-10_100.ckpt", "ckpt_step": "m-1_5.ckpt",
        "tied_step": "refused",
        "no_match": "refused", "tied_shortest": "refused", "text_ambiguous": "refused",
    }
    # .ckpt without a suffix: the last in lexicographic order when that is also the latest step
    assert _zckpt_pick(["net-1_1.ckpt", "net-2_1.ckpt"], None) == "net-2_1.ckpt"
    assert _zckpt_pick(["net-9_1.ckpt", "net-10_1.ckpt"], None) == "refused"
    assert _zckpt_pick(["a-1_1.safetensors", "b-1_1.safetensors"], None) == "refused"  # tie: listing order


@pytest.mark.mindspore
def test_selection_rules_match_mindspore(tmp_path: Path) -> None:
    """Where zckpt picks a file, MindSpore's _collect_safetensor_files picks the same one;
    where zckpt refuses, MindSpore raises too (or, on a tie, its pick depends on the listing)."""
    spec = {c: {"names": n, "format": f, "file_suffix": s} for c, (n, f, s) in CASES.items()}
    (tmp_path / "cases.json").write_text(json.dumps(spec))
    ms = run_ms_tool("ms_pick_files.py", str(tmp_path / "cases.json"))
    for case, (names, _, suffix) in CASES.items():
        mine = _zckpt_pick(names, suffix)
        if mine == "refused":
            assert ms[case].startswith("error:"), (case, ms[case])
        else:
            assert ms[case] == mine, (case, ms[case], mine)
