"""Run under MindSpore's own Python: load checkpoint files with mindspore.load_checkpoint and
print, as JSON, every entry's dtype, shape and a SHA-256 of its raw bytes.

usage: python ms_load_dump.py FILE.ckpt [FILE.ckpt ...]
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
    dtype = str(value.dtype)
    raw = np.ascontiguousarray(arr).view(np.uint8).tobytes() if arr.size else b""
    return {"kind": "tensor", "dtype": dtype, "shape": list(arr.shape), "sha256": hashlib.sha256(raw).hexdigest()}


def main(paths):
    out = {}
    for p in paths:
        loaded = ms.load_checkpoint(p)
        out[p] = {name: describe(v) for name, v in loaded.items()}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
