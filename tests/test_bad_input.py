"""Bad input: a clear zckpt error naming file and parameter, exit code 1, nothing that looks complete.

Uses the bundled MindSpore example (docs/example), so it runs without ../shared.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.core.layout import Box
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.ckpt_encoding import value_header
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout, read_strategy
from zckpt.io.safe_paths import temp_name
from zckpt.plan.values import Write
from zckpt.store.store import Store

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"


@pytest.fixture
def example(tmp_path: Path) -> Path:
    dst = tmp_path / "example"
    shutil.copytree(EXAMPLE, dst)
    return dst


def _ingest_args(ex: Path, store: Path) -> list[str]:
    return ["ingest", str(ex / "src" / "checkpoints"), "--strategy", str(ex / "src" / "strategy.ckpt"),
            "--store", str(store)]


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli_main(args)
    return code, capsys.readouterr().err


def test_truncated_ckpt(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = example / "src" / "checkpoints" / "rank_3" / "checkpoint_3.ckpt"
    f.write_bytes(f.read_bytes()[:-100])
    store = tmp_path / "s.zarr"
    code, err = _run(_ingest_args(example, store), capsys)
    assert code == 1
    assert "checkpoint_3.ckpt" in err and "truncated" in err
    assert not store.exists()


@pytest.mark.parametrize("way", ["whole chunks", "runs"])
def test_source_truncated_after_it_was_indexed(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch, way: str) -> None:
    """A shard cut short between its index and the copy (another program rewriting it) is
    named with the parameter whose payload it ends in, on both copy paths, and no store is left."""
    import importlib

    ingest_mod = importlib.import_module("zckpt.jobs.ingest")  # the module: zckpt.ingest is also the function

    real = ingest_mod.whole_chunk_copies
    cut: list[tuple[str, str]] = []

    def truncating(store: Store, reader: CkptReader, writes: tuple[Write, ...],
                   limit: int) -> tuple[list[Any], tuple[Write, ...]]:
        whole, left = real(store, reader, writes, limit)
        if way == "runs":
            whole, left = [], writes
        if whole and not cut:
            first = whole[0]
            os.truncate(reader.path, first.source + first.length // 2)
            cut.append((Path(reader.path).name, first.name))
        elif left and not cut:
            seg = reader.entries[left[0].name].segments[0]
            os.truncate(reader.path, seg.offset + seg.length // 2)
            cut.append((Path(reader.path).name, left[0].name))
        return whole, left

    monkeypatch.setattr(ingest_mod, "whole_chunk_copies", truncating)
    store = tmp_path / "s.zarr"
    code, err = _run(_ingest_args(example, store), capsys)
    assert cut, "no source was cut: the test missed the copy"
    assert code == 1
    assert cut[0][0] in err and cut[0][1] in err and "changed after it was indexed" in err
    assert not store.exists()


def test_payload_length_disagrees_with_dims(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = example / "src" / "checkpoints" / "rank_0" / "checkpoint_0.ckpt"
    payload = b"\0" * 12
    f.write_bytes(f.read_bytes() + value_header("extra.weight", "Float32", [2, 2], len(payload)) + payload)
    code, err = _run(_ingest_args(example, tmp_path / "s.zarr"), capsys)
    assert code == 1
    assert "checkpoint_0.ckpt" in err and "extra.weight" in err and "16" in err


def test_unknown_dtype(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = example / "src" / "checkpoints" / "rank_0" / "checkpoint_0.ckpt"
    f.write_bytes(f.read_bytes() + value_header("odd", "Float8", [4], 4) + b"\0" * 4)
    code, err = _run(_ingest_args(example, tmp_path / "s.zarr"), capsys)
    assert code == 1
    assert "Float8" in err and "odd" in err


def test_missing_source_rank(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.rmtree(example / "src" / "checkpoints" / "rank_5")
    code, err = _run(_ingest_args(example, tmp_path / "s.zarr"), capsys)
    assert code == 1
    assert "missing source rank" in err and "5" in err
    assert "parameter" in err


@pytest.mark.parametrize(("rank", "spotted"), [(4, True), (5, False)])
def test_replicas_that_disagree(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], rank: int,
                                spotted: bool) -> None:
    """layer1.weight: ``dev_matrix [2, 2, 2]``, ``tensor_map [[], [1]]``, so the ranks with the
    same middle coordinate hold the same box; rank 0 (0, 0, 0) writes it. Rank 4 (1, 0, 0)
    is one step from it along axis 0, a replica the default spot check reads (its 3 KiB lie
    within the sampled ends); rank 5 (1, 0, 1) is two steps away (axes 0 and 2), a replica
    only ``--verify-replicas`` compares. Corrupt one value byte of that replica: ingest and
    transform refuse it, naming the parameter and the file; the unspotted one only when asked."""
    f = example / "src" / "checkpoints" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"
    with CkptReader(f) as r:
        seg = r.entries["layer1.weight"].segments[0]
    data = bytearray(f.read_bytes())
    data[seg.offset] ^= 0xFF
    f.write_bytes(bytes(data))
    transform = ["transform", str(example / "src" / "checkpoints"), "--src-strategy",
                 str(example / "src" / "strategy.ckpt"), "--dst-strategy", str(example / "dst" / "strategy.ckpt"),
                 "--out"]
    for what in ("ingest", "transform"):
        for verify in (False, True):
            out = tmp_path / f"{what}-{verify}"
            args = _ingest_args(example, out) if what == "ingest" else [*transform, str(out)]
            code, err = _run([*args, *(["--verify-replicas"] if verify else [])], capsys)
            if spotted or verify:
                assert code == 1, f"{what} verify_replicas={verify}: the replica that differs was not refused"
                assert "'layer1.weight'" in err and "replica" in err and f"checkpoint_{rank}.ckpt" in err, err
                assert not out.exists(), f"{what} left {sorted(out.rglob('*'))} (nothing may be left)"
            else:  # the documented default: replicas are spot-checked, not compared in full
                assert code == 0, f"{what}: {err}"


def test_strategy_that_does_not_fit(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "s.zarr"
    assert cli_main(_ingest_args(example, store)) == 0
    smap = read_strategy(example / "dst" / "strategy.ckpt")
    layouts = {k: dict(v) for k, v in smap.layouts.items()}
    layouts["layer2.bias"] = {0: make_layout([4], [0, -1])}  # a 2-D map for a 1-D tensor
    bad = tmp_path / "bad_strategy.ckpt"
    bad.write_bytes(encode_strategy(StrategyMap(layouts=layouts)))
    out = tmp_path / "out"
    code, err = _run(["export", str(store), "--strategy", str(bad), "--out", str(out)], capsys)
    assert code == 1
    assert "layer2.bias" in err and "tensor_map has 2 entries" in err
    assert not list(out.rglob("*.ckpt")) if out.exists() else True


def test_tensor_map_axis_out_of_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zckpt.third_party.mindspore_proto import ms_node_strategy_pb2 as pb

    msg = pb.ParallelStrategyMap()
    msg.current_stage = 0
    item = msg.parallel_layout_item.add()
    item.param_name = "w"
    lay = item.parallel_layouts
    lay.dev_matrix.add().dim.extend([2, 2])
    lay.tensor_map.add().dim.extend([3, -1])
    lay.field, lay.opt_weight_shard_step, lay.opt_weight_shard_size = 0, 0, 0
    f = tmp_path / "s.ckpt"
    f.write_bytes(msg.SerializeToString())
    with pytest.raises(zckpt.StrategyError, match="axis 3"):
        read_strategy(f)


def test_not_a_strategy_file(tmp_path: Path, example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"\xff\xff\xff\xff garbage")
    code, err = _run(["ingest", str(example / "src" / "checkpoints"), "--strategy", str(junk),
                      "--store", str(tmp_path / "s.zarr")], capsys)
    assert code == 1
    assert "junk.ckpt" in err and "protobuf" in err
    js = tmp_path / "junk.json"
    js.write_text("{not json")
    with pytest.raises(zckpt.StrategyError, match="JSON"):
        read_strategy(js)


def test_existing_output_refused_without_overwrite(example: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "s.zarr"
    assert cli_main(_ingest_args(example, store)) == 0
    out = tmp_path / "out"
    exp = ["export", str(store), "--strategy", str(example / "dst" / "strategy.ckpt"), "--out", str(out)]
    assert cli_main(exp) == 0
    before = (out / "rank_0" / "checkpoint_0.ckpt").read_bytes()
    capsys.readouterr()
    assert cli_main(exp) == 0  # the same export again: every file is already complete
    assert "4 kept, 0 written: already complete" in capsys.readouterr().out
    code, err = _run([*exp[:-2], "--out", str(out), "--prefix", "net_"], capsys)  # another export, same directory
    assert code == 1 and "already holds" in err
    (out / "notes.txt").write_text("someone else's file")
    code, err = _run(["export", str(store), "--out", str(out)], capsys)
    assert code == 1 and "already holds" in err
    assert cli_main([*exp, "--overwrite"]) == 0
    assert (out / "rank_0" / "checkpoint_0.ckpt").read_bytes() == before
    assert cli_main(_ingest_args(example, store)) == 0  # the same ingest again: already complete, nothing to do
    only0 = tmp_path / "only0"
    shutil.copytree(example / "src" / "checkpoints" / "rank_0", only0 / "rank_0")
    code, err = _run(["ingest", str(only0), "--store", str(store)], capsys)  # no strategy: another ingest
    assert code == 1 and "holds a different ingest" in err


def test_export_killed_while_writing_its_marker_reruns(example: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """An export killed between creating its marker's temporary file and renaming it leaves
    only that file: the rerun of the same export removes it and writes every rank, where it
    used to refuse the directory as another export's."""
    store = tmp_path / "s.zarr"
    assert cli_main(_ingest_args(example, store)) == 0
    out = tmp_path / "out"
    out.mkdir()
    half = temp_name(out / ".zckpt-export.json")  # the marker's temporary name, as write_atomic makes it
    half.write_bytes(b'{"fingerp')
    assert cli_main(["export", str(store), "--strategy", str(example / "dst" / "strategy.ckpt"),
                     "--out", str(out)]) == 0
    assert not half.exists()
    expected = example / "dst" / "expected"
    wrote = sorted(p.relative_to(out) for p in out.rglob("*.ckpt"))
    assert wrote and wrote == sorted(p.relative_to(expected) for p in expected.rglob("*.ckpt"))
    assert all((out / p).read_bytes() == (expected / p).read_bytes() for p in wrote)
    (out / "notes.txt").write_text("someone else's file")  # any other stray file still makes it not ours
    code, err = _run(["export", str(store), "--out", str(tmp_path / "out"), "--prefix", "net_",
                      "--strategy", str(example / "dst" / "strategy.ckpt")], capsys)
    assert code == 1 and "already holds" in err


