"""Many tiny tensors: one shard holding N small parameters, ingested and exported.

usage: python bench/bench_tiny.py [--tensors 100000] [--dir DIR] [--max-mem 1G]

A checkpoint with many tiny tensors (biases, norms, scalars: ~500 bytes each, mixed
dtypes) used to make one chunk file and one ``zarr.json`` per tensor: 100 000 tensors took
1.26 GB of disk for 84 MB of values. This writes such a shard with :mod:`zckpt.jobs.generate`
(one rank, no strategy), then runs ``ingest`` and ``export`` each in a fresh process
(bench/phase.py, so peak RSS is the phase's own) and prints the files and bytes the store
takes on disk, wall and CPU seconds and peak RSS of each phase.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import MiB, machine, peak, phase_env, run_phase, tree_files  # noqa: E402

SHAPES = (((210,), "Float32"), ((26, 16), "BFloat16"), ((13, 16), "Int32"), ((), "Float32"), ((7, 3), "Float16"))
"""Shapes and types dealt in turn: ~500 bytes per tensor on average, as in a real model's tail."""


def build(src: Path, count: int) -> int:
    """Write the shard; the bytes of its values."""
    from zckpt.jobs.generate import write_model
    from zckpt.jobs.generate_model import TensorDef

    defs = [TensorDef(f"layers.{i // 16}.p{i % 16}.w", *SHAPES[i % len(SHAPES)]) for i in range(count)]
    write_model(src, defs, device_num=1, strategy_format=None, scalars=False)
    return sum(t.nbytes for t in defs)


def disk_bytes(root: Path) -> int:
    """Bytes the tree takes on the disk (allocated blocks, as ``du``), and not its files' sizes."""
    return sum(os.lstat(Path(d) / f).st_blocks * 512 for d, _, fs in os.walk(root) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    ap.add_argument("--max-mem", default="1G")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        values = build(root / "src", a.tensors)
        print(f"{a.tensors} tensors, {values / MiB:.1f} MiB of values, shard written in "
              f"{time.perf_counter() - t:.1f} s; {machine(root)}")
        env = phase_env()
        store, out = root / "store.zarr", root / "out"
        rows = []
        for phase, args in (("ingest", [str(root / "src"), "", str(store)]), ("export", [str(store), "", str(out)])):
            r = run_phase(sys.executable, phase, *args, "--max-mem", a.max_mem, env=env)
            if "error" in r:
                raise SystemExit(f"{phase}: {r['error']}")
            rows.append((phase, r))
        files, dirs = tree_files(store)
        print(f"store: {files} files, {dirs} directories, {disk_bytes(store) / MiB:.1f} MiB on disk")
        print(f"{'phase':8} {'wall s':>8} {'cpu s':>8} {'peak RSS MiB':>13}")
        for phase, r in rows:
            print(f"{phase:8} {r['seconds']:8.2f} {r['cpu_seconds']:8.2f} {peak(r) / MiB:13.0f}")


if __name__ == "__main__":
    main()
