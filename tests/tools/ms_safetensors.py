"""Run under MindSpore's own Python: read and write safetensors checkpoints with MindSpore.

usage: python ms_safetensors.py JOB.json

JOB.json: {"load": [[FILE, CRC_CHECK], ...], "resave": [[SRC, DST], ...]}
  load    mindspore.load_checkpoint(FILE, format="safetensors", crc_check=CRC_CHECK) and
          report every entry's dtype, shape and SHA-256 of its raw bytes
  resave  load SRC and write it again with mindspore.save_checkpoint(format="safetensors")
Prints {"load": {FILE: {name: {...}}}, "resave": [DST, ...]} as JSON on stdout.
"""

import hashlib
import json
import sys

import mindspore as ms
import numpy as np


def describe(value):
    arr = value.asnumpy()
    raw = np.ascontiguousarray(arr).view(np.uint8).tobytes() if arr.size else b""
    return {"dtype": str(value.dtype), "shape": list(arr.shape), "sha256": hashlib.sha256(raw).hexdigest()}


def main(job_file):
    with open(job_file, encoding="utf-8") as f:
        job = json.load(f)
    out = {"load": {}, "resave": []}
    for path, crc in job.get("load", []):
        loaded = ms.load_checkpoint(path, format="safetensors", crc_check=crc)
        out["load"][path] = {name: describe(v) for name, v in loaded.items()}
    for src, dst in job.get("resave", []):
        ms.save_checkpoint(ms.load_checkpoint(src, format="safetensors"), dst, format="safetensors")
        out["resave"].append(dst)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
