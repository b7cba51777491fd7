"""Models and comparisons shared by the safetensors and standard-store tests.

Values are recomputed from :mod:`zckpt.jobs.generate_model` (the global value of each tensor), and the
safetensors shards are cut from them by ``tests/oracle.py`` from the strategy file's raw
fields, not by :mod:`zckpt.core.layout`: a slicing bug that :func:`zckpt.jobs.generate.write_model`'s
``.ckpt`` shards and zckpt's reassembly would share does not pass unseen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import oracle

import zckpt
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import make_layout
from zckpt.jobs.generate import GeneratedModel, write_model
from zckpt.jobs.generate_model import TensorDef

TWO = (2,)
"""Device matrix of the 2-rank source: tensor map ``[[0], ...]`` splits dimension 0 in two."""

INT_TYPES = ["Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64"]
ALL_TYPES = ["Float16", "Float32", "Float64", "BFloat16", "Bool", *INT_TYPES]
STRINGS = {"note": "zckpt \u2713 unicode"}


def all_dtypes_tensors() -> list[TensorDef]:
    """Every MindSpore tensor type, sharded over 2 ranks (dim 0) or whole, plus an empty tensor."""
    split2 = make_layout(TWO, [[0], []])
    split1 = make_layout(TWO, [[0]])
    out = [
        TensorDef("w.f16", (4, 6), "Float16", split2),
        TensorDef("w.f32", (6, 4), "Float32", split2),
        TensorDef("w.f64", (4, 3), "Float64", None),
        TensorDef("w.bf16", (8, 4), "BFloat16", split2),
        TensorDef("w.bool", (4, 2), "Bool", split2),
        TensorDef("w.empty", (0, 3), "Float32", None),
    ]
    out += [TensorDef(f"i.{t.lower()}", (6,), t, split1) for t in INT_TYPES]
    return out


def all_dtypes_model(root: Path) -> GeneratedModel:
    """A 2-rank .ckpt job with every dtype, optimizer scalars and a string entry."""
    return write_model(root, all_dtypes_tensors(), device_num=2, strings=STRINGS)


def ingest_all_dtypes(root: Path) -> tuple[GeneratedModel, Path]:
    """:func:`all_dtypes_model` under ``root/src`` and its store ``root/store.zarr``."""
    model = all_dtypes_model(root / "src")
    zckpt.ingest(str(root / "src"), root / "store.zarr", str(model.strategy_path))
    return model, root / "store.zarr"


def entries_by_name(path: Path) -> dict[str, tuple[str, str, tuple[int, ...], bytes]]:
    """Every entry of a .ckpt as (kind, type, shape, bytes or UTF-8 text), by name."""
    out: dict[str, tuple[str, str, tuple[int, ...], bytes]] = {}
    with CkptReader(path) as r:
        for name, e in r.entries.items():
            if e.kind == "str":
                out[name] = (e.kind, e.ms_type, (), r.string(name).encode("utf-8"))
            else:
                out[name] = (e.kind, e.ms_type, e.shape, np.ascontiguousarray(r.array(name)).tobytes())
    return out


def save_safetensors_job(model: GeneratedModel, out: Path, *, strings: bool = False) -> list[Path]:
    """The same job as MindSpore's ``save_checkpoint(format="safetensors")`` would write it,
    through the ``safetensors`` package: ``rank_<r>/checkpoint_<r>.safetensors``, metadata
    ``{"format": "ms"}``, bf16 as safetensors ``BF16`` (an ``ml_dtypes.bfloat16`` view)."""
    import ml_dtypes
    import safetensors.numpy as sn

    from zckpt.formats.safetensors import STRING_PREFIX

    files = []
    assert model.strategy_path is not None
    raw = oracle.read_layouts(model.strategy_path)
    for r in range(model.device_num):
        tensors: dict[str, np.ndarray] = {}
        for t in model.tensors:
            value = oracle.cut(model.global_value(t.name), raw, t.name, r).copy()  # C order; keeps 0-d shapes
            tensors[t.name] = value.view(ml_dtypes.bfloat16) if t.ms_type == "BFloat16" else value
        meta: dict[str, Any] = {"format": "ms"}
        if strings:
            meta.update({STRING_PREFIX + k: v for k, v in model.strings.items()})
        path = out / f"rank_{r}" / f"checkpoint_{r}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        sn.save_file(tensors, str(path), metadata=meta)
        files.append(path)
    return files
