"""Benchmark: zckpt ingest + export against MindSpore's transform_checkpoints and a plain copy.

Generates a transformer-like model (hundreds of 2-D weights plus biases and norms) as real
MindSpore-format shards on ``--src-ranks`` ranks, a destination strategy on
``--dst-ranks`` ranks (``dev_matrix (dp, mp)`` with ``mp = --dst-model-parallel``, the
optimizer sharding every weight over ``dp`` by default), then runs every phase in its own
process (MindSpore, ingest, export, the direct ``zckpt transform``, copies) and prints
wall time, throughput, peak RSS and read amplification side by side.

    python bench/bench_transform.py --size-gib 1 --src-ranks 8 --dst-ranks 4 --work /tmp/zckpt-bench

``--scratch /dev/shm/zb`` puts the store and every output on a tmpfs (sources stay in
``--work``), which takes the disk's write speed out of the comparison. Every phase runs
``--repeat`` times (3 by default) and the median run is shown with all its times: on a VM
the same copy varies 2-3x from run to run (the *to host* column shows the MiB of freed
memory the guest handed back to the hypervisor during the phase, which must then be
faulted in again).

MindSpore runs when ``--mindspore-python`` (or $ZCKPT_MS_PYTHON) names a Python with
mindspore installed; it is skipped otherwise. Generated inputs are reused between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

from benchlib import GiB, MiB, phase_env
from benchlib import peak as _peak
from benchlib import run_phase as _run_phase
from benchlib import tree_bytes as _tree_bytes

from zckpt.formats.strategy import StrategyMap, encode_strategy
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import transformer_like


def prepare(work: Path, size: int, src_ranks: int, dst_ranks: int, opt: bool, dtype: str,
            dst_mp: int | None = None) -> tuple[Path, Path, Path]:
    """Source shards (generated once, reused) and the destination strategy: ``dst_ranks``
    devices as ``dev_matrix (dp, mp)`` with ``mp = dst_mp`` (default: the generator's), the
    optimizer sharding every weight over ``dp`` when ``opt``."""
    tag = f"{size}-{src_ranks}-{dst_ranks}-{int(opt)}-{dtype}"
    root = work / f"model-{tag}"
    src, src_strategy = root / "src", root / "src" / "strategy.ckpt"
    dst_strategy = root / f"dst_strategy_mp{dst_mp or 0}_opt{int(opt)}.ckpt"
    tensors = transformer_like(size, device_num=src_ranks, opt_parallel=False, weight_type=dtype)
    if not (root / "ready").is_file():
        shutil.rmtree(root, ignore_errors=True)
        write_model(src, tensors, device_num=src_ranks)
        (root / "ready").write_text("ok")
    dst = transformer_like(size, device_num=dst_ranks, model_parallel=dst_mp, opt_parallel=opt, weight_type=dtype)
    src_shapes = {t.name: t.shape for t in tensors}
    if any(src_shapes[t.name] != t.shape for t in dst):
        raise SystemExit("source and destination models differ in shape; pick ranks with a common hidden size")
    smap = StrategyMap(layouts={t.name: {0: t.layout} for t in dst if t.layout is not None})
    dst_strategy.write_bytes(encode_strategy(smap))
    return src, src_strategy, dst_strategy


def prewarm(scratch: Path, nbytes: int) -> None:
    """Touch ``nbytes`` of scratch storage once (written in 64 MiB blocks, then deleted)."""
    block = b"\0" * (64 * MiB)
    target = scratch / "prewarm.bin"
    with open(target, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
    target.unlink()


def _reported_kib() -> int | None:
    """KiB of free guest memory handed back to the hypervisor so far (virtio-balloon free
    page reporting), when the kernel exposes it: each such page costs a host fault when
    written again, the main source of variance between runs on such VMs."""
    try:
        return int(Path("/sys/module/page_reporting/parameters/reported_kib").read_text())
    except (OSError, ValueError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--src-ranks", type=int, default=8)
    ap.add_argument("--dst-ranks", type=int, default=4)
    ap.add_argument("--no-opt-parallel", action="store_true")
    ap.add_argument("--dst-model-parallel", type=int, default=2,
                    help="tensor parallel degree of the destination (the rest is data parallel, over which the "
                         "optimizer shards; default 2: 4 ranks = dp 2 x mp 2)")
    ap.add_argument("--dtype", default="Float32", choices=["Float32", "BFloat16", "Float16"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/zckpt-bench"), help="generated sources (reused)")
    ap.add_argument("--scratch", type=Path, default=None,
                    help="where the store and outputs go (default: WORK/runs); e.g. a tmpfs such as /dev/shm/zb")
    ap.add_argument("--prewarm-gib", type=float, default=0.0,
                    help="write and delete this many GiB in SCRATCH before each phase: on a VM, memory "
                         "the guest has not touched lately makes the first writes to a tmpfs several times "
                         "slower (measured 7.8 s then 3.4 s for the same cp -r), which would land on whichever "
                         "phase runs first")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of every phase; the median run is reported (times on a VM vary 2-3x from run to run)")
    ap.add_argument("--keep-outputs", action="store_true",
                    help="keep MindSpore's output and the copies (default: delete each once measured, to save space)")
    ap.add_argument("--mindspore-python", default=os.environ.get("ZCKPT_MS_PYTHON"))
    ap.add_argument("--json", action="store_true", help="print the run as JSON instead of a table")
    ap.add_argument("--json-out", type=Path, default=None, help="also save the run as JSON")
    ap.add_argument("--render", type=Path, default=None, help="print the table of a saved JSON run and exit")
    ap.add_argument("--dask-reader", action="store_true", help="also time export with the dask.array reader")
    ap.add_argument("--no-serial", action="store_true",
                    help="skip the 1-worker phases without overlap (one thread per task, --no-overlap)")
    a = ap.parse_args()
    if a.render is not None:
        render(json.loads(a.render.read_text(encoding="utf-8")))
        return
    size = int(a.size_gib * GiB)
    a.work.mkdir(parents=True, exist_ok=True)
    src, src_strategy, dst_strategy = prepare(a.work, size, a.src_ranks, a.dst_ranks, not a.no_opt_parallel, a.dtype,
                                                a.dst_model_parallel)
    src_bytes = _tree_bytes(src)
    logical = sum(t.nbytes for t in transformer_like(size, device_num=a.src_ranks, weight_type=a.dtype))
    runs = a.scratch if a.scratch is not None else a.work / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir(parents=True)
    warm = int(a.prewarm_gib * GiB)

    def run_phase(python: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        if warm:  # before every phase, so that none pays for cold memory more than another
            prewarm(runs, warm)
        reported = _reported_kib()
        result = _run_phase(python, *args, env=env)
        if reported is not None:
            result["host_reported_bytes"] = ((_reported_kib() or 0) - reported) * 1024
        return result

    env = phase_env()
    rows: list[dict[str, Any]] = []

    def measure(label: str, python: str, args: list[str], out: Path, moved: int | None,
                penv: dict[str, str] | None = None, keep: bool = False) -> None:
        """Run a phase ``--repeat`` times (its output removed before each run) and keep the
        median run; peak RSS is the largest of all runs."""
        results = []
        for _ in range(a.repeat):
            shutil.rmtree(out, ignore_errors=True)
            results.append(run_phase(python, *args, env=penv if penv is not None else env))
        good = sorted((r for r in results if "error" not in r), key=lambda r: float(r["seconds"]))
        if not good:
            result = {**results[0], "label": label, "bytes_out": 0, "bytes_moved": 0}
        else:
            result = dict(good[(len(good) - 1) // 2])
            result["label"] = label
            result["runs_seconds"] = [float(r["seconds"]) for r in results if "error" not in r]
            result["max_rss_bytes"] = max(_peak(r) for r in good)
            result["bytes_out"] = _tree_bytes(out) if out.exists() else 0
            result["bytes_moved"] = moved if moved is not None else result["bytes_out"]
        rows.append(result)
        if not keep and not a.keep_outputs:
            shutil.rmtree(out, ignore_errors=True)

    if a.mindspore_python:
        measure("MindSpore transform_checkpoints", a.mindspore_python,
                ["mindspore", str(src), str(runs / "ms"), str(src_strategy), str(dst_strategy)], runs / "ms",
                src_bytes, penv={**os.environ, "GLOG_v": "3"})
    store = runs / "store.zarr"
    for workers in (2, 1):  # the 1-worker store is kept for the exports
        measure(f"zckpt ingest, {workers} worker(s)", sys.executable,
                ["ingest", str(src), str(src_strategy), str(store), str(workers)], store, src_bytes,
                keep=workers == 1)
    for workers in (1, 2):
        out = runs / f"dst-w{workers}"
        measure(f"zckpt export, {workers} worker(s)", sys.executable,
                ["export", str(store), str(dst_strategy), str(out), str(workers)], out, None, keep=workers == 1)
    measure("zckpt export, 2 worker(s), overlap", sys.executable,
            ["export", str(store), str(dst_strategy), str(runs / "dst-w2o"), "2", "--overlap"], runs / "dst-w2o", None)
    if not a.no_serial:
        measure("zckpt export, 1 worker(s), no overlap", sys.executable,
                ["export", str(store), str(dst_strategy), str(runs / "dst-serial"), "1", "--no-overlap"],
                runs / "dst-serial", None)
        measure("zckpt ingest, 1 worker(s), no overlap", sys.executable,
                ["ingest", str(src), str(src_strategy), str(runs / "store-serial"), "1", "--no-overlap"],
                runs / "store-serial", src_bytes)
    for workers in (1, 2):
        out = runs / f"direct-w{workers}"
        measure(f"zckpt transform (direct), {workers} worker(s)", sys.executable,
                ["transform", str(src), str(src_strategy), str(dst_strategy), str(out), str(workers)], out, src_bytes)
    if a.dask_reader:
        measure("zckpt export, dask.array reader", sys.executable,
                ["export", str(store), str(dst_strategy), str(runs / "dst-dask"), "1", "dask"], runs / "dst-dask",
                None)
    exported = _tree_bytes(runs / "dst-w1")
    measure("cp -r of the export output", sys.executable, ["copy", str(runs / "dst-w1"), str(runs / "copy")],
            runs / "copy", exported)
    measure("cp of the export output, 2 at once", sys.executable, ["copy2", str(runs / "dst-w1"), str(runs / "copy2")],
            runs / "copy2", exported)
    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "scratch": str(runs)},
        "model": {"logical_bytes": logical, "source_bytes": src_bytes, "src_ranks": a.src_ranks,
                  "dst_ranks": a.dst_ranks, "opt_parallel": not a.no_opt_parallel, "dtype": a.dtype,
                  "dst_model_parallel": a.dst_model_parallel},
        "phases": rows,
    }
    if a.json_out is not None:
        a.json_out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        render(report)


def render(report: dict[str, Any]) -> None:
    """Print a run's table and ratios (also for a saved run: ``--render FILE``)."""
    model, rows = report["model"], report["phases"]
    print(f"model: {model['logical_bytes'] / GiB:.2f} GiB {model['dtype']} "
          f"({model['source_bytes'] / GiB:.2f} GiB of source shards incl. replicas), "
          f"{model['src_ranks']} -> {model['dst_ranks']} ranks (destination tensor parallel "
          f"{model.get('dst_model_parallel', '?')}), optimizer parallel on destination: {model['opt_parallel']}; "
          f"{report['machine']['cpus']} cpus")
    print(f"| {'phase':<36} | {'wall s':>7} | {'all runs s':<20} | {'MiB/s':>7} | {'peak RSS MiB':>12} | "
          f"{'read MiB':>9} | {'written MiB':>11} | {'read amp':>8} | {'to host MiB':>11} |")
    print(f"|{'-' * 38}|{'-' * 9}|{'-' * 22}|{'-' * 9}|{'-' * 14}|{'-' * 11}|{'-' * 13}|{'-' * 10}|{'-' * 13}|")
    for r in rows:
        if "error" in r:
            print(f"| {r['label']:<36} | error: {r['error']}")
            continue
        out = r["bytes_out"] or 1
        runs = " ".join(f"{x:.2f}" for x in r.get("runs_seconds", [r["seconds"]]))
        host = r.get("host_reported_bytes")
        rate = r["bytes_moved"] / MiB / r["seconds"]
        print(f"| {r['label']:<36} | {r['seconds']:>7.2f} | {runs:<20} | {rate:>7.1f} | {_peak(r) / MiB:>12.0f} | "
              f"{r['read_chars'] / MiB:>9.0f} | {r['bytes_out'] / MiB:>11.0f} | "
              f"{r['read_chars'] / out:>8.2f} | {'-' if host is None else f'{host / MiB:.0f}':>11} |")
    by = {r["label"]: r for r in rows if "error" not in r}
    ms_r = by.get("MindSpore transform_checkpoints")
    ing = {w: by.get(f"zckpt ingest, {w} worker(s)") or by.get("zckpt ingest") for w in (1, 2)}
    exp = {w: by.get(f"zckpt export, {w} worker(s)") for w in (1, 2)}
    cp = next((r for label, r in by.items() if label.startswith("cp -r")), None)
    cp2 = by.get("cp of the export output, 2 at once")
    direct = {w: by.get(f"zckpt transform (direct), {w} worker(s)") for w in (1, 2)}
    for w in (1, 2):
        i, e, t = ing[w], exp[w], direct[w]
        if ms_r and i and e:
            print(f"zckpt ingest+export ({w} worker(s)) / MindSpore wall time = "
                  f"{(i['seconds'] + e['seconds']) / ms_r['seconds']:.3f}")
        if ms_r and t:
            print(f"zckpt transform, direct ({w} worker(s)) / MindSpore wall time = "
                  f"{t['seconds'] / ms_r['seconds']:.3f}")
        if i and e and t:
            print(f"zckpt transform, direct ({w} worker(s)) / ingest+export = "
                  f"{t['seconds'] / (i['seconds'] + e['seconds']):.2f}")
    if exp[1] and cp:
        print(f"zckpt export / cp of its output = {exp[1]['seconds'] / cp['seconds']:.2f}")
    if cp and cp2:
        print(f"speed-up of 2 cp processes over 1 (the machine's bound for 2 workers) = "
              f"{cp['seconds'] / cp2['seconds']:.2f}")
    if exp[1] and exp[2] and cp2:
        print(f"zckpt export / 2 cp processes: 1 worker {exp[1]['seconds'] / cp2['seconds']:.2f}, "
              f"2 workers {exp[2]['seconds'] / cp2['seconds']:.2f}")
    forced = by.get("zckpt export, 2 worker(s), overlap")
    if forced and exp[2]:
        print(f"export with 2 workers, auto overlap (off: no core to spare) over forced overlap = "
              f"{forced['seconds'] / exp[2]['seconds']:.2f}")
    serial = {"ingest": by.get("zckpt ingest, 1 worker(s), no overlap"),
              "export": by.get("zckpt export, 1 worker(s), no overlap")}
    for what, d in (("ingest", ing), ("export", exp)):
        if d[1] and d[2] and d[1] is not d[2]:
            print(f"{what} speed-up with 2 workers = {d[1]['seconds'] / d[2]['seconds']:.2f}")
        one = serial[what]
        if one and d[1]:
            print(f"{what} speed-up of 1 worker with overlap (2 threads) over 1 thread (--no-overlap) = "
                  f"{one['seconds'] / d[1]['seconds']:.2f}")
        if one and d[2]:
            print(f"{what} speed-up of 2 workers over 1 thread (--no-overlap) = {one['seconds'] / d[2]['seconds']:.2f}")


if __name__ == "__main__":
    main()
