"""Cluster against one process: the same export (and transform) on a loopback Dask cluster
and in one process with as many thread workers as the cluster has threads.

The job is bench/bench_jobs.py's (a LLaMA-like model as MindSpore writes it), ingested once.
A scheduler and ``--cluster-workers`` one-thread ``dask worker`` processes are started on
loopback, each in a working directory of its own (two hosts sharing a filesystem), and
kept for every run: a user's cluster is up before the job comes. Each run is a fresh
``zckpt`` command (``python -m zckpt.cli``) timed from start to exit, ``--scheduler ADDRESS``
against ``--workers N``; the medians of ``--repeat`` runs and their ratio are printed (the
issue's target: cluster <= 1.2x one process). Warm page cache (both sides read the same
files; the cache is not dropped, other work on the machine would pay for it).

    python bench/bench_cluster.py --size-gib 1 --work /var/tmp/zckpt-jobs --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_jobs import PRESETS, prepare
from benchlib import GiB, phase_env
from jobs_model import Parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dask_hosts import cluster  # noqa: E402  (the tests' loopback cluster: the commands a user types)


def loopback_cluster(workers: int, root: Path) -> Any:
    """A scheduler and ``workers`` one-thread worker processes (no nanny), each in a directory
    of its own below ``root``: ``(address, worker processes)`` while open."""
    spec = []
    for i in range(workers):
        (root / f"host-{i}").mkdir(exist_ok=True)
        spec.append((["--nthreads", "1", "--no-nanny"], root / f"host-{i}", phase_env()))
    return cluster(root, spec, expect=workers)



def timed(args: list[str], out: Path) -> float:
    """Seconds of one ``zckpt ARGS`` run writing ``out`` (removed first)."""
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "zckpt.cli", *args, "--quiet"], env=phase_env(), check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--src", default=PRESETS["512"][0], help="source shape (bench_jobs.py), e.g. pp4xtp8xdp16")
    ap.add_argument("--dst", default="tp8xdp2", help="destination shape, e.g. tp8xdp2 (16 files)")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/zckpt-jobs"))
    ap.add_argument("--cluster-workers", type=int, default=2, help="one-thread worker processes of the cluster")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--phases", default="export,transform")
    a = ap.parse_args()
    n = a.cluster_workers
    job = prepare(a.work, int(a.size_gib * GiB), Parallel.parse(a.src), [Parallel.parse(a.dst)], "adamw",
                  os.cpu_count() or 1)
    dst_strategy = job.dsts[0][1]
    src_strategy = [] if job.src_strategy is None else ["--src-strategy", str(job.src_strategy)]
    dst = [] if dst_strategy is None else ["--dst-strategy", str(dst_strategy)]
    store, out = job.root / "bench-cluster.zarr", job.root / "bench-cluster-out"
    if not (store / "zarr.json").is_file():
        shutil.rmtree(store, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "zckpt.cli", "ingest", str(job.src), *src_strategy, "--store",
                        str(store), "--quiet"], env=phase_env(), check=True)
    commands = {"export": ["export", str(store), *dst, "--out", str(out)],
                "transform": ["transform", str(job.src), *src_strategy, *dst, "--out", str(out)]}
    phases = [p for p in a.phases.split(",") if p]
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(dir=a.work) as hosts, loopback_cluster(n, Path(hosts)) as (address, _):
        for _ in range(a.repeat):
            for phase in phases:
                times.setdefault((phase, "cluster"), []).append(
                    timed([*commands[phase], "--scheduler", address], out))
                times.setdefault((phase, "process"), []).append(timed([*commands[phase], "--workers", str(n)], out))
    shutil.rmtree(out, ignore_errors=True)
    print(f"{job.par} -> {a.dst}, {a.size_gib:g} GiB, warm cache, medians of {a.repeat}: "
          f"{n} one-thread dask workers on loopback against one process with --workers {n}")
    for phase in phases:
        cluster, process = (statistics.median(times[(phase, k)]) for k in ("cluster", "process"))
        runs = " ".join(f"{t:.2f}" for t in times[(phase, "cluster")]) + " / " + \
            " ".join(f"{t:.2f}" for t in times[(phase, "process")])
        print(f"{phase:10s} cluster {cluster:6.2f} s   process {process:6.2f} s   ratio {cluster / process:.2f}"
              f"   (runs {runs})")


if __name__ == "__main__":
    main()
