"""The direct path (``zckpt transform``, ``transform_checkpoints``): destination files straight
from the source shards, byte-identical to MindSpore's fixtures and to the store path, with
every refusal ingest makes. Expected values come from the fixtures' ``dst/expected``, from
the generator's global values sliced by an independent re-slicer, or from the store path."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from ckpt_compare import diff_dirs
from conftest import scenario
from test_roundtrip_generated import _check_output, _dst_strategy, _model

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.core.errors import SourceError, UsageError
from zckpt.core.layout import Box
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.entries import EntryInfo, Segment
from zckpt.formats.safetensors import SafetensorsReader
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.jobs.generate import write_model, write_pipeline_model
from zckpt.jobs.generate_model import TensorDef, global_value
from zckpt.jobs.transform import TransformOptions, transform
from zckpt.plan.values import Write
from zckpt.sources.reader import SourceReader, meeting, segment_spans

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SRC, SRC_S, DST_S = (EXAMPLE / "src" / "checkpoints", EXAMPLE / "src" / "strategy.ckpt",
                     EXAMPLE / "dst" / "strategy.ckpt")
PLAIN = ["s01", "s02", "s03b", "s04", "s05", "s08", "s09", "s10", "s11", "s14", "s15"]


def _strategy(side: Path) -> str | None:
    f = side / "strategy.ckpt"
    return str(f) if f.is_file() else None


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


@pytest.mark.parametrize("sid", PLAIN)
def test_cli_transform_matches_expected(sid: str, tmp_path: Path) -> None:
    d = scenario(sid)
    args = ["transform", str(d / "src" / "checkpoints"), "--out", str(tmp_path / "out"), "--verify-replicas"]
    if _strategy(d / "src"):
        args += ["--src-strategy", str(_strategy(d / "src"))]
    if _strategy(d / "dst"):
        args += ["--dst-strategy", str(_strategy(d / "dst"))]
    if sid in ("s01", "s03b"):
        args += ["--workers", "2"]
    assert cli_main(args) == 0
    assert diff_dirs(d / "dst" / "expected", tmp_path / "out") == []


@pytest.mark.parametrize("sid", ["s06", "s07"])
@pytest.mark.parametrize("strategy", ["strategy", "strategy_merged.ckpt"])
def test_cli_transform_pipeline_matches_expected(sid: str, strategy: str, tmp_path: Path) -> None:
    d = scenario(sid)
    assert cli_main(["transform", str(d / "src" / "checkpoints"), "--src-strategy", str(d / "src" / strategy),
                     "--dst-strategy", str(d / "dst" / "strategy.ckpt"), "--out", str(tmp_path / "o")]) == 0
    assert diff_dirs(d / "dst" / "expected", tmp_path / "o") == []


def test_cli_transform_refuses_s12_and_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = scenario("s12")
    code = cli_main(["transform", str(d / "src" / "checkpoints"), "--src-strategy", str(d / "src" / "strategy.ckpt"),
                     "--dst-strategy", str(d / "dst" / "strategy.ckpt"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1
    assert "step_table" in err and "different values" in err
    assert not list(tmp_path.rglob("*.ckpt*"))


def test_api_takes_the_direct_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No store: the store path's ingest and export must not be called, yet the files are MindSpore's."""
    import zckpt.jobs.export
    import zckpt.jobs.ingest

    def no_store(*args: object, **kwargs: object) -> None:
        raise AssertionError("went through a store")

    monkeypatch.setattr(zckpt.jobs.ingest, "ingest", no_store)
    monkeypatch.setattr(zckpt.jobs.export, "export", no_store)
    monkeypatch.setattr(zckpt.jobs.export, "export_rank", no_store)
    src, src_s, dst_s = SRC, SRC_S, DST_S
    zckpt.transform_checkpoints(str(src), str(tmp_path / "o"), "checkpoint_", str(src_s), str(dst_s), process_num=2)
    assert diff_dirs(EXAMPLE / "dst" / "expected", tmp_path / "o") == []
    assert _files(tmp_path / "o") == [f"rank_{r}/checkpoint_{r}.ckpt" for r in range(4)]
    needed = zckpt.rank_list_for_transform(2, str(src_s), str(dst_s))
    target = tmp_path / "one" / "r2.ckpt"
    zckpt.transform_checkpoint_by_rank(2, {r: str(src / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in needed},
                                       str(target), str(src_s), str(dst_s))
    assert target.read_bytes() == (tmp_path / "o" / "rank_2" / "checkpoint_2.ckpt").read_bytes()
    assert _files(tmp_path / "one") == ["r2.ckpt"]


def test_process_num_and_output_format_checked(tmp_path: Path) -> None:
    src, src_s = EXAMPLE / "src" / "checkpoints", str(EXAMPLE / "src" / "strategy.ckpt")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="process_num"):
            zckpt.transform_checkpoints(str(src), str(tmp_path / "o"), "c_", src_s, None, process_num=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="output_format"):
        zckpt.transform_checkpoints(str(src), str(tmp_path / "o"), "c_", src_s, None, output_format="npz")
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.parametrize("src_n,dst_n", [(8, 3), (4, 8), (6, 1), (3, 5)])
def test_generated_equals_reslicer_and_store_path(src_n: int, dst_n: int, tmp_path: Path) -> None:
    rng = np.random.default_rng(src_n * 7 + dst_n)
    tensors = _model(rng, src_n, 10)
    model = write_model(tmp_path / "src", tensors, device_num=src_n, strings={"note": "direct"})
    _dst_strategy(rng, tensors, dst_n, tmp_path / "dst.ckpt")
    report = transform(tmp_path / "src", tmp_path / "direct", str(model.strategy_path), str(tmp_path / "dst.ckpt"),
                       options=TransformOptions(block_bytes=4096, workers=2, verify_replicas=True))
    assert len(report.ranks) == dst_n
    assert _check_output(tmp_path / "direct", tensors, tmp_path / "dst.ckpt", dst_n) == 10 * dst_n
    zckpt.ingest(str(tmp_path / "src"), tmp_path / "s.zarr", str(model.strategy_path))
    zckpt.export(tmp_path / "s.zarr", tmp_path / "store", str(tmp_path / "dst.ckpt"))
    for r in range(dst_n):
        rel = Path(f"rank_{r}") / f"checkpoint_{r}.ckpt"
        assert (tmp_path / "direct" / rel).read_bytes() == (tmp_path / "store" / rel).read_bytes(), rel


