"""The store is standard Zarr v3: zarr-python alone and TensorStore read every dtype with the
values the generator put into the sharded sources, and zckpt's consolidated metadata
keeps both zarr-python and zckpt itself reading the same bytes.

bf16 is stored as Zarr ``uint16`` (the exact bit patterns) with the array attribute
``zckpt.ms_dtype = "BFloat16"`` (docs/store-format.md); these tests pin that representation.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sf_models import STRINGS, entries_by_name, ingest_all_dtypes

import zckpt
from zckpt.cli import main
from zckpt.dtypes import ms_dtype
from zckpt.errors import StoreError
from zckpt.generate import GeneratedModel, global_value
from zckpt.store import Store
from zckpt.store_tools import consolidate

TOOLS = Path(__file__).resolve().parent / "tools"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[GeneratedModel, Path]:
    return ingest_all_dtypes(tmp_path_factory.mktemp("std"))


def _sha(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).view(np.uint8).tobytes()).hexdigest()


def _read_with_zarr_only(store: Path, *extra: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(TOOLS / "zarr_read_store.py"), str(store), *extra],
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def _check(model: GeneratedModel, doc: dict[str, Any]) -> None:
    assert doc["zckpt_blocked"], "the reading script must not be able to import zckpt"
    entries = doc["entries"]
    assert set(entries) == {t.name for t in model.tensors} | set(STRINGS)
    for t in model.tensors:
        got = entries[t.name]
        value = global_value(t.name, t.shape, t.ms_type)
        assert got["shape"] == list(t.shape), t.name
        assert got["sha256"] == _sha(value), f"{t.name}: zarr-python reads other bytes"
        assert got["ms_dtype"] == t.ms_type
        assert got["numpy"] == ms_dtype(t.ms_type).storage.str
        # the stored Zarr data type: bf16 is kept as its uint16 bit patterns
        assert got["data_type"] == ("uint16" if t.ms_type == "BFloat16" else np.dtype(got["numpy"]).name)
    for name, value in STRINGS.items():
        assert entries[name] == {"kind": "str", "value": value}


def test_zarr_python_alone_reads_every_dtype(job: tuple[GeneratedModel, Path]) -> None:
    model, store = job
    _check(model, _read_with_zarr_only(store))


def test_tensorstore_reads_every_dtype(job: tuple[GeneratedModel, Path]) -> None:
    ts = pytest.importorskip("tensorstore", reason="TensorStore is not installed (pip install tensorstore)")
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (a TensorStore dependency) is missing")
    model, store = job
    manifest = json.loads((store / "zarr.json").read_text())["attributes"]["zckpt"]
    keys = {e["name"]: e["key"] for e in manifest["entries"]}
    for t in model.tensors:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(store / keys[t.name])}}
        arr = ts.open(spec, read=True).result()
        got = np.asarray(arr.read().result())
        value = global_value(t.name, t.shape, t.ms_type)
        assert got.shape == t.shape and got.dtype == ms_dtype(t.ms_type).storage, t.name
        assert _sha(got) == _sha(value), f"{t.name}: TensorStore reads other bytes"
        if t.ms_type == "BFloat16":
            assert arr.dtype.name == "uint16"  # today's representation: the bits, as Zarr uint16
            as_f32 = (got.astype(np.uint32) << 16).view(np.float32)
            np.testing.assert_array_equal(got.view(ml_dtypes.bfloat16).astype(np.float32), as_f32)


def test_consolidated_metadata(job: tuple[GeneratedModel, Path], tmp_path: Path) -> None:
    model, store = job
    copy = tmp_path / "c.zarr"
    shutil.copytree(store, copy)
    before = _read_with_zarr_only(copy)
    rep = consolidate(copy)
    root = json.loads((copy / "zarr.json").read_text())
    assert rep.nodes == len(root["consolidated_metadata"]["metadata"]) and rep.nodes >= len(model.tensors)
    after = _read_with_zarr_only(copy, "--consolidated")
    _check(model, after)
    assert after["tensor_arrays"] == before["tensor_arrays"]
    # zckpt still opens it and exports the same bytes
    a = zckpt.export(store, tmp_path / "a", str(model.strategy_path))
    b = zckpt.export(Store.open(copy), tmp_path / "b", str(model.strategy_path))
    for x, y in zip(a.ranks, b.ranks, strict=True):
        assert entries_by_name(Path(y.path)) == entries_by_name(Path(x.path))


def test_consolidate_refuses_incomplete_store(job: tuple[GeneratedModel, Path], tmp_path: Path) -> None:
    model, _ = job
    partial = tmp_path / "p.zarr"
    zckpt.ingest({0: model.rank_files[0]}, partial, str(model.strategy_path),
                 zckpt.IngestOptions(require_complete=False))
    with pytest.raises(StoreError, match="not complete"):
        consolidate(partial)
    assert "consolidated_metadata" not in json.loads((partial / "zarr.json").read_text())


def test_consolidate_cli(job: tuple[GeneratedModel, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, store = job
    copy = tmp_path / "c.zarr"
    shutil.copytree(store, copy)
    assert main(["consolidate", str(copy), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["nodes"] > 0 and doc["root_bytes"] == os.path.getsize(copy / "zarr.json")
    assert main(["consolidate", str(tmp_path / "nothing.zarr")]) == 1
    assert "not a zarr store" in capsys.readouterr().err
