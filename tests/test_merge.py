"""merge_pipeline_strategys: MindSpore's merged file byte for byte, and clear refusals.

The fixtures' ``src/strategy_merged.ckpt`` was written by MindSpore's own
``merge_pipeline_strategys`` from ``src/strategy/``; zckpt must write the same bytes. The
live test (skipped without ``$ZCKPT_MS_PYTHON``) has MindSpore merge protobuf and JSON
inputs and parse zckpt's merged files with its own readers.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import scenario
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mindspore_env import require_ms_python, run_ms_tool

import zckpt
from zckpt.cli.main import main
from zckpt.core.errors import OutputError, StrategyError, UsageError, ZckptError
from zckpt.formats.strategy import (
    ParamLayout,
    StrategyMap,
    encode_strategy,
    encode_strategy_json,
    make_layout,
    read_strategy,
)
from zckpt.jobs.generate_layouts import random_layout
from zckpt.plan.merge import (
    MergeReport,
    NotAStrategyDirError,
    list_strategy_files,
    merge_strategies,
    merge_strategy_files,
)
from zckpt.third_party.mindspore_proto import ms_node_strategy_pb2 as pb

PIPELINE = ["s06", "s07"]


def plain(smap: StrategyMap) -> dict[str, dict[int, ParamLayout]]:
    return {name: dict(per) for name, per in smap.layouts.items()}


def stage_map(layouts: dict[str, ParamLayout], stage: int, ops: int = 1) -> StrategyMap:
    """One pipeline stage's per-rank strategy: its layouts and operators tagged with the stage."""
    return StrategyMap(
        layouts={name: {stage: lay} for name, lay in layouts.items()},
        operator_strategies={f"MatMul-op{stage}-{i}": (stage, ((1, 1), (1, 1))) for i in range(ops)},
    )


def write_rank_files(
    d: Path, stages: list[dict[str, ParamLayout]], *, fmt: str = "protobuf", ranks_per_stage: int = 2
) -> list[Path]:
    """Per-rank files as a pipeline job writes them: identical files for the ranks of a stage."""
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for s, layouts in enumerate(stages):
        smap = stage_map(layouts, s)
        for i in range(ranks_per_stage):
            r = s * ranks_per_stage + i
            if fmt == "json":
                p = d / f"strategy_{r}.json"
                p.write_text(encode_strategy_json(smap, merged=False, current_stage=2), encoding="utf-8")
            else:
                p = d / f"strategy_{r}.ckpt"
                p.write_bytes(encode_strategy(smap, merged=False, current_stage=2))
            out.append(p)
    return out


def fixture_as_json(src: Path, dst: Path) -> list[Path]:
    """The fixture's per-rank protobuf strategies re-encoded as MindSpore's JSON form."""
    dst.mkdir(parents=True, exist_ok=True)
    out = []
    for p in sorted(src.glob("*.ckpt")):
        target = dst / (p.stem + ".json")
        target.write_text(encode_strategy_json(read_strategy(p), merged=False, current_stage=2), encoding="utf-8")
        out.append(target)
    return out


L4 = make_layout((2, 2), [[1], [0]])
L4_OPT = make_layout((2, 2), [[1], []], opt_shard_step=1, opt_shard_size=2)
L4_REP = make_layout((4,), [[]])


# --------------------------------------------------------------------------- MindSpore's fixtures


@pytest.mark.fixtures
@pytest.mark.parametrize("sid", PIPELINE)
def test_byte_identical_to_mindspore_merged_file(tmp_path: Path, sid: str) -> None:
    root = scenario(sid) / "src"
    out = tmp_path / "merged.ckpt"
    assert zckpt.merge_pipeline_strategys(str(root / "strategy"), str(out)) is None
    assert out.read_bytes() == (root / "strategy_merged.ckpt").read_bytes()
    assert plain(read_strategy(out)) == plain(read_strategy(root / "strategy_merged.ckpt"))


