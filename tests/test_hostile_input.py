"""Hostile input through the command line: one clear line naming file and parameter,
exit code 1, and no output that looks complete.

Extends tests/test_bad_input.py (same bundled MindSpore example, 8 source ranks) with
strategies that lie about the layout, damage in the middle of a tensor, CRC trailers,
impossible dims, and a disk that fills up during export and during ingest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from zckpt.cli.main import main as cli_main
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.ckpt_encoding import CRC_MAGIC, value_header
from zckpt.formats.strategy import ParamLayout, StrategyMap, encode_strategy, make_layout, read_strategy
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef, global_value
from zckpt.store.store import Store

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"


@pytest.fixture
def example(tmp_path: Path) -> Path:
    dst = tmp_path / "example"
    shutil.copytree(EXAMPLE, dst)
    for p in dst.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


def _rank_file(ex: Path, rank: int) -> Path:
    return ex / "src" / "checkpoints" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"


def _ingest(ex: Path, store: Path, strategy: Path | None = None) -> list[str]:
    return ["ingest", str(ex / "src" / "checkpoints"), "--strategy", str(strategy or ex / "src" / "strategy.ckpt"),
            "--store", str(store), "--quiet"]


def _fails(args: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """Run the CLI; it must fail with exit code 1 and exactly one error line holding every needle."""
    code = cli_main(args)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 1, (code, captured.out, err)
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert err.startswith(f"zckpt {args[0]}: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def _no_store(store: Path) -> None:
    assert not store.exists(), "a failed ingest left its store behind"


def _no_ckpt(out: Path) -> None:
    assert not list(out.rglob("*.ckpt")) if out.exists() else True, "a failed export left a .ckpt"
    assert not list(out.rglob("*.tmp-zckpt")) if out.exists() else True, "a failed export left a temporary file"


def _strategy(ex: Path, change: dict[str, ParamLayout], name: str = "strategy.ckpt") -> Path:
    smap = read_strategy(ex / "src" / "strategy.ckpt")
    layouts = {k: dict(v) for k, v in smap.layouts.items()}
    for param, lay in change.items():
        layouts[param] = {0: lay}
    path = ex / name
    path.write_bytes(encode_strategy(StrategyMap(layouts=layouts)))
    return path


def _with_devices(ex: Path, n: int, name: str) -> Path:
    """The source strategy with every device matrix scaled to ``n`` devices (same tensor maps)."""
    smap = read_strategy(ex / "src" / "strategy.ckpt")
    change = {}
    for param, per in smap.layouts.items():
        lay = per[0]
        change[param] = replace(lay, dev_matrix=(n,) if len(lay.dev_matrix) == 1 else (2, 2, n // 4))
    return _strategy(ex, change, name)


# --------------------------------------------------------------------------- strategies that lie


def test_tensor_map_naming_a_missing_axis(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zckpt.third_party.mindspore_proto import ms_node_strategy_pb2 as pb

    msg = pb.ParallelStrategyMap()
    msg.ParseFromString((example / "src" / "strategy.ckpt").read_bytes())
    for item in msg.parallel_layout_item:
        if item.param_name == "layer3.weight":
            item.parallel_layouts.tensor_map[0].dim[0] = 5
    bad = example / "axis.ckpt"
    bad.write_bytes(msg.SerializeToString())
    store = tmp_path / "s.zarr"
    _fails(_ingest(example, store, bad), capsys, "axis.ckpt", "'layer3.weight'", "device axis 5")
    _no_store(store)


def test_strategy_for_more_devices_than_rank_files(example: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """16 devices described, 8 rank files present: the missing ranks are named."""
    store = tmp_path / "s.zarr"
    _fails(_ingest(example, store, _with_devices(example, 16, "sixteen.ckpt")), capsys,
           "parameter '", "missing source rank(s) [8, 9")
    _no_store(store)


def test_strategy_for_fewer_devices_than_rank_files(example: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """4 devices described, 8 rank files of one job present. Reading ranks 0-3 as the
    whole job makes every global shape wrong (half the rows): it must be refused."""
    store = tmp_path / "s.zarr"
    args = _ingest(example, store, _with_devices(example, 4, "four.ckpt"))
    code = cli_main(args)
    captured = capsys.readouterr()
    assert code == 1, captured.out
    assert "four.ckpt" in captured.err and "[4, 5, 6, 7]" in captured.err, captured.err
    _no_store(store)


def test_optimizer_shard_that_does_not_fit_the_source(example: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """layer2.bias is replicated on 8 devices; an optimizer split of 5 cannot be cut from them."""
    bad = _strategy(example, {"layer2.bias": make_layout((8,), [[]], opt_shard_size=5)}, "opt5.ckpt")
    store = tmp_path / "s.zarr"
    _fails(_ingest(example, store, bad), capsys, "checkpoint_", "'layer2.bias'", "optimizer shard size 5")
    _no_store(store)


@pytest.mark.parametrize(("layout", "needle"), [
    (make_layout((4,), [[]], opt_shard_size=-1), "cannot be split into 4 optimizer shards"),
    (make_layout((4,), [[0]]), "dimension 0 of size 1 cannot be split into 4 equal parts"),
    (make_layout((4,), [[0], []]), "tensor_map has 2 entries"),
])
def test_destination_layout_that_does_not_fit(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              layout: ParamLayout, needle: str) -> None:
    """global_step has one row: neither 4 optimizer shards nor 4 tensor-parallel pieces fit it."""
    store = tmp_path / "s.zarr"
    assert cli_main(_ingest(example, store)) == 0
    dst = read_strategy(example / "dst" / "strategy.ckpt")
    layouts = {k: dict(v) for k, v in dst.layouts.items()}
    layouts["global_step"] = {0: layout}
    bad = tmp_path / "dst_bad.ckpt"
    bad.write_bytes(encode_strategy(StrategyMap(layouts=layouts)))
    out = tmp_path / "out"
    capsys.readouterr()
    _fails(["export", str(store), "--strategy", str(bad), "--out", str(out), "--quiet"], capsys,
           "'global_step'", needle)
    _no_ckpt(out)


# --------------------------------------------------------------------------- damaged checkpoint files


def test_truncated_in_the_middle_of_a_tensor(example: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    f = _rank_file(example, 3)
    with CkptReader(f) as r:
        seg = r.entries["layer3.weight"].segments[0]
    f.write_bytes(f.read_bytes()[: seg.offset + seg.length // 2])
    store = tmp_path / "s.zarr"
    _fails(_ingest(example, store), capsys, str(f), "'layer3.weight'", "truncated")
    _no_store(store)


def test_bit_flip_in_the_dims_of_a_tensor(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _rank_file(example, 6)
    data = bytearray(f.read_bytes())
    with CkptReader(f) as r:
        seg = r.entries["moments.layer2.weight"].segments[0]
    header = value_header("moments.layer2.weight", "Float32", [6, 48], seg.length)
    at = bytes(data).index(header)
    dims_at = at + header.index(b"\x08\x06") + 1  # the varint 6 of dims[0]
    data[dims_at] ^= 0x01  # 6 -> 7 rows
    f.write_bytes(bytes(data))
    store = tmp_path / "s.zarr"
    _fails(_ingest(example, store), capsys, str(f), "'moments.layer2.weight'", "dims [7, 48]")
    _no_store(store)


def _add_crc(f: Path, crc: int | None = None) -> None:
    content = f.read_bytes()
    f.write_bytes(content + CRC_MAGIC + (zlib.crc32(content) if crc is None else crc).to_bytes(10, "big"))


def test_bit_flip_in_the_middle_of_a_tensor_under_a_crc(example: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    f = _rank_file(example, 1)
    _add_crc(f)
    with CkptReader(f) as r:
        seg = r.entries["layer1.weight"].segments[0]
    data = bytearray(f.read_bytes())
    data[seg.offset + seg.length // 2] ^= 0x04
    f.write_bytes(bytes(data))
    store = tmp_path / "s.zarr"
    _fails(_ingest(example, store), capsys, str(f), "crc_num trailer mismatch", "damaged")
    _no_store(store)


def test_wrong_crc_trailer(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _rank_file(example, 2)
    _add_crc(f, crc=0xDEADBEEF)
    store = tmp_path / "s.zarr"
    _fails(_ingest(example, store), capsys, str(f), "crc_num trailer mismatch", str(0xDEADBEEF))
    _no_store(store)


@pytest.mark.parametrize(("dims", "payload"), [
    ([2**31, 2**31, 0], b""),  # no elements, yet no array of that shape can exist
    ([2**62, 2**62], b"\0" * 16),
    ([2**63 - 1, 4], b"\0" * 16),
])
def test_dims_whose_product_overflows(example: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      dims: list[int], payload: bytes) -> None:
    f = _rank_file(example, 0)
    f.write_bytes(f.read_bytes() + value_header("huge.weight", "Float32", dims, len(payload)) + payload)
    store = tmp_path / "s.zarr"
    _fails(_ingest(example, store), capsys, str(f), "'huge.weight'", "overflow int64")
    _no_store(store)


# --------------------------------------------------------------------------- full disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only; skipped where mounting is not permitted)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _big_model(root: Path) -> tuple[list[TensorDef], StrategyMap]:
    """About 2 MiB of Float32 on 2 source ranks; the destination splits it over 4 ranks."""
    src_lay = make_layout((2,), [[0], []])
    tensors = [TensorDef(f"w{i}", (256, 512), "Float32", src_lay) for i in range(4)]
    write_model(root, tensors, device_num=2, scalars=False)
    dst = StrategyMap(layouts={t.name: {0: make_layout((4,), [[0], []])} for t in tensors})
    return tensors, dst


def test_export_onto_a_full_disk(tmp_path: Path, small_disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors, dst = _big_model(tmp_path / "src")
    store = tmp_path / "s.zarr"
    assert cli_main(["ingest", str(tmp_path / "src"), "--strategy", str(tmp_path / "src" / "strategy.ckpt"),
                     "--store", str(store), "--quiet"]) == 0
    dst_file = tmp_path / "dst.ckpt"
    dst_file.write_bytes(encode_strategy(dst))
    out = small_disk / "out"
    capsys.readouterr()
    _fails(["export", str(store), "--strategy", str(dst_file), "--out", str(out), "--quiet"], capsys,
           "No space left on device")
    assert not list(out.rglob("*.tmp-zckpt")), "temporary file left behind"
    written = sorted(out.rglob("*.ckpt"))
    assert len(written) < 4, "the disk was not too small: the test proves nothing"
    for f in written:  # whatever carries a final name is a complete, correct rank file
        rank = int(f.parent.name.split("_")[1])
        with CkptReader(f) as r:
            assert r.names() == [t.name for t in tensors]
            for t in tensors:
                rows = slice(rank * 64, rank * 64 + 64)
                assert r.array(t.name).tobytes() == global_value(t.name, t.shape, t.ms_type)[rows].tobytes()


def test_ingest_onto_a_full_disk(tmp_path: Path, small_disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _big_model(tmp_path / "src")
    store = small_disk / "s.zarr"
    _fails(["ingest", str(tmp_path / "src"), "--strategy", str(tmp_path / "src" / "strategy.ckpt"),
            "--store", str(store), "--quiet"], capsys, "No space left on device")
    if store.exists():  # kept for a resumed ingest, but it must not claim to be complete
        assert not Store.open(store).complete
        _fails(["export", str(store), "--out", str(tmp_path / "out"), "--quiet"], capsys, "incomplete")
        _no_ckpt(tmp_path / "out")


def test_empty_tensor_with_a_huge_dimension_does_not_hang(tmp_path: Path) -> None:
    """A tensor with no elements but a dimension of 2**40 is valid for numpy (and for the
    reader); ingest must finish at once instead of searching 2**39 candidate chunk sizes."""
    src = tmp_path / "src" / "rank_0"
    src.mkdir(parents=True)
    (src / "checkpoint_0.ckpt").write_bytes(
        value_header("empty", "Float32", [0, 2**40], 0) + value_header("w", "Float32", [2], 8) + b"\0" * 8)
    store = tmp_path / "s.zarr"
    cmd = [sys.executable, "-m", "zckpt.cli", "ingest", str(tmp_path / "src"), "--store", str(store), "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert Store.open(store).entry("empty").shape == (0, 2**40)
