"""A Checkpoint 2.0 directory MindFormers itself saved (s23's source, 8 ranks with pipeline and
optimizer parallel), given one lie at a time: ``metadata.json`` about shapes, slice numbers,
files or fragmentation; files that are missing, that climb out of the directory, or whose
headers disagree with ``metadata.json``; a tracker naming no iteration.

``zckpt ingest`` and ``zckpt transform`` must each exit 1 with an error of zckpt's own naming
the file (and the parameter, where one is at fault), never write wrong bytes, and leave no
complete store and no rank file. ``zckpt info`` lists the same refusal and exits 0. The
unaltered copy converts (the last test), so every refusal here is the lie's.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import MINDFORMERS_FIXTURES
from safetensors import safe_open
from safetensors.numpy import save_file

from zckpt.cli.main import main as cli_main
from zckpt.core.errors import ZckptError
from zckpt.store.store import Store

QKV = "decoder.layers.0.self_attention.linear_qkv.weight"  # (192, 64), 4 row pieces on ranks 0-3
ITER = "iteration_00000001"


def _model(r: int) -> str:
    return f"qwen3-model-{r:07d}-0000008.safetensors"


def _metadata(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    where = root / ITER / "metadata.json"
    doc = json.loads(where.read_text())
    edit(doc)
    where.write_text(json.dumps(doc))


def _entry(root: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> None:
    _metadata(root, lambda doc: edit(doc["state_dict_metadata"][name]))


def _records(doc: dict[str, Any], name: str, piece: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = doc["storage_data"][str((name, (piece,)))]
    return records


def _rewrite(file: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """The safetensors file written again with its tensors changed, its metadata kept."""
    with safe_open(str(file), framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
        meta = f.metadata()
    change(tensors)
    file.unlink()
    save_file(tensors, str(file), metadata=meta)


def _swap_slices(root: Path) -> None:
    def edit(doc: dict[str, Any]) -> None:
        a, b = str((QKV, (0,))), str((QKV, (1,)))
        doc["storage_data"][a], doc["storage_data"][b] = doc["storage_data"][b], doc["storage_data"][a]

    _metadata(root, edit)


def _climb(root: Path) -> None:
    shutil.copy(root / ITER / _model(0), root / _model(0))  # there to be found, if the name were followed
    _metadata(root, lambda doc: _records(doc, QKV, 0)[0].update(file_name=f"../{_model(0)}"))


def _absolute(root: Path) -> None:
    outside = root.parent / "elsewhere" / _model(0)
    outside.parent.mkdir()
    shutil.copy(root / ITER / _model(0), outside)
    _metadata(root, lambda doc: _records(doc, QKV, 0)[0].update(file_name=str(outside)))


def _symlink_out(root: Path) -> None:
    outside = root.parent / "elsewhere" / _model(1)
    outside.parent.mkdir()
    shutil.move(root / ITER / _model(1), outside)
    os.symlink(outside, root / ITER / _model(1))


def _columns_said(root: Path) -> None:
    """metadata.json: QKV cut by columns (layout, fragments, chunks alike); the files: row pieces."""
    def edit(e: dict[str, Any]) -> None:
        e["layout"]["tensor_map"] = [-1, [0, 2, 1]]
        e["axis_fragmentations"] = [1, 4]
        for c in e["chunk"]:
            c["local_shape"] = [192, 16]

    _entry(root, QKV, edit)


def _bigger_alike(root: Path) -> None:
    """metadata.json: QKV twice as tall, its chunks too; the files hold the real pieces."""
    def edit(e: dict[str, Any]) -> None:
        e["global_shape"] = [384, 64]
        for c in e["chunk"]:
            c["local_shape"] = [96, 64]

    _entry(root, QKV, edit)


CASES: dict[str, tuple[Callable[[Path], None], str, str | None, str]] = {
    # case: (the lie, the file the error names, the parameter it names, words it holds)
    "global_shape lies": (lambda r: _entry(r, QKV, lambda e: e.update(global_shape=[96, 64])),
                          "metadata.json", QKV, "[96, 64]"),
    "global_shape and chunks lie alike": (_bigger_alike, "qwen3-model-000000", QKV, "[96, 64]"),
    "a slice number out of range": (lambda r: _entry(r, QKV, lambda e: e["chunk"][0].update(global_offset=[99])),
                                    "metadata.json", QKV, "slice [99]"),
    "slice numbers swapped in storage_data": (_swap_slices, "metadata.json", QKV, "slice 1"),
    "a slice number listed twice": (lambda r: _entry(r, QKV, lambda e: e["chunk"][1].update(global_offset=[0])),
                                    "metadata.json", QKV, "slices [0, 0, 1, 3]"),
    "axis_fragmentations lie": (lambda r: _entry(r, QKV, lambda e: e.update(axis_fragmentations=[2, 2])),
                                "metadata.json", QKV, "axis_fragmentations [2, 2]"),
    "columns said, rows held": (_columns_said, "qwen3-model-000000", QKV, "[48, 64]"),
    "a file storage_data names is missing": (
        lambda r: (r / ITER / "qwen3-opt-0000003-0000008.safetensors").unlink(), "metadata.json", "adam_",
        "qwen3-opt-0000003-0000008.safetensors"),
    "a file name climbs out (../)": (_climb, "metadata.json", QKV, f"'../{_model(0)}'"),
    "a file name is absolute": (_absolute, "metadata.json", QKV, "elsewhere"),
    "a rank file is a link out of the directory": (_symlink_out, _model(1), None, "link"),
    "metadata.json gives another dtype": (
        lambda r: _entry(r, QKV, lambda e: e["properties"].update(dtype="bfloat16")),
        "qwen3-model-000000", QKV, "bfloat16"),
    "a piece is short": (lambda r: _rewrite(r / ITER / _model(2), lambda t: t.update({QKV: t[QKV][:47]})),
                         _model(2), QKV, "[47, 64]"),
    "a file lacks a piece storage_data puts in it": (
        lambda r: _rewrite(r / ITER / _model(2), lambda t: t.pop(QKV)), _model(2), QKV, "storage_data"),
    "storage_rank outside the parameter's stage": (
        lambda r: _metadata(r, lambda doc: _records(doc, QKV, 0)[0].update(storage_rank=5)),
        "metadata.json", QKV, "5"),
    "the tracker names a missing iteration": (
        lambda r: (r / "latest_checkpointed_iteration.txt").write_text("7"),
        "latest_checkpointed_iteration.txt", None, "'7'"),
    "the tracker is garbage": (
        lambda r: (r / "latest_checkpointed_iteration.txt").write_bytes(b"1; rm -rf /\xff"),
        "latest_checkpointed_iteration.txt", None, "rm -rf"),
    "metadata.json is missing": (lambda r: (r / ITER / "metadata.json").unlink(), ITER, None, "metadata.json"),
    "metadata.json is cut short": (
        lambda r: (r / ITER / "metadata.json").write_bytes((r / ITER / "metadata.json").read_bytes()[:5000]),
        "metadata.json", None, "not MindFormers checkpoint metadata"),
    "common.json contradicts the files": (
        lambda r: (r / ITER / "common.json").write_text(json.dumps({"global_step": 5})), ITER, "global_step", "[5]"),
}


@pytest.fixture
def s23(tmp_path: Path) -> Path:
    root = tmp_path / "checkpoint"
    shutil.copytree(MINDFORMERS_FIXTURES / "s23" / "src", root)
    return root


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli_main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def _complete_store(path: Path) -> bool:
    try:
        return path.exists() and Store.open(path).complete
    except ZckptError:
        return False


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_lie_is_refused(case: str, s23: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lie, file, param, words = CASES[case]
    lie(s23)
    out = tmp_path / "out"
    dst = str(MINDFORMERS_FIXTURES / "s23" / "dst" / "strategy.ckpt")
    for args in (["ingest", str(s23), "--store", str(tmp_path / "s.zarr")],
                 ["transform", str(s23), "--out", str(out), "--dst-strategy", dst]):
        code, _, err = _run(args, capsys)
        assert code == 1, f"zckpt {args[0]} exited {code}: {err}"
        assert err.startswith(f"zckpt {args[0]}: error: file ") and "Traceback" not in err, err
        assert file in err and words in err, err
        assert param is None or f"parameter '{param}" in err, err
    assert not _complete_store(tmp_path / "s.zarr")
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]
    code, text, err = _run(["info", str(s23)], capsys)
    assert code == 0 and "refused (" in text and words in text, text + err


def test_the_unaltered_copy_converts(s23: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = str(MINDFORMERS_FIXTURES / "s23" / "dst" / "strategy.ckpt")
    assert _run(["transform", str(s23), "--out", str(tmp_path / "out"), "--dst-strategy", dst], capsys)[0] == 0
    assert _run(["ingest", str(s23), "--store", str(tmp_path / "s.zarr")], capsys)[0] == 0
    assert _complete_store(tmp_path / "s.zarr")
