"""MindSpore itself reads zckpt's safetensors and writes the very same bytes.

Runs ``mindspore.load_checkpoint(f, format="safetensors")`` and
``mindspore.save_checkpoint(..., format="safetensors")`` in MindSpore's own virtualenv
(skipped when absent, see tests/mindspore_env.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from mindspore_env import require_ms_python, run_ms_tool
from sf_models import all_dtypes_tensors

import zckpt
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.safetensors import SafetensorsReader
from zckpt.jobs.generate import write_model

pytestmark = pytest.mark.mindspore

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"


def _expected(ckpt: Path) -> dict[str, dict[str, object]]:
    """What MindSpore must load: every tensor of the matching .ckpt export (strings are not
    tensors; MindSpore's safetensors loader skips the metadata that holds them)."""
    out: dict[str, dict[str, object]] = {}
    with CkptReader(ckpt) as r:
        for name, e in r.entries.items():
            if e.kind == "tensor":
                raw = np.ascontiguousarray(r.array(name)).view(np.uint8).tobytes()
                out[name] = {"dtype": e.ms_type, "shape": list(e.shape), "sha256": hashlib.sha256(raw).hexdigest()}
    return out


def test_mindspore_loads_and_writes_zckpt_safetensors(tmp_path: Path) -> None:
    require_ms_python()
    pairs: list[tuple[Path, Path, bool]] = []
    for strings in ({}, {"note": "not a tensor"}):
        tag = "str" if strings else "plain"
        model = write_model(tmp_path / f"src_{tag}", all_dtypes_tensors(), device_num=2, strings=strings)
        store = tmp_path / f"{tag}.zarr"
        zckpt.ingest(str(tmp_path / f"src_{tag}"), store, str(model.strategy_path))
        for dst, strategy in (("full", None), ("sharded", str(model.strategy_path))):
            ck = zckpt.export(store, tmp_path / f"ck_{tag}_{dst}", strategy)
            opts = zckpt.ExportOptions(format="safetensors")
            st = zckpt.export(store, tmp_path / f"st_{tag}_{dst}", strategy, options=opts)
            pairs += [(Path(c.path), Path(s.path), False) for c, s in zip(ck.ranks, st.ranks, strict=True)]
    # crc_num as MindSpore checks it (MindSpore's own crc code cannot hash bf16 arrays: float32 example)
    ex = tmp_path / "ex.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), ex, str(EXAMPLE / "src" / "strategy.ckpt"))
    ck = zckpt.export(ex, tmp_path / "ex_ck", str(EXAMPLE / "dst" / "strategy.ckpt"))
    st = zckpt.export(ex, tmp_path / "ex_st", str(EXAMPLE / "dst" / "strategy.ckpt"),
                      options=zckpt.ExportOptions(format="safetensors", crc=True))
    pairs += [(Path(c.path), Path(s.path), True) for c, s in zip(ck.ranks, st.ranks, strict=True)]
    resave = [(s, tmp_path / f"ms_{i}.safetensors") for i, (_, s, crc) in enumerate(pairs) if not crc]
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"load": [[str(s), crc] for _, s, crc in pairs],
                               "resave": [[str(a), str(b)] for a, b in resave]}))
    got = run_ms_tool("ms_safetensors.py", str(job))
    for c, s, _ in pairs:
        assert got["load"][str(s)] == _expected(c), f"MindSpore reads {s} differently"
    identical = 0
    for ours, theirs in resave:
        # MindSpore's writer drops zckpt's string metadata; everything else is the same bytes
        with SafetensorsReader(ours) as r:
            has_strings = any(e.kind == "str" for e in r.entries.values())
        if not has_strings:
            assert theirs.read_bytes() == ours.read_bytes(), f"MindSpore writes {ours} differently"
            identical += 1
        with SafetensorsReader(theirs) as a, SafetensorsReader(ours) as b:
            tensors = [n for n, e in b.entries.items() if e.kind == "tensor"]
            assert [n for n in a.entries] == tensors
            for n in tensors:
                assert a.array(n).tobytes() == b.array(n).tobytes() and a.entries[n].shape == b.entries[n].shape
    assert identical == 3 and len(resave) == 6