def test_split_values_crc_sources_and_tiny_bands(tmp_path: Path) -> None:
    """Sources whose tensors span several Values (both split modes) with crc trailers, and a
    budget far below a row: file ranges cross Value boundaries, bands cut rows."""
    rng = np.random.default_rng(11)
    tensors = _model(rng, 4, 6)
    for mode, block in itertools.product(("rows", "bytes"), (64, 1 << 20)):
        src = tmp_path / f"src_{mode}"
        if not src.exists():
            model = write_model(src, tensors, device_num=4, crc=True, slice_bytes=512, split=mode)  # type: ignore[arg-type]
        _dst_strategy(np.random.default_rng(3), tensors, 2, tmp_path / f"dst_{mode}.ckpt")
        out = tmp_path / f"out_{mode}_{block}"
        transform(src, out, str(model.strategy_path), str(tmp_path / f"dst_{mode}.ckpt"),
                  options=TransformOptions(block_bytes=block))
        assert _check_output(out, tensors, tmp_path / f"dst_{mode}.ckpt", 2) == 12


def test_damaged_crc_refused_before_writing(tmp_path: Path) -> None:
    model = write_model(tmp_path / "src", [TensorDef("w", (8, 4), "Float32", make_layout((2,), [[0], []]))],
                        device_num=2, crc=True)
    raw = bytearray(model.rank_files[1].read_bytes())
    with CkptReader(model.rank_files[1], verify_crc=False) as r:
        at = r.entries["w"].segments[0].offset
    raw[at] ^= 0xFF
    model.rank_files[1].write_bytes(bytes(raw))
    with pytest.raises(zckpt.ZckptError, match="crc_num"):
        transform(tmp_path / "src", tmp_path / "o", str(model.strategy_path), None)
    assert not list((tmp_path / "o").rglob("*.ckpt")) if (tmp_path / "o").exists() else True


