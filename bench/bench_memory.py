"""Peak RSS of zckpt ingest and export as the model grows (default 1, 4 and 16 GiB).

For each size: generate a transformer-like model on ``--src-ranks`` ranks without data
parallel replication (so the source is as large as the model), ingest it and export it to
``--dst-ranks`` ranks with optimizer parallel (with 1 worker, then 2 thread workers in the
same process), each phase in its own process with
``--max-mem`` (default 1 GiB), then delete everything before the next size (disk stays
at about 3x the largest model).

    python bench/bench_memory.py --sizes 1,4,16 --work /tmp/zckpt-mem
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from benchlib import GiB, MiB, phase_env, run_phase
from benchlib import tree_bytes as _tree_bytes

from zckpt.formats.strategy import StrategyMap, encode_strategy
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import transformer_like


def _phase(*args: str) -> dict[str, Any]:
    result = run_phase(sys.executable, *args, env=phase_env())
    if "error" in result:
        raise SystemExit(f"phase {args[0]} failed: {result['error']}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,16", help="model sizes in GiB, comma separated")
    ap.add_argument("--src-ranks", type=int, default=8)
    ap.add_argument("--dst-ranks", type=int, default=4)
    ap.add_argument("--max-mem", default="1GiB")
    ap.add_argument("--dtype", default="Float32")
    ap.add_argument("--work", type=Path, default=Path("/tmp/zckpt-mem"))
    a = ap.parse_args()
    rows = []
    for size_gib in (float(s) for s in a.sizes.split(",")):
        root = a.work / f"m{size_gib:g}"
        shutil.rmtree(root, ignore_errors=True)
        size = int(size_gib * GiB)
        src = transformer_like(size, device_num=a.src_ranks, model_parallel=a.src_ranks, weight_type=a.dtype)
        write_model(root / "src", src, device_num=a.src_ranks)
        dst = transformer_like(size, device_num=a.dst_ranks, opt_parallel=True, weight_type=a.dtype)
        if [t.shape for t in src] != [t.shape for t in dst]:
            raise SystemExit("source and destination shapes differ: choose rank counts with a common hidden size")
        (root / "dst.ckpt").write_bytes(encode_strategy(StrategyMap(layouts={t.name: {0: t.layout} for t in dst
                                                                             if t.layout is not None})))
        logical = sum(t.nbytes for t in src)
        ing = _phase("ingest", str(root / "src"), str(root / "src" / "strategy.ckpt"), str(root / "s.zarr"),
                     "--max-mem", a.max_mem)
        exp = _phase("export", str(root / "s.zarr"), str(root / "dst.ckpt"), str(root / "out"), "1", "zarr",
                     "--max-mem", a.max_mem)
        out_bytes = _tree_bytes(root / "out")
        shutil.rmtree(root / "out")
        exp2 = _phase("export", str(root / "s.zarr"), str(root / "dst.ckpt"), str(root / "out"), "2", "zarr",
                      "--max-mem", a.max_mem)
        rows.append({"size_bytes": logical, "ingest": ing, "export": exp, "export_2_workers": exp2,
                     "out_bytes": out_bytes})
        shutil.rmtree(root, ignore_errors=True)
        print(f"{logical / GiB:6.2f} GiB  ingest {ing['seconds']:7.1f} s  "
              f"peak RSS {ing['max_rss_bytes'] / MiB:6.0f} MiB   export {exp['seconds']:7.1f} s  "
              f"peak RSS {exp['max_rss_bytes'] / MiB:6.0f} MiB   export, 2 thread workers {exp2['seconds']:7.1f} s  "
              f"peak RSS {exp2['max_rss_bytes'] / MiB:6.0f} MiB", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
