"""Run under MindSpore's own Python: merge pipeline strategies with MindSpore and read
strategy files back with MindSpore's own parsers; print the results as JSON.

usage: python ms_merge_check.py JOB.json

JOB.json keys (all optional):
  "merge_dir":   [[SRC_DIR, OUT_FILE], ...]       mindspore.parallel.merge_pipeline_strategys
  "merge_files": [[OUT_FILE, [FILE, ...]], ...]   MindSpore's _merge_protobuf/_merge_json_strategy,
                                                  with the input order given (glob order is arbitrary)
  "read":        [FILE, ...]                      _convert_to_list(_build_searched_strategy(FILE))
  "rank_list":   [[RANK, SRC_STRATEGY, DST_STRATEGY_OR_NULL], ...]  mindspore.rank_list_for_transform
Each result is either the value or {"error": "<ExceptionType>: <message>"}.
"""

import json
import sys

import mindspore as ms
from mindspore.parallel import _parallel_serialization as ps


def plain(value):
    """JSON-friendly copy (numpy scalars and tuples become ints and lists)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "item"):
        return value.item()
    return value


def attempt(fn, *args):
    try:
        return plain(fn(*args))
    except Exception as err:  # report MindSpore's refusal instead of dying
        return {"error": f"{type(err).__name__}: {err}"}


def merge_files(out_file, files):
    if files[0].endswith(".json"):
        ps._merge_json_strategy(files, out_file)
    else:
        ps._merge_protobuf_strategy(files, out_file)
    return "ok"


def merge_dir(src, out):
    ms.parallel.merge_pipeline_strategys(src, out)
    return "ok"


def read(path):
    return ps._convert_to_list(ps._build_searched_strategy(path))


def main(job_path):
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    out = {
        "merge_dir": [attempt(merge_dir, src, dst) for src, dst in job.get("merge_dir", [])],
        "merge_files": [attempt(merge_files, dst, files) for dst, files in job.get("merge_files", [])],
    }
    out["read"] = {p: attempt(read, p) for p in job.get("read", [])}
    out["rank_list"] = [attempt(ms.rank_list_for_transform, r, s, d) for r, s, d in job.get("rank_list", [])]
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