def test_row_pieces_are_copied_by_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_by_one: None) -> None:
    """Row-split sources to row-split destinations written one by one (as slices of some size
    are): every tensor goes out as file ranges."""
    lay8 = make_layout((8,), [[0], []])
    tensors = [TensorDef("emb", (64, 24), "Float32", lay8),
               TensorDef("bias", (64,), "BFloat16", make_layout((8,), [[0]]))]
    model = write_model(tmp_path / "src", tensors, device_num=8)
    dst = StrategyMap(layouts={t.name: {0: make_layout((4,), [[0]] + [[]] * (len(t.shape) - 1))} for t in tensors})
    (tmp_path / "d.ckpt").write_bytes(encode_strategy(dst))
    ranged: list[str] = []
    real = SourceReader.file_ranges

    def spy(self: SourceReader, name: str, box: zckpt.core.layout.Box) -> object:
        got = real(self, name, box)
        if got is not None:
            ranged.append(name)
        return got

    monkeypatch.setattr(SourceReader, "file_ranges", spy)
    transform(tmp_path / "src", tmp_path / "o", str(model.strategy_path), str(tmp_path / "d.ckpt"))
    assert {"bias", "emb"} <= set(ranged) and len([n for n in ranged if n in ("bias", "emb")]) == 8
    for r in range(4):
        with CkptReader(tmp_path / "o" / f"rank_{r}" / f"checkpoint_{r}.ckpt") as f:
            for t in tensors:
                want = global_value(t.name, t.shape, t.ms_type)[16 * r : 16 * (r + 1)]
                assert f.array(t.name).tobytes() == want.tobytes()


def test_rows_wider_than_the_budget(tmp_path: Path) -> None:
    """A (3, 4096) float32 tensor whose single row exceeds the step size, split by columns."""
    wide = TensorDef("wide", (3, 4096), "Float32", make_layout((2,), [[], [0]]))
    col = TensorDef("col", (4096,), "BFloat16", make_layout((2,), [[0]]))
    model = write_model(tmp_path / "src", [wide, col], device_num=2)
    dst = StrategyMap(layouts={"wide": {0: make_layout((3,), [[0], []])}, "col": {0: make_layout((3,), [[]])}})
    (tmp_path / "d.ckpt").write_bytes(encode_strategy(dst))
    transform(tmp_path / "src", tmp_path / "o", str(model.strategy_path), str(tmp_path / "d.ckpt"),
              options=TransformOptions(block_bytes=700))
    for r in range(3):
        with CkptReader(tmp_path / "o" / f"rank_{r}" / f"checkpoint_{r}.ckpt") as f:
            assert f.array("wide").tobytes() == global_value("wide", (3, 4096), "Float32")[r : r + 1].tobytes()
            assert f.array("col").tobytes() == global_value("col", (4096,), "BFloat16").tobytes()


