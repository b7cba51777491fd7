"""Benchmark: one destination rank's slices read at load time, against converting that rank.

Generates (or reuses) bench_transform's transformer-like model on ``--src-ranks`` ranks and
its destination strategy, then, each in a fresh process, for destination rank ``--rank``:

* ``load from shards``: ``zckpt.jobs.loading.read_rank`` over the mapped source shards (what
  ``load_distributed_checkpoint`` does before handing the arrays to the network);
* ``load from store``: the same from a store of the job (built once, not timed);
* ``convert rank``: ``transform_checkpoint_by_rank`` for that rank (a temporary store of the
  source ranks it needs, then the rank's file), what a user ran before loading.

Printed per phase: wall seconds, peak RSS (``VmHWM``) and the rank's slice bytes.

    python bench/bench_load.py --size-gib 1 --src-ranks 8 --dst-ranks 4 --work /tmp/zckpt-bench
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

PHASE = r"""
import json, sys, time
from pathlib import Path
kind, src, src_strategy, dst_strategy, rank, extra = sys.argv[1:7]
rank = int(rank)
t = time.perf_counter()
if kind == "convert":
    import zckpt
    ranks = zckpt.rank_list_for_transform(rank, src_strategy, dst_strategy)
    files = {r: str(next((Path(src) / f"rank_{r}").glob("*.ckpt"))) for r in ranks}
    zckpt.transform_checkpoint_by_rank(rank, files, extra, src_strategy, dst_strategy)
    nbytes = Path(extra).stat().st_size
else:
    from zckpt.formats.strategy import read_strategy
    from zckpt.jobs.loading import ShardSlicer, read_rank
    from zckpt.store.store import Store
    source = Store.open(extra) if kind == "store" else ShardSlicer(src, src_strategy)
    values = read_rank(source, read_strategy(dst_strategy), rank)
    nbytes = sum(v.nbytes for v in values.values() if not isinstance(v, str))
seconds = time.perf_counter() - t
hwm = next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
           if l.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "peak_rss": hwm, "bytes": nbytes}))
"""


def run(kind: str, *args: str) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", PHASE, kind, *args], capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": str(HERE.parent), "PATH": "/usr/bin:/bin"})
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    from bench_transform import prepare

    import zckpt

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--src-ranks", type=int, default=8)
    ap.add_argument("--dst-ranks", type=int, default=4)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "zckpt-bench"))
    a = ap.parse_args()
    work = Path(a.work)
    src, src_strategy, dst_strategy = prepare(work, int(a.size_gib * 1024**3), a.src_ranks, a.dst_ranks, True,
                                              "Float32")
    store = work / f"load-store-{src.parent.name}.zarr"
    if not (store / "zarr.json").is_file():
        zckpt.ingest(str(src), store, str(src_strategy))
    out = work / "load-convert" / f"rank_{a.rank}.ckpt"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [("load from shards", run("shards", str(src), str(src_strategy), str(dst_strategy), str(a.rank), "-")),
            ("load from store", run("store", str(src), str(src_strategy), str(dst_strategy), str(a.rank),
                                    str(store))),
            ("convert rank", run("convert", str(src), str(src_strategy), str(dst_strategy), str(a.rank), str(out)))]
    print(f"model {a.size_gib} GiB, {a.src_ranks} -> {a.dst_ranks} ranks (optimizer-sharded), destination rank "
          f"{a.rank}")
    print(f"| {'phase':<18} | {'wall s':>7} | {'peak RSS MiB':>12} | {'rank MiB':>8} |")
    print(f"|{'-' * 20}|{'-' * 9}|{'-' * 14}|{'-' * 10}|")
    for label, r in rows:
        print(f"| {label:<18} | {r['seconds']:>7.2f} | {r['peak_rss'] / 2**20:>12.0f} | {r['bytes'] / 2**20:>8.0f} |")


if __name__ == "__main__":
    main()
