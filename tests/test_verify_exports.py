"""``zckpt verify --against`` on safetensors exports (single and split files) and on
``.ckpt`` exports whose entries come in another order (``--any-order``): equal values
pass, a changed value is named either way."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.ckpt_writer import CkptWriter
from zckpt.formats.safetensors import SafetensorsReader
from zckpt.jobs.verify import verify

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SRC = EXAMPLE / "src" / "checkpoints"
SRC_STRATEGY = EXAMPLE / "src" / "strategy.ckpt"
DST_STRATEGY = EXAMPLE / "dst" / "strategy.ckpt"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vx")
    zckpt.ingest(str(SRC), root / "s.zarr", str(SRC_STRATEGY))
    return root / "s.zarr"


def _flip_first_tensor_byte(path: Path, name: str) -> None:
    with SafetensorsReader(path) as r:
        offset = r.entries[name].segments[0].offset
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("max_file_bytes", [0, 4000])
def test_safetensors_export_verifies_and_a_changed_value_is_named(store: Path, tmp_path: Path,
                                                                   max_file_bytes: int) -> None:
    out = tmp_path / "st"
    zckpt.export(store, out, str(DST_STRATEGY), options=zckpt.ExportOptions(format="safetensors",
                                                                             max_file_bytes=max_file_bytes))
    report = verify(store, against=out, dst_strategy=str(DST_STRATEGY))
    assert report.ok and report.export_files == 4, [m.render() for m in report.mismatches]
    files = sorted((out / "rank_2").glob("*.safetensors"))
    assert (len(files) > 1) == bool(max_file_bytes)
    target = next(f for f in files if "layer3.weight" in SafetensorsReader(f).entries)
    _flip_first_tensor_byte(target, "layer3.weight")
    report = verify(store, against=out, dst_strategy=str(DST_STRATEGY))
    assert [(m.param, "bytes differ" in m.message) for m in report.mismatches] == [("layer3.weight", True)]


def _reverse_entries(path: Path, change: str | None = None) -> None:
    """Rewrite a .ckpt with its entries in reverse order (as another writer may order them)."""
    tmp = path.with_name("reordered.ckpt")
    with CkptReader(path) as r, CkptWriter(tmp) as w:
        for name in reversed(r.names()):
            e = r.entries[name]
            arr = np.array(r.array(name))
            if name == change:
                arr.reshape(-1)[0] += 1
            w.write_array(name, e.ms_type, arr)
    shutil.move(tmp, path)


def test_ckpt_export_in_another_order_passes_with_any_order(store: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ck"
    zckpt.export(store, out, str(DST_STRATEGY))
    _reverse_entries(out / "rank_1" / "checkpoint_1.ckpt")
    args = ["verify", str(store), "--against", str(out), "--dst-strategy", str(DST_STRATEGY)]
    assert cli_main(args) == 1
    assert "entries are out of order" in capsys.readouterr().out
    assert cli_main([*args, "--any-order"]) == 0
    _reverse_entries(out / "rank_1" / "checkpoint_1.ckpt", change="moments.layer1.weight")
    assert cli_main([*args, "--any-order"]) == 1
    text = capsys.readouterr().out
    assert "moments.layer1.weight" in text and "bytes differ" in text and "out of order" not in text


def test_extra_safetensors_file_is_reported(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "st"
    zckpt.export(store, out, str(DST_STRATEGY), options=zckpt.ExportOptions(format="safetensors"))
    shutil.copy(out / "rank_0" / "checkpoint_0.safetensors", out / "rank_0" / "checkpoint_9.safetensors")
    report = verify(store, against=out, dst_strategy=str(DST_STRATEGY))
    assert [m.message for m in report.mismatches] == ["file is not part of this destination layout"]