@pytest.mark.fixtures
@pytest.mark.parametrize("sid", PIPELINE)
def test_directory_order_does_not_matter(tmp_path: Path, sid: str) -> None:
    """Names that list the last stage first still give MindSpore's stage-ordered file."""
    root = scenario(sid) / "src"
    files = sorted((root / "strategy").glob("*.ckpt"), key=lambda p: int(p.stem.split("_")[1]))
    d = tmp_path / "reversed"
    d.mkdir()
    for i, p in enumerate(reversed(files)):
        shutil.copy(p, d / f"strategy_{i}.ckpt")
    report = merge_strategies(d, tmp_path / "merged.ckpt")
    assert list(report.stage_files.values())[0].endswith(f"strategy_{len(files) // 2}.ckpt")
    assert (tmp_path / "merged.ckpt").read_bytes() == (root / "strategy_merged.ckpt").read_bytes()


@pytest.mark.fixtures
@pytest.mark.parametrize("sid", PIPELINE)
def test_json_inputs_merge_to_the_same_layouts(tmp_path: Path, sid: str) -> None:
    root = scenario(sid) / "src"
    fixture_as_json(root / "strategy", tmp_path / "json")
    out = tmp_path / "merged.json"
    report = merge_strategies(tmp_path / "json", out)
    assert report.format == "json"
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["current_stage"] == 1
    assert all(name.split("-", 1)[0] in ("0", "1") for name in doc["parallel_layout_item"])
    assert plain(read_strategy(out)) == plain(read_strategy(root / "strategy_merged.ckpt"))
    # the operator strategies of every stage are kept, each with its own stage
    merged_ops = read_strategy(root / "strategy_merged.ckpt").operator_strategies
    assert {k: v["stage"] for k, v in doc["parallel_strategy_item"].items()} == {k: v[0] for k, v in merged_ops.items()}


# --------------------------------------------------------------------------- generated inputs


@st.composite
def pipelines(draw: st.DrawFn) -> list[dict[str, ParamLayout]]:
    device_num = draw(st.sampled_from([1, 2, 4, 8]))
    n_stages = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    stages = []
    for s in range(n_stages):
        layouts: dict[str, ParamLayout] = {}
        for i in range(int(rng.integers(1, 5))):
            ndim = int(rng.integers(1, 4))
            shape = tuple(int(rng.choice([1, 2, 4])) * device_num for _ in range(ndim))
            lay = random_layout(rng, shape, device_num, allow_multi_axis=ndim != 1)
            assert lay is not None
            layouts[f"stage{s}.block{i}.weight" if rng.random() < 0.7 else f"shared{i}.weight"] = lay
        stages.append(layouts)
    return stages


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stages=pipelines(), fmt=st.sampled_from(["protobuf", "json"]))
def test_merged_file_holds_every_stage_layout(tmp_path_factory: pytest.TempPathFactory,
                                              stages: list[dict[str, ParamLayout]], fmt: str) -> None:
    d = tmp_path_factory.mktemp("merge")
    write_rank_files(d / "src", stages, fmt=fmt, ranks_per_stage=2)
    out = d / ("merged.json" if fmt == "json" else "merged.ckpt")
    report = merge_strategies(d / "src", out)
    assert report.stages == tuple(range(len(stages)))
    assert len(report.duplicates) == len(stages)  # the second rank of every stage
    expected: dict[str, dict[int, ParamLayout]] = {}
    for s, layouts in enumerate(stages):
        for name, lay in layouts.items():
            expected.setdefault(name, {})[s] = lay
    assert plain(read_strategy(out)) == expected


def test_same_stage_with_other_bytes_but_same_layouts_is_a_duplicate(tmp_path: Path) -> None:
    files = write_rank_files(tmp_path / "src", [{"a": L4}, {"b": L4_OPT}], ranks_per_stage=2)
    # rank 3 of stage 1 lists another operator and another current_stage: bytes differ, layouts agree
    other = stage_map({"b": L4_OPT}, 1, ops=2)
    files[3].write_bytes(encode_strategy(other, merged=False, current_stage=7))
    report = merge_strategies(tmp_path / "src", tmp_path / "m.ckpt")
    assert report.duplicates[str(files[3])] == str(files[2])
    assert report.stage_files == {0: str(files[0]), 1: str(files[2])}
    msg = pb.ParallelStrategyMap()
    msg.ParseFromString((tmp_path / "m.ckpt").read_bytes())
    assert msg.current_stage == 1
    assert [i.param_name for i in msg.parallel_layout_item] == ["0-a", "1-b"]
    assert len(msg.parallel_strategy_item) == 2  # the operators of files[0] and files[2] only


