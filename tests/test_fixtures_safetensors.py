"""safetensors output on MindSpore's own fixtures: every tensor of ``dst/expected``, bit for bit.

The ``.ckpt`` output is compared with ``dst/expected`` elsewhere (``test_e2e_fixtures.py``);
here the same conversions write ``--format safetensors``, through ingest + export and through
the direct path (``zckpt transform``), and each rank file, read by the ``safetensors``
package, must hold the tensors MindSpore's expected ``.ckpt`` holds (read with
``tests/ckpt_compare.py``): the same names, and for each the dtype, shape and bytes; the
string entries in the header's metadata.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ckpt_compare import entry_digest
from conftest import FIXTURES, have_fixtures, scenario
from test_fixtures_ckpt2 import CKPT2

from zckpt.cli.main import main as cli_main
from zckpt.formats.ckpt import CkptReader

pytestmark = pytest.mark.fixtures

safetensors = pytest.importorskip("safetensors", reason="the safetensors package is needed (pip install safetensors)")
pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for bf16 in safetensors' numpy frontend")

PLAIN = ["s01", "s02", "s03b", "s04", "s05", "s08", "s09", "s10", "s11", "s14", "s15", "s16", "s17", "s18", "s19",
         "s20"]
PIPELINE = ["s06", "s07", "s21", "s22"]
"""Pipeline sources: converted with their per-rank strategy directory."""
REFUSED = {"s12": "an unlisted sharded tensor (step_table): zckpt refuses it (test_e2e_fixtures)"}
# MindFormers Checkpoint 2.0 saves (found by their layout, CKPT2) are checked piece by piece in
# test_fixtures_ckpt2.py: their expected side is an iteration directory, not rank files.
"""Scenarios with a ``dst/expected`` that no conversion is to reproduce, and why. (s03 has no
destination side.)"""

SF_DTYPES = {"F16": "Float16", "F32": "Float32", "F64": "Float64", "BF16": "BFloat16", "BOOL": "Bool",
             "I8": "Int8", "I16": "Int16", "I32": "Int32", "I64": "Int64",
             "U8": "UInt8", "U16": "UInt16", "U32": "UInt32", "U64": "UInt64"}
"""safetensors' dtype names and MindSpore's, one to one."""
STRING_PREFIX = "zckpt.str:"
"""Where a string entry goes in the metadata (docs/mindspore-api.md)."""


def _strategy(side: Path) -> str | None:
    for name in ("strategy.ckpt", "strategy.json", "strategy"):
        if (side / name).exists():
            return str(side / name)
    return None


def _expected(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...], bytes]], dict[str, str]]:
    """MindSpore's rank file: its tensors (type, shape, bytes) and its string entries."""
    tensors, strings = {}, {}
    with CkptReader(path) as r:
        for name in r.entries:
            kind, ms_type, shape, raw = entry_digest(r, name)
            if kind == "tensor":
                tensors[name] = (ms_type, shape, raw)
            else:
                assert kind == "str", f"{path}: {name} is a {kind}, which safetensors output refuses"
                strings[name] = raw.decode("utf-8")
    return tensors, strings


def _differences(expected_dir: Path, out: Path) -> list[str]:
    problems = []
    ranks = sorted(p.name for p in expected_dir.iterdir() if p.name.startswith("rank_"))
    got_ranks = sorted(p.name for p in out.iterdir() if p.name.startswith("rank_"))
    if got_ranks != ranks:
        return [f"rank directories {got_ranks} != expected {ranks}"]
    for rank_dir in ranks:
        rank = int(rank_dir.split("_")[1])
        want, strings = _expected(sorted((expected_dir / rank_dir).glob("*.ckpt"))[-1])
        files = sorted(p.name for p in (out / rank_dir).iterdir())
        if files != [f"checkpoint_{rank}.safetensors"]:
            problems.append(f"{rank_dir}: files {files}")
            continue
        with safetensors.safe_open(str(out / rank_dir / files[0]), framework="np") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if names != set(want):
                problems.append(f"{rank_dir}: tensors {sorted(names)} != expected {sorted(want)}")
            for name in sorted(names & set(want)):
                ms_type, shape, raw = want[name]
                dtype = SF_DTYPES.get(f.get_slice(name).get_dtype())
                value = f.get_tensor(name)
                if (dtype, tuple(value.shape)) != (ms_type, shape):
                    problems.append(f"{rank_dir}: {name}: {dtype} {tuple(value.shape)} != expected {ms_type} {shape}")
                elif np.ascontiguousarray(value).view(np.uint8).tobytes() != raw:
                    problems.append(f"{rank_dir}: {name}: bytes differ")
        if meta.get("format") != "ms":
            problems.append(f"{rank_dir}: metadata {meta} lacks MindSpore's format mark")
        got_strings = {k[len(STRING_PREFIX):]: v for k, v in meta.items() if k.startswith(STRING_PREFIX)}
        if got_strings != strings:
            problems.append(f"{rank_dir}: strings {got_strings} != expected {strings}")
    return problems


@pytest.mark.parametrize("sid", PLAIN + PIPELINE)
def test_safetensors_output_holds_the_expected_tensors(sid: str, tmp_path: Path) -> None:
    d = scenario(sid)
    src, dst = _strategy(d / "src"), _strategy(d / "dst")
    assert dst is None or not Path(dst).is_dir()
    store = tmp_path / "store.zarr"
    ingest = ["ingest", str(d / "src" / "checkpoints"), "--store", str(store), "--quiet"]
    assert cli_main(ingest + (["--strategy", src] if src else [])) == 0
    export = ["export", str(store), "--out", str(tmp_path / "export"), "--format", "safetensors", "--quiet"]
    assert cli_main(export + (["--strategy", dst] if dst else [])) == 0
    assert _differences(d / "dst" / "expected", tmp_path / "export") == []
    direct = ["transform", str(d / "src" / "checkpoints"), "--out", str(tmp_path / "direct"), "--format",
              "safetensors", "--quiet"]
    direct += (["--src-strategy", src] if src else []) + (["--dst-strategy", dst] if dst else [])
    assert cli_main(direct) == 0
    assert _differences(d / "dst" / "expected", tmp_path / "direct") == []


def test_every_scenario_with_an_expected_destination_is_converted() -> None:
    if not have_fixtures():
        pytest.skip(f"MindSpore fixtures not found at {FIXTURES}")
    with_expected = {p.name for p in FIXTURES.iterdir() if (p / "dst" / "expected").is_dir()}
    # the shared set plus any MindFormers Checkpoint 2.0 save placed there (those in the
    # repository, CKPT2, are checked piece by piece in tests/test_fixtures_ckpt2.py)
    assert with_expected - set(CKPT2) == set(PLAIN) | set(PIPELINE) | set(REFUSED)
