"""Phases that read a local store raw never import zarr-python (nor Dask).

``export`` reads chunk files and ``zarr.json`` documents itself; importing zarr-python (asyncio,
numcodecs, ...) would cost every run a few tenths of a second before its first byte. Each test
runs the command in a fresh interpreter, then checks the modules it loaded and the bytes it wrote
(against MindSpore's own fixture output, or an independently sliced oracle).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ckpt_compare import diff_dirs
from test_roundtrip_generated import _check_output, _dst_strategy, _model

import zckpt
from zckpt.core.dtypes import MS_DTYPES
from zckpt.core.errors import StoreError
from zckpt.jobs.generate import write_model
from zckpt.store.array_documents import array_json
from zckpt.store.store import Store
from zckpt.store.zarr_arrays import zarr_type

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "example"
HEAVY = ("zarr", "dask", "distributed", "fsspec", "numcodecs", "asyncio")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh interpreter that imports this checkout's zckpt; it must succeed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc

def _cli_modules(args: list[str]) -> list[str]:
    """Run ``python -m zckpt.cli ARGS`` in a fresh interpreter; the heavy top-level packages it
    had imported when the command returned."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['zckpt', *{args!r}]\n"
        "try:\n"
        "    runpy.run_module('zckpt.cli.main', run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    assert exit.code in (0, None), exit.code\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))\n"
    )
    proc = _python(code)
    return list(json.loads(proc.stdout.splitlines()[-1].replace("'", '"')))


def test_export_of_the_example_imports_neither_zarr_nor_dask(tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, str(EXAMPLE / "src" / "strategy.ckpt"))
    out = tmp_path / "out"
    assert _cli_modules(["export", str(store), "--strategy", str(EXAMPLE / "dst" / "strategy.ckpt"),
                         "--out", str(out), "--quiet"]) == []
    assert diff_dirs(EXAMPLE / "dst" / "expected", out) == []


def test_export_of_a_generated_model_imports_neither_zarr_nor_dask(tmp_path: Path) -> None:
    """Every data type (BFloat16 among them), optimizer states, strings and scalars, packed
    small tensors and sharded arrays: the bytes match an independent re-slicer."""
    rng = np.random.default_rng(15)
    tensors = _model(rng, 4, 10, states=True)
    model = write_model(tmp_path / "src", tensors, device_num=4, strings={"note": "lazy"})
    assert model.strategy_path is not None
    dst = tmp_path / "dst_strategy.ckpt"
    _dst_strategy(rng, tensors, 3, dst)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, str(model.strategy_path))
    out = tmp_path / "out"
    assert _cli_modules(["export", str(store), "--strategy", str(dst), "--out", str(out), "--quiet"]) == []
    assert _check_output(out, tensors, dst, 3) == len(tensors) * 3


def _example_store(tmp_path: Path) -> Path:
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, str(EXAMPLE / "src" / "strategy.ckpt"))
    return store


@pytest.mark.parametrize("edit", [
    lambda doc: {**doc, "zarr_format": 2},
    lambda doc: {**doc, "node_type": "array"},
    lambda doc: {**doc, "attributes": ["zckpt"]},
    lambda doc: [doc],
])
def test_root_document_that_is_not_a_v3_group_is_refused(tmp_path: Path, edit: object) -> None:
    store = _example_store(tmp_path)
    meta = store / "zarr.json"
    assert callable(edit)
    meta.write_text(json.dumps(edit(json.loads(meta.read_text()))))
    with pytest.raises(StoreError, match="cannot open zarr store"):
        Store.open(store)


def test_root_document_that_is_not_json_or_a_link_is_refused(tmp_path: Path) -> None:
    store = _example_store(tmp_path)
    meta = store / "zarr.json"
    good = meta.read_bytes()
    meta.write_bytes(good[:-5])
    with pytest.raises(StoreError, match="cannot open zarr store"):
        Store.open(store)
    (tmp_path / "outside.json").write_bytes(good)
    meta.unlink()
    meta.symlink_to(tmp_path / "outside.json")
    with pytest.raises(StoreError, match="cannot open zarr store"):
        Store.open(store)