def test_natural_file_order_picks_the_representative(tmp_path: Path) -> None:
    """strategy_2 comes before strategy_10 (numbers compare as numbers, not as text)."""
    d = tmp_path / "src"
    d.mkdir()
    (d / "strategy_10.ckpt").write_bytes(encode_strategy(stage_map({"a": L4}, 0, ops=3), merged=False))
    (d / "strategy_2.ckpt").write_bytes(encode_strategy(stage_map({"a": L4}, 0, ops=1), merged=False))
    assert [p.name for p in list_strategy_files(d)] == ["strategy_2.ckpt", "strategy_10.ckpt"]
    report = merge_strategies(d, tmp_path / "m.ckpt")
    assert report.stage_files[0].endswith("strategy_2.ckpt")
    assert len(read_strategy(tmp_path / "m.ckpt").operator_strategies) == 1


def test_stage_of_a_file_is_its_first_operators_stage(tmp_path: Path) -> None:
    """As in MindSpore, the first operator strategy decides; a later one of another stage does not."""
    write_rank_files(tmp_path / "src", [{"a": L4}], ranks_per_stage=1)
    mixed = StrategyMap(layouts={"b": {1: L4_REP}},
                        operator_strategies={"MatMul_b": (1, ((4, 1),)), "Receive_a": (0, ((1, 1),))})
    (tmp_path / "src" / "strategy_1.ckpt").write_bytes(encode_strategy(mixed, merged=False))
    report = merge_strategies(tmp_path / "src", tmp_path / "m.ckpt")
    assert report.stage_files[1].endswith("strategy_1.ckpt")
    assert plain(read_strategy(tmp_path / "m.ckpt")) == {"a": {0: L4}, "b": {1: L4_REP}}


def test_output_inside_the_source_directory_is_not_read_back(tmp_path: Path) -> None:
    write_rank_files(tmp_path / "src", [{"a": L4}, {"b": L4_REP}])
    out = tmp_path / "src" / "merged.ckpt"
    first = merge_strategies(tmp_path / "src", out)
    again = merge_strategies(tmp_path / "src", out)  # would be "already merged" if it were read
    assert str(out) not in again.files
    assert first.files == again.files


def test_missing_output_directory_is_created(tmp_path: Path) -> None:
    write_rank_files(tmp_path / "src", [{"a": L4}])
    merge_strategies(tmp_path / "src", tmp_path / "new" / "dir" / "m.ckpt")
    assert plain(read_strategy(tmp_path / "new" / "dir" / "m.ckpt")) == {"a": {0: L4}}


# --------------------------------------------------------------------------- refusals


def test_not_a_directory_is_both_a_zckpt_error_and_mindspores_error(tmp_path: Path) -> None:
    f = tmp_path / "file.ckpt"
    f.write_bytes(b"x")
    for bad in (f, tmp_path / "absent"):
        with pytest.raises(NotADirectoryError) as err:
            zckpt.merge_pipeline_strategys(str(bad), str(tmp_path / "m.ckpt"))
        assert isinstance(err.value, UsageError)
        assert isinstance(err.value, NotAStrategyDirError)
        assert str(bad) in str(err.value) and "not a directory" in str(err.value)


def test_argument_types(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="src_strategy_dirs"):
        zckpt.merge_pipeline_strategys(3, str(tmp_path / "m.ckpt"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dst_strategy_file"):
        zckpt.merge_pipeline_strategys(str(tmp_path), None)  # type: ignore[arg-type]


def _refused(src: Path, out: Path, match: str) -> ZckptError:
    with pytest.raises(ZckptError, match=match) as err:
        merge_strategies(src, out)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if "tmp-zckpt" in p.name]
    return err.value


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / ".hidden.ckpt").write_bytes(b"x")  # glob skips hidden names; so does zckpt
    err = _refused(tmp_path / "src", tmp_path / "m.ckpt", "no strategy files")
    assert isinstance(err, StrategyError)


def test_mixed_formats(tmp_path: Path) -> None:
    write_rank_files(tmp_path / "src", [{"a": L4}])
    (tmp_path / "src" / "strategy_9.json").write_text("{}", encoding="utf-8")
    _refused(tmp_path / "src", tmp_path / "m.ckpt", r"'\.ckpt' or all '\.json'")


