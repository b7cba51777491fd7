"""Hostile parameter names: every name round-trips exactly, and nothing escapes the store.

Checkpoint tags are arbitrary UTF-8 chosen by whoever built the network, and the store
turns each into a directory name (``zckpt.store.manifest.encode_key``). A name must never become a
path outside the store (``../x``, ``/abs``), collide with another name's directory (names
that differ only by case, or that look like an already-escaped name), or with Zarr's own
files (``zarr.json``), and it must come back byte for byte in the exported files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import numpy as np
import oracle
import pytest

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef, global_value
from zckpt.store.manifest import encode_key
from zckpt.store.store import Store

ESCAPE_MARK = f"zckpt_escape_{uuid.uuid4().hex}"
"""A file name that must not appear anywhere on the machine after the run."""
TEMP = Path(tempfile.gettempdir())
ROOT = Path(os.path.abspath(os.sep))

HOSTILE = [
    "../x",
    "../" * 12 + ESCAPE_MARK,  # climbs to the filesystem root from anywhere shallower than 12 levels
    str(TEMP / (ESCAPE_MARK + "_abs")),
    "a/b",
    "a%2Fb",  # what "a/b" becomes once escaped: must not collide with it
    "a%252Fb",
    "%",
    "a\x00b",
    "..",
    ".",
    "__init__",
    "__zarr",
    ".zarray",
    # "zarr.json" breaks ingest: see test_name_equal_to_zarr_metadata_file
    "c",
    "x" * 10_000,
    "x" * 9_999 + "y",  # same 162-character key prefix: told apart by the digest suffix
    "\u00e9t\u00e9.\u4e2d\u6587.\U0001f600",
    "e\u0301t\u00e9",  # same text as the previous prefix under Unicode normalisation, other bytes
    "Layer.Weight",
    "layer.weight",
    "LAYER.WEIGHT",
    "a b\tc\nd",
    "back\\slash",
    "~tilde",
    "-",
    "7-x",  # looks like a merged pipeline strategy's "<stage>-" prefix
]
SHARDED = {"../x", "a/b", "a%2Fb", "x" * 10_000, "Layer.Weight", "layer.weight", ".", "7-x"}
"""Names given a layout in the strategy (split over both ranks); the others are unlisted."""


def _walk(root: Path) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, dirs, files in os.walk(root) for f in files + dirs}


def _model(root: Path) -> tuple[list[TensorDef], StrategyMap]:
    tensors = []
    for i, n in enumerate(HOSTILE):  # 2-D Float32 and 1-D Int32/Float32 tensors, sharded or not
        if i % 3:
            tensors.append(TensorDef(n, (4, 3), "Float32", make_layout((2,), [[0], []]) if n in SHARDED else None))
        else:
            tensors.append(TensorDef(n, (2,), "Float32" if n in SHARDED else "Int32",
                                     make_layout((2,), [[0]]) if n in SHARDED else None))
    write_model(root / "src", tensors, device_num=2, scalars=False)
    dst = StrategyMap(layouts={t.name: {0: make_layout((2, 2), [[1, 0], []] if len(t.shape) == 2 else [[0]])}
                               for t in tensors if t.name in SHARDED})
    return tensors, dst


def test_encode_key_is_injective_and_path_safe() -> None:
    keys = [encode_key(n) for n in HOSTILE]
    assert len(set(keys)) == len(keys)
    for k in keys:
        assert k and "/" not in k and "\\" not in k and "\x00" not in k and len(k.encode()) <= 180
        assert not k.startswith((".", "_")) and k not in (".", "..")


def test_hostile_names_round_trip_and_stay_inside(tmp_path: Path) -> None:
    tensors, dst = _model(tmp_path)
    dst_file = tmp_path / "dst_strategy.ckpt"
    dst_file.write_bytes(encode_strategy(dst))
    work = tmp_path / "work"
    work.mkdir()
    store, out = work / "store.zarr", work / "out"
    before = _walk(tmp_path)
    codes = [cli_main(["ingest", str(tmp_path / "src"), "--strategy", str(tmp_path / "src" / "strategy.ckpt"),
                       "--store", str(store)])]
    if codes[0] == 0:
        codes.append(cli_main(["export", str(store), "--strategy", str(dst_file), "--out", str(out)]))
    escaped = [p for d in (TEMP, ROOT, tmp_path.parent) for p in d.glob(ESCAPE_MARK + "*")]
    for p in escaped:  # do not leave them behind
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    assert not escaped, escaped
    created = _walk(tmp_path) - before
    assert created, "nothing was written"
    inside = ("work/store.zarr", "work/out")
    allowed = {"work/store.zarr.lock"}  # ingest's lock file sits next to the store by design
    outside = sorted(p for p in created if p not in allowed and not any(
        p == d or p.startswith(d + os.sep) for d in inside))
    assert not outside, outside
    assert codes == [0, 0]

    st = Store.open(store)
    assert [e.name for e in st.entries()] == HOSTILE
    for t in tensors:
        attrs = st.array(t.name).attrs["zckpt"]
        assert attrs["name"] == t.name
        assert np.array_equal(np.asarray(st.array(t.name)[...]), global_value(t.name, t.shape, t.ms_type))

    layouts = oracle.read_layouts(dst_file)  # the slices from the file's raw fields, not zckpt.core.layout
    assert set(layouts) == SHARDED
    for rank in range(4):
        with CkptReader(out / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            assert r.names() == HOSTILE, rank
            for t in tensors:
                want = oracle.cut(global_value(t.name, t.shape, t.ms_type), layouts, t.name, rank)
                got = r.array(t.name)
                assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), t.name


def test_names_that_differ_only_by_case_get_distinct_keys_on_case_insensitive_disks() -> None:
    """The keys of ``Layer.Weight`` and ``layer.weight`` must differ in more than case:
    on a case-insensitive filesystem (macOS and Windows defaults) they would be one
    directory, and the second array would overwrite the first."""
    keys = [encode_key(n) for n in ("Layer.Weight", "layer.weight", "LAYER.WEIGHT")]
    assert len({k.lower() for k in keys}) == len(keys), keys


def test_api_round_trip_keeps_hostile_names_in_order(tmp_path: Path) -> None:
    """The MindSpore-style API path (transform_checkpoints) with the same names."""
    tensors, dst = _model(tmp_path)
    dst_file = tmp_path / "dst.ckpt"
    dst_file.write_bytes(encode_strategy(dst))
    zckpt.transform_checkpoints(str(tmp_path / "src"), str(tmp_path / "out"), "checkpoint_",
                                str(tmp_path / "src" / "strategy.ckpt"), str(dst_file))
    with CkptReader(tmp_path / "out" / "rank_3" / "checkpoint_3.ckpt") as r:
        assert r.names() == [t.name for t in tensors]


@pytest.mark.parametrize("name", ["zarr.json", "ZARR.JSON"])
def test_name_equal_to_zarr_metadata_file(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An entry called ``zarr.json`` must not become the directory ``tensors/zarr.json``,
    which is the metadata file of the group holding the arrays (``ZARR.JSON`` is the same
    file on a case-insensitive disk)."""
    write_model(tmp_path / "src", [TensorDef(name, (2,), "Float32"), TensorDef("w", (2,), "Float32")],
                device_num=1, strategy_format=None, scalars=False)
    key = encode_key(name)
    store = tmp_path / "s.zarr"
    code = cli_main(["ingest", str(tmp_path / "src"), "--store", str(store)])
    err = capsys.readouterr().err
    assert key.lower() != "zarr.json"
    assert code == 0, err
    assert Store.open(store).entry(name).key == f"tensors/{key}"
    assert cli_main(["export", str(store), "--out", str(tmp_path / "out")]) == 0
    with CkptReader(tmp_path / "out" / "rank_0" / "checkpoint_0.ckpt") as r:
        assert r.names() == [name, "w"]
        assert r.array(name).tobytes() == global_value(name, (2,), "Float32").tobytes()
