"""Run under MindSpore's own Python: load rank directories with
mindspore.load_segmented_checkpoints and print, as JSON, every entry's dtype, shape and a
SHA-256 of its raw bytes (strings: their value), in the order MindSpore's dict has them.

usage: python ms_segmented_load.py JOB.json
JOB.json: [{"dir": DIR, "specify_prefix": ..., "filter_prefix": ...}, ...] (prefixes optional)
Each result is {"entries": {name: {...}}} or {"error": "<ExceptionType>: <message>"}.
"""

import hashlib
import json
import sys

import mindspore as ms
import numpy as np


def describe(value):
    if isinstance(value, str):
        return {"kind": "str", "value": value}
    arr = value.asnumpy()
    raw = np.ascontiguousarray(arr).view(np.uint8).tobytes() if arr.size else b""
    return {"kind": "tensor", "dtype": str(value.dtype), "shape": list(arr.shape),
            "sha256": hashlib.sha256(raw).hexdigest()}


def load(spec):
    kwargs = {k: spec[k] for k in ("specify_prefix", "filter_prefix") if spec.get(k) is not None}
    try:
        loaded = ms.load_segmented_checkpoints(spec["dir"], **kwargs)
    except Exception as err:  # report MindSpore's refusal instead of dying
        return {"error": f"{type(err).__name__}: {err}"}
    return {"entries": {name: describe(v) for name, v in loaded.items()}}


def main(job_path):
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    json.dump([load(spec) for spec in job], sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
