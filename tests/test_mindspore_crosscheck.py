"""MindSpore itself reads every kind of file zckpt writes, with identical values.

Runs ``mindspore.load_checkpoint`` in MindSpore's own virtualenv (skipped when absent) and
compares dtype, shape and a hash of the raw bytes with what zckpt wrote.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from mindspore_env import require_ms_python, run_ms_tool

import zckpt
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.ckpt_encoding import value_header
from zckpt.formats.ckpt_writer import CkptWriter

pytestmark = pytest.mark.mindspore

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"


def _expected(path: Path) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    with CkptReader(path) as r:
        for name, e in r.entries.items():
            if e.kind == "str":
                out[name] = {"kind": "str", "value": r.string(name)}
            else:
                raw = np.ascontiguousarray(r.array(name)).view(np.uint8).tobytes()
                out[name] = {"kind": "tensor", "dtype": e.ms_type, "shape": list(e.shape),
                             "sha256": hashlib.sha256(raw).hexdigest()}
    return out


def _all_dtypes_file(path: Path, *, crc: bool) -> None:
    rng = np.random.default_rng(7)
    with CkptWriter(path, crc=crc) as w:
        w.write_array("f16", "Float16", rng.standard_normal((3, 5)).astype(np.float16))
        w.write_array("f32", "Float32", rng.standard_normal((4, 6)).astype(np.float32))
        w.write_array("f64", "Float64", rng.standard_normal((2, 3)))
        f32 = rng.standard_normal((5, 4)).astype(np.float32)
        w.write_array("bf16", "BFloat16", (f32.view(np.uint32) >> 16).astype(np.uint16))
        for ms_type, np_type in [("Int8", np.int8), ("Int16", np.int16), ("Int32", np.int32), ("Int64", np.int64),
                                 ("UInt8", np.uint8), ("UInt16", np.uint16), ("UInt32", np.uint32),
                                 ("UInt64", np.uint64)]:
            info = np.iinfo(np_type)
            w.write_array(ms_type.lower(), ms_type, np.array([info.min, 0, 1, info.max], dtype=np_type))
        w.write_array("mask", "Bool", np.array([[True, False], [False, True]]))
        w.write_array("learning_rate", "Float32", np.array(0.01, dtype=np.float32))
        w.write_array("global_step", "Int32", np.array([42], dtype=np.int32))
        w.write_string("note", "zckpt ✓ unicode")


def _split_value_file(path: Path) -> None:
    """One tensor in two consecutive Values with the same tag, as MindSpore writes large tensors."""
    data = np.arange(24, dtype=np.float32).reshape(6, 4)
    head, tail = data[:4].tobytes(), data[4:].tobytes()
    path.write_bytes(value_header("big", "Float32", [6, 4], len(head)) + head
                     + value_header("big", "Float32", [6, 4], len(tail)) + tail)


def test_mindspore_loads_zckpt_files(tmp_path: Path) -> None:
    require_ms_python()
    files: list[Path] = []
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, str(EXAMPLE / "src" / "strategy.ckpt"))
    rep = zckpt.export(store, tmp_path / "dst", str(EXAMPLE / "dst" / "strategy.ckpt"))
    files += [Path(r.path) for r in rep.ranks]
    full = zckpt.export(store, tmp_path / "full", None, options=zckpt.ExportOptions(crc=True))
    files += [Path(r.path) for r in full.ranks]
    _all_dtypes_file(tmp_path / "dtypes.ckpt", crc=False)
    _all_dtypes_file(tmp_path / "dtypes_crc.ckpt", crc=True)
    _split_value_file(tmp_path / "split.ckpt")
    files += [tmp_path / "dtypes.ckpt", tmp_path / "dtypes_crc.ckpt", tmp_path / "split.ckpt"]
    loaded = run_ms_tool("ms_load_dump.py", *map(str, files))
    assert len(loaded) == len(files)
    for f in files:
        assert loaded[str(f)] == _expected(f), f"MindSpore reads {f} differently"