def test_opened_store_keeps_other_group_attributes(tmp_path: Path) -> None:
    """The root attributes besides the manifest survive a manifest rewrite (read from the
    document itself, not from zarr's group)."""
    store = _example_store(tmp_path)
    meta = store / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["user"] = {"kept": [1, 2]}
    meta.write_text(json.dumps(doc))
    opened = Store.open(store, mode="r+")
    opened.unseal()
    attrs = json.loads(meta.read_text())["attributes"]
    assert attrs["user"] == {"kept": [1, 2]} and attrs["zckpt"]["complete"] is False


def test_store_array_registers_bfloat16_before_handing_out_a_zarr_array(tmp_path: Path) -> None:
    """Opening a store imports no zarr-python; the first zarr array zckpt hands out comes with
    Zarr's ``bfloat16`` registered, so the caller's own zarr-python opens bf16 arrays too."""
    tensors = _model(np.random.default_rng(7), 2, 4)
    model = write_model(tmp_path / "src", tensors, device_num=2)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, str(model.strategy_path))
    bf16 = [t for t in tensors if t.ms_type == "BFloat16"]
    assert bf16
    code = (
        "import sys\n"
        "from zckpt.store.store import Store\n"
        f"s = Store.open({str(store)!r})\n"
        f"e = s.entry({bf16[0].name!r})\n"
        "assert 'zarr' not in sys.modules\n"
        "print(s.array(e.name)[...].dtype)\n"
        "import zarr\n"
        f"print(zarr.open_array({str(store)!r}, path=e.key, mode='r').dtype)\n"
    )
    proc = _python(code)
    lines = proc.stdout.splitlines()
    assert lines[0] == "uint16", lines  # zckpt carries bf16 as its bit patterns
    assert lines[1] == "bfloat16", lines  # the caller's zarr-python: ml_dtypes' bfloat16


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("ms_type,kind", [*((t, "tensor") for t in MS_DTYPES), ("Float32", "map")])
def test_array_documents_equal_zarr_pythons_own(ms_type: str, kind: str, sharded: bool) -> None:
    """zckpt writes its arrays' ``zarr.json`` itself; zarr-python, the independent reference,
    renders the same array (data type, fill value, codecs, sharding, chunk keys) to the same
    document, byte for byte."""
    import zarr
    from zarr.core.buffer import default_buffer_prototype

    attrs = {"zckpt": {"name": "w", "writers": [[0, [[0, 0], [6, 4]]]]}}
    ref = zarr.create_array(store=zarr.storage.MemoryStore(), shape=(6, 4), chunks=(1, 2),
                            shards=(3, 4) if sharded else None, dtype=zarr_type(ms_type, kind), compressors=None,
                            fill_value=0, attributes=attrs, chunk_key_encoding={"name": "default", "separator": "."})
    want = ref.metadata.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()
    got = array_json(ms_type, kind, (6, 4), (1, 2), attrs, (3, 2) if sharded else None)
    assert json.loads(got) == json.loads(want)
    assert got == json.dumps(json.loads(want))  # the same keys in the same order


def test_group_and_progress_documents_equal_zarr_pythons_own(tmp_path: Path) -> None:
    """A local store's ``tensors``/``maps`` groups and its ``progress`` array are written
    without zarr-python; zarr-python writes the same documents for the same nodes (remote
    stores still create them through it) and opens zckpt's. zarr-python before 3.1.x wrote
    ``"consolidated_metadata": null`` into every group (its own extension; absent means the
    same), later versions leave it out: the documents are compared without that null."""
    import zarr

    from zckpt.store import records

    ref = zarr.open_group(str(tmp_path / "ref.zarr"), mode="w-", zarr_format=3)
    ref.require_group("tensors")
    records.define_folder(ref)
    store = _example_store(tmp_path)
    for node in ("tensors", records.FOLDER):
        ours = json.loads((store / node / "zarr.json").read_bytes())
        theirs = json.loads((tmp_path / "ref.zarr" / node / "zarr.json").read_bytes())
        if theirs.get("consolidated_metadata", 0) is None:
            del theirs["consolidated_metadata"]
        assert ours == theirs and list(ours) == list(theirs)
    opened = zarr.open_group(str(store), mode="r", zarr_format=3)
    assert isinstance(opened["tensors"], zarr.Group) and isinstance(opened[records.FOLDER], zarr.Array)
