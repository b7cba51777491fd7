"""The store is standard Zarr v3: zarr-python alone and TensorStore read every dtype with the
values the generator put into the sharded sources, and zckpt's consolidated metadata
keeps both zarr-python and zckpt itself reading the same bytes.

bf16 is stored as Zarr's extension data type ``bfloat16`` (docs/store-format.md): TensorStore
reads it natively; zarr-python needs the type registered (zckpt's standalone
``zckpt/zarr_bfloat16.py``, run by the reading script without zckpt importable), and without
it reads the documented fallback (raw chunk files as uint16 bits). Stores of format 1 kept
bf16 as ``uint16`` and must still read the same.
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
from zckpt import zarr_bfloat16
from zckpt.cli.main import main
from zckpt.core.dtypes import ms_dtype
from zckpt.core.errors import StoreError
from zckpt.jobs.generate import GeneratedModel
from zckpt.jobs.generate_model import global_value
from zckpt.jobs.verify import verify as zckpt_verify
from zckpt.store.consolidate import consolidate
from zckpt.store.store import Store

TOOLS = Path(__file__).resolve().parent / "tools"
BF16_TYPE = Path(zarr_bfloat16.__file__)
ZARR_CANNOT = "No Zarr data type found that matches 'bfloat16'"


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


def _check(model: GeneratedModel, doc: dict[str, Any], *, registered: bool, bf16_type: str = "bfloat16") -> None:
    """Every entry read with the generator's bytes; bf16 as ``bf16_type`` in ``zarr.json``,
    read as ml_dtypes bfloat16 when the type is registered, else through the raw fallback."""
    assert doc["zckpt_blocked"], "the reading script must not be able to import zckpt"
    entries = doc["entries"]
    assert set(entries) == {t.name for t in model.tensors} | set(STRINGS)
    for t in model.tensors:
        got = entries[t.name]
        value = global_value(t.name, t.shape, t.ms_type)
        assert got["shape"] == list(t.shape), t.name
        assert got["sha256"] == _sha(value), f"{t.name}: zarr-python reads other bytes"
        assert got["ms_dtype"] == t.ms_type
        if t.ms_type != "BFloat16":
            assert "open_error" not in got, got
            assert got["numpy"] == ms_dtype(t.ms_type).storage.str
            assert got["data_type"] == np.dtype(got["numpy"]).name
            continue
        assert got["data_type"] == bf16_type
        if registered or bf16_type == "uint16":
            assert "open_error" not in got, got
            assert got["numpy"] == ("bfloat16" if bf16_type == "bfloat16" else "<u2")
        else:
            assert ZARR_CANNOT in got["open_error"] and got["numpy"] == "<u2"
    for name, value in STRINGS.items():
        assert entries[name] == {"kind": "str", "value": value}


def test_zarr_python_with_registered_bfloat16_reads_every_dtype(job: tuple[GeneratedModel, Path]) -> None:
    model, store = job
    doc = _read_with_zarr_only(store, "--register", str(BF16_TYPE))
    _check(model, doc, registered=True)
    assert len(doc["tensor_arrays"]) == len(model.tensors)


def test_zarr_python_alone_cannot_open_bfloat16_and_reads_the_raw_fallback(job: tuple[GeneratedModel, Path]) -> None:
    model, store = job
    _check(model, _read_with_zarr_only(store), registered=False)


def test_bfloat16_type_file_is_standalone() -> None:
    """What the reading script runs must not need zckpt: it imports only numpy, ml_dtypes, zarr."""
    text = BF16_TYPE.read_text(encoding="utf-8")
    imports = [ln.split()[1] for ln in text.splitlines() if ln.startswith(("import ", "from "))]
    assert imports and all(m.split(".")[0] in {"__future__", "math", "dataclasses", "typing", "ml_dtypes",
                                                "numpy", "zarr"} for m in imports), imports


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
        assert _sha(got) == _sha(value), f"{t.name}: TensorStore reads other bytes"
        if t.ms_type == "BFloat16":
            assert arr.dtype.name == "bfloat16" and got.dtype == np.dtype(ml_dtypes.bfloat16), t.name
            assert got.shape == t.shape
            as_f32 = (value.astype(np.uint32) << 16).view(np.float32)
            np.testing.assert_array_equal(got.astype(np.float32), as_f32)
        else:
            assert got.shape == t.shape and got.dtype == ms_dtype(t.ms_type).storage, t.name


def test_consolidated_metadata(job: tuple[GeneratedModel, Path], tmp_path: Path) -> None:
    model, store = job
    copy = tmp_path / "c.zarr"
    shutil.copytree(store, copy)
    before = _read_with_zarr_only(copy, "--register", str(BF16_TYPE))
    rep = consolidate(copy)
    root = json.loads((copy / "zarr.json").read_text())
    assert rep.nodes == len(root["consolidated_metadata"]["metadata"]) and rep.nodes >= len(model.tensors)
    assert {m["data_type"] for m in root["consolidated_metadata"]["metadata"].values()
            if m["node_type"] == "array"} >= {"bfloat16", "float32"}
    after = _read_with_zarr_only(copy, "--consolidated", "--register", str(BF16_TYPE))
    _check(model, after, registered=True)
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
    assert json.loads((partial / "zarr.json").read_text()).get("consolidated_metadata") is None  # zarr < 3.1.6: null


def test_consolidate_cli(job: tuple[GeneratedModel, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, store = job
    copy = tmp_path / "c.zarr"
    shutil.copytree(store, copy)
    assert main(["consolidate", str(copy), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["nodes"] > 0 and doc["root_bytes"] == os.path.getsize(copy / "zarr.json")
    assert main(["consolidate", str(tmp_path / "nothing.zarr")]) == 1
    assert "not a zarr store" in capsys.readouterr().err


def _as_format_1(store: Path, copy: Path) -> list[str]:
    """A copy of ``store`` as zckpt wrote it before format 2: bf16 arrays are Zarr ``uint16``
    (same chunk bytes), manifest version 1. Returns the keys of the rewritten arrays."""
    shutil.copytree(store, copy)
    root_doc = json.loads((copy / "zarr.json").read_text())
    root_doc["attributes"]["zckpt"]["version"] = 1
    root_doc["attributes"]["zckpt"].pop("integrity", None)  # digests came later
    (copy / "zarr.json").write_text(json.dumps(root_doc))
    changed = []
    for e in root_doc["attributes"]["zckpt"]["entries"]:
        if e.get("ms_type") == "BFloat16":
            meta = copy / e["key"] / "zarr.json"
            doc = json.loads(meta.read_text())
            assert doc["data_type"] == "bfloat16"
            doc.update(data_type="uint16", fill_value=0)
            meta.write_text(json.dumps(doc))
            changed.append(e["key"])
    return changed


def test_format_1_store_with_uint16_bf16_still_reads(job: tuple[GeneratedModel, Path], tmp_path: Path) -> None:
    model, store = job
    old = tmp_path / "v1.zarr"
    assert _as_format_1(store, old)
    _check(model, _read_with_zarr_only(old), registered=False, bf16_type="uint16")
    st = Store.open(old)
    assert st.data_type("w.bf16") == "uint16" and Store.open(store).data_type("w.bf16") == "bfloat16"
    assert np.asarray(st.array("w.bf16")[...]).tobytes() == global_value("w.bf16", (8, 4), "BFloat16").tobytes()
    assert zckpt_verify(old).ok
    a = zckpt.export(store, tmp_path / "a", str(model.strategy_path))
    b = zckpt.export(old, tmp_path / "b", str(model.strategy_path))
    for x, y in zip(a.ranks, b.ranks, strict=True):
        assert entries_by_name(Path(y.path)) == entries_by_name(Path(x.path))
    assert entries_by_name(Path(a.ranks[0].path))["w.bf16"][1] == "BFloat16"


def test_verify_reports_a_wrong_stored_data_type(job: tuple[GeneratedModel, Path], tmp_path: Path) -> None:
    """bits_view reads any ``bfloat16`` array as uint16: a UInt16 entry stored as bfloat16 (or a
    BFloat16 entry as int16) must still be reported by verify, naming both types."""
    _, store = job
    copy = tmp_path / "bad.zarr"
    shutil.copytree(store, copy)
    keys = {e["name"]: e["key"] for e in json.loads((copy / "zarr.json").read_text())["attributes"]["zckpt"]["entries"]}
    for name, data_type in (("i.uint16", "bfloat16"), ("w.bf16", "int16")):
        meta = copy / keys[name] / "zarr.json"
        doc = json.loads(meta.read_text())
        doc["data_type"] = data_type
        doc["fill_value"] = 0.0 if data_type == "bfloat16" else 0  # zarr < 3.1.6 wants an int16's as an int
        meta.write_text(json.dumps(doc))
    report = zckpt_verify(copy)
    found = {m.param: m.message for m in report.mismatches}
    assert "array data type bfloat16" in found["i.uint16"] and "needs uint16" in found["i.uint16"]
    assert "array data type int16" in found["w.bf16"] and "needs bfloat16 or uint16" in found["w.bf16"]
