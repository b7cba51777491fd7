"""MindSpore's side of the unified-safetensors and load_distributed_checkpoint cross-checks.

usage (under MindSpore's Python; prints JSON):
  ms_unified.py unify SRC_CKPT_DIR STRATEGY WORK      ckpt_to_safetensors into WORK/st, then
                                                      mindspore.parallel.unified_safetensors into WORK/unified
  ms_unified.py save UNIFIED PREDICT_STRATEGY OUT R.. load_distributed_checkpoint(None, ..., rank_id=R) per rank
  ms_unified.py transform SRC SRC_STRATEGY DST_STRATEGY OUT FORMAT
                                                      mindspore.transform_checkpoints(..., output_format=FORMAT)
  ms_unified.py collect DIR SUFFIX_JSON                which file of each rank_<r>/ unified_safetensors picks for
                                                      each file_suffix (MindSpore's _collect_safetensor_files)
  ms_unified.py net SHAPES_JSON ARGS_JSON             one Cell loaded by MindSpore's load_distributed_checkpoint
                                                      (or load_segmented_checkpoints: ARGS "function") and one by
                                                      zckpt's, same arguments: both value sets (.npz, bf16 as f32)

``net`` needs zckpt importable here; without it the result is ``{"skip": reason}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class Net(nn.Cell):  # type: ignore[misc]
    """A Cell holding one Parameter per name (zeros of the given shape and dtype)."""

    def __init__(self, shapes: dict[str, Any]) -> None:
        super().__init__()
        for i, (name, (shape, dtype)) in enumerate(shapes.items()):
            value = ms.Tensor(np.zeros(shape, np.float32), getattr(ms, dtype))
            setattr(self, f"p{i}", ms.Parameter(value, name=name))


def values(net: Net) -> dict[str, np.ndarray]:
    return {p.name: p.float().asnumpy() if p.dtype == ms.bfloat16 else p.asnumpy() for p in net.get_parameters()}


def unify(src: str, strategy: str, work: str) -> dict[str, Any]:
    st, unified = Path(work) / "st", Path(work) / "unified"
    ms.ckpt_to_safetensors(src, str(st))
    ms.parallel.unified_safetensors(str(st), strategy, str(unified))
    return {"st": str(st), "unified": str(unified), "files": sorted(p.name for p in unified.iterdir())}


def save(unified: str, predict: str, out: str, ranks: list[str]) -> dict[str, Any]:
    for r in ranks:
        ms.load_distributed_checkpoint(None, predict_strategy=predict, format="safetensors",
                                       unified_safetensors_dir=unified, dst_safetensors_dir=out, rank_id=int(r))
    return {"out": out}


def transform(src: str, src_strategy: str, dst_strategy: str, out: str, fmt: str) -> dict[str, Any]:
    ms.transform_checkpoints(src, out, "checkpoint_", src_strategy, dst_strategy, output_format=fmt)
    return {"out": out, "files": sorted(str(p.relative_to(out)) for p in Path(out).rglob("*") if p.is_file())}


def collect(src: str, suffixes_json: str) -> dict[str, Any]:
    from mindspore.parallel.transform_safetensors import _collect_safetensor_files

    out: dict[str, Any] = {}
    for suffix in json.loads(suffixes_json):
        try:
            found = _collect_safetensor_files(src, "safetensors", suffix)
            out[str(suffix)] = {str(r): Path(p).name for r, p in found.items()}
        except ValueError:
            out[str(suffix)] = "ValueError"
    return out


def net(shapes_json: str, args_json: str) -> dict[str, Any]:
    try:
        import zckpt
    except ImportError as err:
        return {"skip": f"zckpt is not importable in MindSpore's environment: {err}"}
    shapes = json.loads(Path(shapes_json).read_text())
    args = json.loads(Path(args_json).read_text())
    ours, theirs = Net(shapes), Net(shapes)
    function = args.get("function", "load_distributed_checkpoint")
    if function == "load_segmented_checkpoints":
        ms.load_segmented_checkpoints(net=theirs, **args["mindspore"])
        result = zckpt.load_segmented_checkpoints(net=ours, **args["zckpt"])
    else:
        ms.load_distributed_checkpoint(theirs, **args["mindspore"])
        result = zckpt.load_distributed_checkpoint(ours, **args["zckpt"])
    out = Path(args["out"])
    np.savez(out / "mindspore.npz", **values(theirs))
    np.savez(out / "zckpt.npz", **values(ours))
    return {"zckpt_result": repr(result)}


def main(argv: list[str]) -> int:
    cmd, rest = argv[0], argv[1:]
    stdout = os.dup(1)
    os.dup2(2, 1)  # MindSpore's progress bars (also in its worker processes) go to stderr
    try:
        if cmd == "unify":
            doc = unify(*rest)
        elif cmd == "save":
            doc = save(rest[0], rest[1], rest[2], rest[3:])
        elif cmd == "transform":
            doc = transform(*rest)
        elif cmd == "collect":
            doc = collect(*rest)
        else:
            doc = net(*rest)
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
    json.dump(doc, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