def test_empty_file(tmp_path: Path) -> None:
    files = write_rank_files(tmp_path / "src", [{"a": L4}, {"b": L4}])
    files[3].write_bytes(b"")
    err = _refused(tmp_path / "src", tmp_path / "m.ckpt", r"empty \(0 bytes\)")
    assert err.path == str(files[3])


def test_file_without_layouts(tmp_path: Path) -> None:
    files = write_rank_files(tmp_path / "src", [{"a": L4}, {"b": L4}])
    files[2].write_bytes(encode_strategy(stage_map({}, 1), merged=False))
    err = _refused(tmp_path / "src", tmp_path / "m.ckpt", "no parameter layouts")
    assert err.path == str(files[2])


def test_file_without_operator_strategies_has_no_stage(tmp_path: Path) -> None:
    files = write_rank_files(tmp_path / "src", [{"a": L4}, {"b": L4}])
    files[1].write_bytes(encode_strategy(StrategyMap(layouts={"a": {0: L4}}), merged=False))
    err = _refused(tmp_path / "src", tmp_path / "m.ckpt", "stage is unknown")
    assert err.path == str(files[1])


@pytest.mark.parametrize("fmt", ["protobuf", "json"])
def test_missing_stage_is_named(tmp_path: Path, fmt: str) -> None:
    files = write_rank_files(tmp_path / "src", [{"a": L4}, {"b": L4}, {"c": L4}, {"d": L4}], fmt=fmt)
    for p in files[2:4] + files[4:6]:  # stages 1 and 2
        p.unlink()
    out = tmp_path / ("m.json" if fmt == "json" else "m.ckpt")
    err = _refused(tmp_path / "src", out, r"stage\(s\) \[1, 2\] have no strategy file")
    assert "found stage(s) [0, 3]" in str(err)


def test_stage_zero_missing(tmp_path: Path) -> None:
    files = write_rank_files(tmp_path / "src", [{"a": L4}, {"b": L4}])
    for p in files[:2]:
        p.unlink()
    _refused(tmp_path / "src", tmp_path / "m.ckpt", r"stage\(s\) \[0\] have no strategy file")


@pytest.mark.parametrize("fmt", ["protobuf", "json"])
def test_conflicting_layouts_for_one_stage(tmp_path: Path, fmt: str) -> None:
    files = write_rank_files(tmp_path / "src", [{"a": L4}, {"b": L4, "c": L4}], fmt=fmt)
    bad = stage_map({"b": L4, "c": L4_OPT}, 1)
    if fmt == "json":
        files[3].write_text(encode_strategy_json(bad, merged=False), encoding="utf-8")
    else:
        files[3].write_bytes(encode_strategy(bad, merged=False))
    out = tmp_path / ("m.json" if fmt == "json" else "m.ckpt")
    err = _refused(tmp_path / "src", out, "claims pipeline stage 1")
    assert err.path == str(files[3])
    assert str(files[2]) in str(err) and "'c'" in str(err)


def test_same_stage_listing_other_parameters_conflicts(tmp_path: Path) -> None:
    files = write_rank_files(tmp_path / "src", [{"a": L4}, {"b": L4}])
    files[3].write_bytes(encode_strategy(stage_map({"b": L4, "extra": L4}, 1), merged=False))
    _refused(tmp_path / "src", tmp_path / "m.ckpt", "'extra' is listed only in the second")


def test_already_merged_file_in_the_directory(tmp_path: Path) -> None:
    write_rank_files(tmp_path / "a", [{"a": L4}, {"b": L4}])
    merge_strategies(tmp_path / "a", tmp_path / "src" / "merged.ckpt")
    _refused(tmp_path / "src", tmp_path / "m.ckpt", "already merged")
    # a merged single-stage file: operators of one stage, but names already prefixed
    write_rank_files(tmp_path / "b", [{"a": L4}])
    merge_strategies(tmp_path / "b", tmp_path / "src2" / "merged.ckpt")
    _refused(tmp_path / "src2", tmp_path / "m.ckpt", "already merged")