def test_incomplete_store_refused_by_export(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = {r: str(example / "src" / "checkpoints" / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in (0, 1)}
    store = tmp_path / "partial.zarr"
    report = zckpt.ingest(files, store, str(example / "src" / "strategy.ckpt"),
                          zckpt.IngestOptions(require_complete=False))
    assert not report.complete and report.uncovered
    out = tmp_path / "out"
    code, err = _run(["export", str(store), "--strategy", str(example / "dst" / "strategy.ckpt"),
                      "--out", str(out)], capsys)
    assert code == 1
    assert "incomplete" in err and "parameter" in err
    assert not list(out.rglob("*.ckpt")) if out.exists() else True


def test_failed_export_leaves_no_complete_looking_file(example: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "s.zarr"
    assert cli_main(_ingest_args(example, store)) == 0
    from zckpt.store.reader import StoreReader

    calls = {"n": 0}
    real = StoreReader.materialise

    def failing(self: StoreReader, items: list[tuple[str, Box]]) -> list[np.ndarray]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(self, items)

    monkeypatch.setattr(StoreReader, "materialise", failing)
    opts = zckpt.ExportOptions(block_bytes=4096)  # several batches per rank
    out = tmp_path / "out"
    with pytest.raises(OSError):
        zckpt.export(store, out, str(example / "dst" / "strategy.ckpt"), options=opts)
    assert not list(out.rglob("*.ckpt")), "a partial file was left under a final name"
    assert not list(out.rglob("*.tmp-zckpt")), "temporary file left behind"