def test_missing_rank_file_named_with_parameter_and_ranks(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    lay = make_layout((4,), [[0], []])
    model = write_model(tmp_path / "src", [TensorDef("w", (8, 4), "Float32", lay)], device_num=4)
    model.rank_files[2].unlink()
    (tmp_path / "src" / "rank_2").rmdir()
    code = cli_main(["transform", str(tmp_path / "src"), "--src-strategy", str(model.strategy_path),
                     "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1
    assert "'w'" in err and "[2]" in err, err
    assert not (tmp_path / "o").exists() or not [p for p in (tmp_path / "o").rglob("*") if p.is_file()
                                                   and not p.name.startswith(".zckpt")]
    with pytest.raises(SourceError, match=r"source rank\(s\) \[2\]"):
        zckpt.transform_checkpoints(str(tmp_path / "src"), str(tmp_path / "o2"), "c_", str(model.strategy_path))
    assert not list((tmp_path / "o2").rglob("*.ckpt*"))


def test_stages_sharing_a_parameter_must_agree(tmp_path: Path) -> None:
    """A tied embedding held by both pipeline stages: a copy that differs is refused by name."""
    tied = TensorDef("tied", (8, 4), "Float32", make_layout((2,), [[0], []]))
    model = write_pipeline_model(tmp_path / "src", [[tied, TensorDef("a", (4,), "Float32", None)],
                                                    [tied, TensorDef("b", (4,), "Float32", None)]],
                                 stage_device_num=2)
    transform(tmp_path / "src", tmp_path / "ok", str(model.merged_strategy), None)
    with CkptReader(tmp_path / "ok" / "rank_0" / "checkpoint_0.ckpt") as f:
        assert f.array("tied").tobytes() == global_value("tied", (8, 4), "Float32").tobytes()
    victim = model.rank_files[3]
    raw = bytearray(victim.read_bytes())
    with CkptReader(victim) as r:
        at = r.entries["tied"].segments[0].offset + 5
    raw[at] ^= 0x01
    victim.write_bytes(bytes(raw))
    with pytest.raises(SourceError, match="pipeline stages") as err:
        transform(tmp_path / "src", tmp_path / "bad", str(model.merged_strategy), None)
    assert err.value.param == "tied"
    assert not list((tmp_path / "bad").rglob("*.ckpt")) if (tmp_path / "bad").exists() else True


def test_safetensors_output_equals_store_path(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    tensors = [t for t in _model(rng, 4, 8) if t.ms_type != "Bool"]
    model = write_model(tmp_path / "src", tensors, device_num=4, strings={"note": "st"})
    _dst_strategy(rng, tensors, 2, tmp_path / "dst.ckpt")
    assert cli_main(["transform", str(tmp_path / "src"), "--src-strategy", str(model.strategy_path),
                     "--dst-strategy", str(tmp_path / "dst.ckpt"), "--out", str(tmp_path / "direct"),
                     "--format", "safetensors", "--quiet"]) == 0
    zckpt.ingest(str(tmp_path / "src"), tmp_path / "s.zarr", str(model.strategy_path))
    zckpt.export(tmp_path / "s.zarr", tmp_path / "store", str(tmp_path / "dst.ckpt"),
                 options=zckpt.ExportOptions(format="safetensors"))
    assert _files(tmp_path / "direct") == _files(tmp_path / "store") != []
    for rel in _files(tmp_path / "store"):
        assert (tmp_path / "direct" / rel).read_bytes() == (tmp_path / "store" / rel).read_bytes(), rel
    # and back: safetensors jobs (whole and split HF-style) as sources of the direct path, to one full rank
    transform(tmp_path / "src", tmp_path / "split", str(model.strategy_path), str(tmp_path / "dst.ckpt"),
              options=TransformOptions(format="safetensors", max_file_bytes=2000))
    assert list((tmp_path / "split" / "rank_0").glob("*.index.json"))
    for job in ("direct", "split"):
        transform(tmp_path / job, tmp_path / f"full-{job}", str(tmp_path / "dst.ckpt"), None)
        with SafetensorsReader(tmp_path / "direct" / "rank_0" / "checkpoint_0.safetensors") as st, \
                CkptReader(tmp_path / f"full-{job}" / "rank_0" / "checkpoint_0.ckpt") as full:
            assert st.string("note") == full.string("note") == "st"
            for t in tensors:
                assert full.array(t.name).tobytes() == global_value(t.name, t.shape, t.ms_type).tobytes(), t.name


def test_existing_outputs_refused_then_resumed_or_overwritten(tmp_path: Path) -> None:
    src, src_s, dst_s = SRC, SRC_S, DST_S
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "stray.txt").write_text("x")
    with pytest.raises(zckpt.OutputError, match="overwrite"):
        transform(src, tmp_path / "o", str(src_s), str(dst_s))
    transform(src, tmp_path / "o", str(src_s), str(dst_s), options=TransformOptions(overwrite=True))
    assert diff_dirs(EXAMPLE / "dst" / "expected", tmp_path / "o") == []
    transform(src, tmp_path / "p", str(src_s), str(dst_s), ranks=[1])
    (tmp_path / "p" / "rank_1" / "checkpoint_1.ckpt").unlink()
    transform(src, tmp_path / "p", str(src_s), str(dst_s), ranks=[1])  # the same run again: resumes
    assert (tmp_path / "p" / "rank_1" / "checkpoint_1.ckpt").read_bytes() == \
        (tmp_path / "o" / "rank_1" / "checkpoint_1.ckpt").read_bytes()


def test_mindformers_iteration_to_a_url_refused_by_name(tmp_path: Path) -> None:
    """The direct path writes to output URLs (tests/test_transform_urls.py), but a MindFormers
    iteration only to a local directory (as export), refused before the sources are read."""
    with pytest.raises(UsageError, match="MindFormers iteration is written to a local directory") as caught:
        transform(tmp_path / "src", "memory://zckpt-mf/out", options=TransformOptions(format="mindformers"))
    assert caught.value.path == "memory://zckpt-mf/out"


def test_segment_spans_follow_the_values() -> None:
    e = EntryInfo("w", "tensor", "Float32", (6, 2), (Segment(100, 16), Segment(200, 24), Segment(300, 8)))
    payload = ({100 + i: i for i in range(16)} | {200 + i: 16 + i for i in range(24)}
               | {300 + i: 40 + i for i in range(8)})
    for a, b in itertools.combinations(range(49), 2):
        got = [payload[off + k] for off, n in segment_spans(e, a, b) for k in range(n)]
        assert got == list(range(a, b)), (a, b)


def test_choice_func_and_specify_prefix_leave_entries_out(tmp_path: Path) -> None:
    """MindSpore's choice_func / --specify-prefix: the entries left out are not in the files."""
    lay = make_layout((2,), [[0], []])
    model = write_model(tmp_path / "src", [TensorDef("net.w", (8, 4), "Float32", lay),
                                           TensorDef("opt.m", (8, 4), "Float32", lay)], device_num=2)
    transform(tmp_path / "src", tmp_path / "api", str(model.strategy_path), None,
              options=TransformOptions(choice_func=lambda n: not n.startswith("opt.")))
    assert cli_main(["transform", str(tmp_path / "src"), "--src-strategy", str(model.strategy_path),
                     "--out", str(tmp_path / "cli"), "--specify-prefix", "net.", "--quiet"]) == 0
    with CkptReader(tmp_path / "api" / "rank_0" / "checkpoint_0.ckpt") as a, \
            CkptReader(tmp_path / "cli" / "rank_0" / "checkpoint_0.ckpt") as c:
        assert "opt.m" not in a.entries and "learning_rate" in a.entries
        assert list(c.entries) == ["net.w"]
        assert a.array("net.w").tobytes() == c.array("net.w").tobytes() == \
            global_value("net.w", (8, 4), "Float32").tobytes()


def test_meeting_finds_exactly_the_overlapping_source_boxes() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        ndim = int(rng.integers(1, 4))
        writes = []
        for r in range(int(rng.integers(0, 12))):
            a = rng.integers(0, 10, ndim)
            stop = a + rng.integers(1, 5, ndim)
            writes.append(Write("w", r, Box(tuple(int(x) for x in a), tuple(int(x) for x in stop))))
        a = rng.integers(0, 10, ndim)
        box = Box(tuple(int(x) for x in a), tuple(int(x) for x in a + rng.integers(1, 6, ndim)))
        brute = [i for i, w in enumerate(writes)
                 if all(ws < be and bs < we
                        for ws, we, bs, be in zip(w.box.start, w.box.stop, box.start, box.stop, strict=True))]
        assert meeting(writes, box) == brute


def test_direct_path_imports_neither_zarr_nor_dask(tmp_path: Path) -> None:
    """``zckpt transform`` and ``import zckpt as ms; ms.transform_checkpoints`` never read a
    store or start a cluster: importing Zarr (and its asyncio, fsspec, numcodecs) or Dask
    for them would add about a second with a cold page cache to a job a copy does in two."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys\n"
        "import zckpt as ms\n"
        "from zckpt.cli.main import main\n"
        f"assert main(['transform', {str(SRC)!r}, '--src-strategy', {str(SRC_S)!r}, '--dst-strategy', "
        f"{str(DST_S)!r}, '--out', {str(tmp_path / 'out')!r}, '--quiet']) == 0\n"
        f"ms.transform_checkpoints({str(SRC)!r}, {str(tmp_path / 'api')!r}, 'checkpoint_', {str(SRC_S)!r}, "
        f"{str(DST_S)!r})\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'zarr', 'dask', 'distributed', 'fsspec'}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout
    assert diff_dirs(EXAMPLE / "dst" / "expected", tmp_path / "out") == []
    assert diff_dirs(EXAMPLE / "dst" / "expected", tmp_path / "api") == []


def test_merged_replica_checks_keep_what_is_only_sampled() -> None:
    """In one process the replica comparisons run as one merged task; the checks that are only
    spot-checked by default stay spot-checked there (not compared in full), and the others
    stay compared in full."""
    from zckpt.plan.values import ReplicaCheck
    from zckpt.sources.replicas import CheckJob, merged

    spot = ReplicaCheck("w", 4, Box((0, 0), (64, 64)), (0,), "replica")
    full = ReplicaCheck("w", 5, Box((0, 0), (64, 64)), (0,), "replica")
    jobs = [CheckJob(4, (spot,), (), {4: "a"}, {4: {}}, 1, frozenset({spot})),
            CheckJob(5, (full,), (), {5: "b"}, {5: {}}, 1, frozenset())]
    (one,) = merged(jobs)
    assert one.checks == (spot, full)
    assert one.sampled == frozenset({spot})
    a, b = merged(jobs, 2)  # one task per worker thread of a cluster
    assert (a.checks, a.sampled, b.checks, b.sampled) == ((spot,), frozenset({spot}), (full,), frozenset())