def test_corrupt_and_invalid_files(tmp_path: Path) -> None:
    files = write_rank_files(tmp_path / "src", [{"a": L4}])
    files[0].write_bytes(b"\xff\xff\xff\xff")
    files[1].unlink()
    _refused(tmp_path / "src", tmp_path / "m.ckpt", "not a protobuf strategy file")
    js = write_rank_files(tmp_path / "j", [{"a": L4}], fmt="json", ranks_per_stage=1)
    js[0].write_text("[1, 2]", encoding="utf-8")
    _refused(tmp_path / "j", tmp_path / "m.json", "must be an object")
    js[0].write_text(json.dumps({"parallel_strategy_item": {"op": {"parallel_strategy": []}},
                                 "parallel_layout_item": {"a": {"dev_matrix": [4], "tensor_map": [-1]}}}))
    _refused(tmp_path / "j", tmp_path / "m.json", "no valid 'stage'")
    js[0].write_text(json.dumps({"parallel_strategy_item": {"op": {"stage": 0, "parallel_strategy": []}},
                                 "parallel_layout_item": {"a": {"dev_matrix": [4], "tensor_map": [3]}}}))
    _refused(tmp_path / "j", tmp_path / "m.json", "names device axis 3")


def test_output_name_must_match_the_format(tmp_path: Path) -> None:
    write_rank_files(tmp_path / "p", [{"a": L4}])
    write_rank_files(tmp_path / "j", [{"a": L4}], fmt="json")
    with pytest.raises(UsageError, match="must not end with '.json'"):
        merge_strategies(tmp_path / "p", tmp_path / "m.json")
    with pytest.raises(UsageError, match="must end with '.json'"):
        merge_strategies(tmp_path / "j", tmp_path / "m.ckpt")
    (tmp_path / "dir.ckpt").mkdir()
    with pytest.raises(OutputError, match="is a directory"):
        merge_strategies(tmp_path / "p", tmp_path / "dir.ckpt")


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_rank_files(tmp_path / "src", [{"a": L4}, {"b": L4}])
    out = tmp_path / "m.ckpt"
    out.write_bytes(b"previous")

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space"):
        merge_strategies(tmp_path / "src", out)
    assert out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.ckpt", "src"]


def test_explicit_file_list(tmp_path: Path) -> None:
    files = write_rank_files(tmp_path / "src", [{"a": L4}, {"b": L4_REP}], ranks_per_stage=1)
    report = merge_strategy_files(list(reversed(files)), tmp_path / "m.ckpt")
    assert isinstance(report, MergeReport) and report.stages == (0, 1) and report.layouts == 2
    names = [i.param_name for i in _parse(tmp_path / "m.ckpt").parallel_layout_item]
    assert names == ["0-a", "1-b"]  # stage order, whatever the input order
    with pytest.raises(StrategyError, match="mix"):
        merge_strategy_files([files[0], tmp_path / "x.json"], tmp_path / "m.ckpt")
    with pytest.raises(StrategyError, match="no strategy files"):
        merge_strategy_files([], tmp_path / "m.ckpt")


def _parse(path: Path) -> pb.ParallelStrategyMap:
    msg = pb.ParallelStrategyMap()
    msg.ParseFromString(path.read_bytes())
    return msg


# --------------------------------------------------------------------------- command line


