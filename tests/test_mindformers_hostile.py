"""MindFormers iterations whose rank files contradict their ``metadata.json`` are refused (issue 25).

zckpt takes a MindFormers iteration's layouts from ``metadata.json``; the tensors the rank files
hold must then be the pieces those layouts cut, of the ``local_shape`` and ``dtype`` the metadata
records. A directory that says "split by columns" while its files hold row pieces was read with
a global shape derived from the files (``[4, 16]`` for an ``[8, 8]`` parameter) and exported with
exit 0. Each case here is written by ``tests/mindformers_writer.py`` (MindFormers' own layout)
and then given one lie; ``ingest`` and ``transform`` must exit 1 with a message naming the file
and the parameter, and leave no complete store and no rank file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from mindformers_writer import MsParam, write_iteration
from oracle import expected_shard

from zckpt.cli.main import main as cli_main
from zckpt.core.errors import ZckptError
from zckpt.formats.ckpt import CkptReader
from zckpt.jobs.generate_model import global_value
from zckpt.store.store import Store

ROWS = MsParam("layer.w", (8, 8), (2,), ((0,), (-1,)))
COLS = MsParam("layer.w", (8, 8), (2,), ((-1,), (0,)))
BIAS = MsParam("layer.b", (8,), (2,), ((-1,),))


def _piece(p: MsParam, rank: int) -> np.ndarray:
    """What MindSpore puts on ``rank`` for ``p`` (the oracle's cut of the generated value)."""
    lay = {"dev": list(p.dev_matrix), "map": [list(s) for s in p.tensor_map], "tshape": None,
           "opt": p.opt_weight_shard_size, "split": [], "offset": []}
    return np.ascontiguousarray(expected_shard(global_value(p.name, p.shape, p.ms_type), lay, rank))


def _edit_metadata(it: Path, edit: Callable[[dict[str, dict[str, object]]], None]) -> None:
    doc = json.loads((it / "metadata.json").read_text())
    edit(doc["state_dict_metadata"])
    (it / "metadata.json").write_text(json.dumps(doc))


def _columns_said_rows_held(root: Path) -> Path:
    """metadata.json: split by columns; each file: its row piece."""
    return write_iteration(root, [COLS, BIAS], 2, shards=lambda p, r: _piece(ROWS if p is COLS else p, r))


def _dtype_lie(root: Path) -> Path:
    """metadata.json: Float32; the files: Float16 pieces of the right shape."""
    return write_iteration(root, [ROWS, BIAS], 2,
                           shards=lambda p, r: _piece(p, r).astype(np.float16) if p is ROWS else _piece(p, r))


def _metadata_dtype_lie(root: Path) -> Path:
    """The files: Float32 as generated; metadata.json: BFloat16."""
    it = write_iteration(root, [ROWS, BIAS], 2)

    def edit(meta: dict[str, dict[str, object]]) -> None:
        props = meta[ROWS.name]["properties"]
        assert isinstance(props, dict)
        props["dtype"] = "BFloat16"

    _edit_metadata(it, edit)
    return it


def _short_piece(root: Path) -> Path:
    """Rank 1's file holds 3 of its piece's 4 rows (a whole, well-formed safetensors file)."""
    return write_iteration(root, [ROWS, BIAS], 2,
                           shards=lambda p, r: _piece(p, r)[:3] if p is ROWS and r == 1 else _piece(p, r))


def _truncated_file(root: Path) -> Path:
    """Rank 1's model file lost its last bytes."""
    it = write_iteration(root, [ROWS, BIAS], 2)
    f = next(it.glob("model-0000001-*.safetensors"))
    f.write_bytes(f.read_bytes()[:-8])
    return it


def _overlapping_pieces(root: Path) -> Path:
    """metadata.json: the two row pieces of an 8-row tensor are 5 rows each (files likewise)."""
    it = write_iteration(root, [ROWS, BIAS], 2,
                         shards=lambda p, r: global_value(p.name, p.shape, p.ms_type)[3 * r:3 * r + 5]
                         if p is ROWS else _piece(p, r))

    def edit(meta: dict[str, dict[str, object]]) -> None:
        for chunk in meta[ROWS.name]["chunk"]:  # type: ignore[union-attr]
            chunk["local_shape"] = [5, 8]

    _edit_metadata(it, edit)
    return it


def _gap_between_pieces(root: Path) -> Path:
    """metadata.json: a 10-row tensor cut in two pieces of 4 rows (files likewise): rows missing."""
    it = write_iteration(root, [ROWS, BIAS], 2)

    def edit(meta: dict[str, dict[str, object]]) -> None:
        meta[ROWS.name]["global_shape"] = [10, 8]

    _edit_metadata(it, edit)
    return it


def _indivisible_global_shape(root: Path) -> Path:
    """metadata.json: a 9-row tensor cut in two pieces of 4 rows (files likewise): row 8 missing."""
    it = write_iteration(root, [ROWS, BIAS], 2)

    def edit(meta: dict[str, dict[str, object]]) -> None:
        meta[ROWS.name]["global_shape"] = [9, 8]

    _edit_metadata(it, edit)
    return it


CASES: dict[str, tuple[Callable[[Path], Path], str, str]] = {
    # case: (writer, the file the message must name, words it must contain)
    "columns said, rows held": (_columns_said_rows_held, "model-0000000-0000002.safetensors", "[4, 8]"),
    "files hold another dtype": (_dtype_lie, "model-0000000-0000002.safetensors", "Float16"),
    "metadata gives another dtype": (_metadata_dtype_lie, "model-0000000-0000002.safetensors", "BFloat16"),
    "a piece is short": (_short_piece, "model-0000001-0000002.safetensors", "[3, 8]"),
    "a file is truncated": (_truncated_file, "model-0000001-0000002.safetensors", "truncated"),
    "pieces overlap": (_overlapping_pieces, "metadata.json", "[5, 8]"),
    "pieces leave a gap": (_gap_between_pieces, "metadata.json", "[10, 8]"),
    "global_shape not a multiple of the pieces": (_indivisible_global_shape, "metadata.json", "size 9"),
}


def _refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    code = cli_main(args)
    err = capsys.readouterr().err
    assert code == 1, f"zckpt {' '.join(args)} exited {code}: {err}"
    return err


def _complete_store(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        return Store.open(path).complete
    except ZckptError:
        return False


@pytest.mark.parametrize("case", sorted(CASES))
def test_ingest_and_transform_refuse(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write, file, words = CASES[case]
    it = write(tmp_path / "checkpoint")
    for err in (_refused(["ingest", str(it), "--store", str(tmp_path / "s.zarr")], capsys),
                _refused(["transform", str(it), "--out", str(tmp_path / "out")], capsys)):
        assert file in err and ROWS.name in err and words in err, err
    assert not _complete_store(tmp_path / "s.zarr")
    out = tmp_path / "out"
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]


def test_the_honest_directories_convert(tmp_path: Path) -> None:
    """The same jobs without the lies: both layouts give the generated values."""
    for params in ([ROWS, BIAS], [COLS, BIAS]):
        root = tmp_path / params[0].tensor_map.__repr__()
        it = write_iteration(root / "checkpoint", params, 2)
        assert cli_main(["ingest", str(it), "--store", str(root / "s.zarr")]) == 0
        assert cli_main(["transform", str(it), "--out", str(root / "out")]) == 0
        st = Store.open(root / "s.zarr")
        with CkptReader(root / "out" / "rank_0" / "checkpoint_0.ckpt") as r:
            for p in params:
                want = global_value(p.name, p.shape, p.ms_type)
                assert np.asarray(st.array(p.name)[...]).tobytes() == want.tobytes()
                assert r.array(p.name).tobytes() == want.tobytes()
