"""Every stored chunk has a CRC-32 recorded at ingest; export refuses a damaged chunk by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import zckpt
from zckpt.cli import main as cli_main

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SRC_S = str(EXAMPLE / "src" / "strategy.ckpt")
DST_S = str(EXAMPLE / "dst" / "strategy.ckpt")


def test_every_chunk_has_a_checksum(tmp_path: Path) -> None:
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), tmp_path / "s.zarr", SRC_S)
    st = zckpt.open_store(tmp_path / "s.zarr")
    recorded = sum(len(v) for v in st.checksums().values())
    files = [p for p in (tmp_path / "s.zarr").rglob("c*") if p.is_file() and p.parent.parent.name in
             ("tensors", "maps")]
    assert recorded == len(files) > 0


def test_export_refuses_a_damaged_chunk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, SRC_S)
    chunk = sorted((store / "tensors" / "layer2.weight").glob("c.*"))[0]
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x10
    chunk.write_bytes(bytes(data))
    out = tmp_path / "out"
    code = cli_main(["export", str(store), "--strategy", DST_S, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    assert "layer2.weight" in err and chunk.name in err and "checksum" in err
    assert not list(out.rglob("*.ckpt"))
    shutil.rmtree(out)
    assert cli_main(["export", str(store), "--strategy", DST_S, "--out", str(out), "--no-verify-checksums"]) == 0


def test_missing_chunk_is_named(tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, SRC_S)
    chunk = sorted((store / "tensors" / "layer1.weight").glob("c.*"))[-1]
    chunk.unlink()
    with pytest.raises(zckpt.StoreError, match="missing") as err:
        zckpt.export(store, tmp_path / "o", DST_S)
    assert chunk.name in str(err.value)