def test_cli_merge_strategies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_rank_files(tmp_path / "src", [{"a": L4}, {"b": L4}, {"c": L4}])
    assert main(["merge-strategies", str(tmp_path / "src"), str(tmp_path / "m.ckpt")]) == 0
    line = capsys.readouterr().out
    assert "merged 6 protobuf strategy file(s) (3 distinct) of 3 pipeline stage(s), 3 layouts" in line
    assert main(["merge-strategies", str(tmp_path / "src"), str(tmp_path / "m2.ckpt"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["stage_files"] == {"0": str(tmp_path / "src" / "strategy_0.ckpt"),
                                  "1": str(tmp_path / "src" / "strategy_2.ckpt"),
                                  "2": str(tmp_path / "src" / "strategy_4.ckpt")}
    assert (tmp_path / "m.ckpt").read_bytes() == (tmp_path / "m2.ckpt").read_bytes()
    (tmp_path / "src" / "strategy_2.ckpt").unlink()
    (tmp_path / "src" / "strategy_3.ckpt").unlink()
    assert main(["merge-strategies", str(tmp_path / "src"), str(tmp_path / "m3.ckpt")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "stage(s) [1] have no strategy file" in err
    assert main(["merge-strategies", str(tmp_path / "nope"), "--out", str(tmp_path / "m3.ckpt")]) == 1
    assert "not a directory" in capsys.readouterr().err


# --------------------------------------------------------------------------- MindSpore itself


@pytest.mark.mindspore
@pytest.mark.fixtures
def test_mindspore_reads_zckpt_merged_files(tmp_path: Path) -> None:
    """MindSpore merges the same inputs to the same bytes and parses zckpt's files identically."""
    require_ms_python()
    job: dict[str, Any] = {"merge_dir": [], "merge_files": [], "read": [], "rank_list": []}
    checks: list[tuple[str, str, str]] = []  # (zckpt file, mindspore file, what)
    rank_checks: list[tuple[int, int, str]] = []
    json_pairs: list[tuple[Path, Path]] = []
    for sid in PIPELINE:
        root = scenario(sid)
        ours = tmp_path / sid / "zckpt_merged.ckpt"
        merge_strategies(root / "src" / "strategy", ours)
        ms_dir = tmp_path / sid / "ms_merged.ckpt"
        job["merge_dir"].append([str(root / "src" / "strategy"), str(ms_dir)])
        checks.append((str(ours), str(root / "src" / "strategy_merged.ckpt"), f"{sid} protobuf vs fixture"))
        checks.append((str(ours), str(ms_dir), f"{sid} protobuf vs live MindSpore"))
        fixture_as_json(root / "src" / "strategy", tmp_path / sid / "json")
        ours_json = tmp_path / sid / "zckpt_merged.json"
        report = merge_strategies(tmp_path / sid / "json", ours_json)
        ms_json_ordered = tmp_path / sid / "ms_ordered.json"
        job["merge_files"].append([str(ms_json_ordered), list(report.files)])  # zckpt's input order
        json_pairs.append((ours_json, ms_json_ordered))
        ms_json_dir = tmp_path / sid / "ms_dir.json"
        job["merge_dir"].append([str(tmp_path / sid / "json"), str(ms_json_dir)])
        checks.append((str(ours_json), str(ms_json_dir), f"{sid} JSON vs live MindSpore"))
        checks.append((str(ours_json), str(root / "src" / "strategy_merged.ckpt"), f"{sid} JSON vs fixture"))
        dst = root / "dst" / "strategy.ckpt"
        meta = json.loads((root / "meta.json").read_text())
        dst_arg = str(dst) if dst.is_file() else None
        for r in range(int(meta["dst_ranks"])):
            start = len(job["rank_list"])
            job["rank_list"].append([r, str(ours), dst_arg])
            job["rank_list"].append([r, str(root / "src" / "strategy_merged.ckpt"), dst_arg])
            rank_checks.append((start, start + 1, f"{sid} dst rank {r}"))
    for a, b, _ in checks:
        for p in (a, b):
            if p not in job["read"]:
                job["read"].append(p)
    (tmp_path / "job.json").write_text(json.dumps(job), encoding="utf-8")
    res = run_ms_tool("ms_merge_check.py", str(tmp_path / "job.json"))
    assert res["merge_dir"] == ["ok"] * len(job["merge_dir"]), res["merge_dir"]
    assert res["merge_files"] == ["ok"] * len(job["merge_files"]), res["merge_files"]
    for a, b, what in checks:
        got, want = res["read"][a], res["read"][b]
        assert "error" not in got, (what, got)
        assert got == want, f"MindSpore parses zckpt's merged file differently ({what})"
        assert len(got) >= 3
    for sid in PIPELINE:  # live MindSpore on protobuf writes the fixture's bytes, and so does zckpt
        assert (tmp_path / sid / "ms_merged.ckpt").read_bytes() == (tmp_path / sid / "zckpt_merged.ckpt").read_bytes()
    for ours_json, ms_json in json_pairs:  # same input order: byte-identical JSON
        assert ours_json.read_bytes() == ms_json.read_bytes()
    for i, j, what in rank_checks:
        assert "error" not in res["rank_list"][i], (what, res["rank_list"][i])
        assert res["rank_list"][i] == res["rank_list"][j], what
