"""Benchmark at the shape of real jobs: hundreds of source ranks, pipeline x tensor x data parallel.

Generates a LLaMA-like job (bench/jobs_model.py: bf16 weights, or fp32 with ``--dtype fp32``; fp32
Adam moments; scalars) as MindSpore writes it, per-rank ``.ckpt`` files and pipeline strategy files,
then times, phase by phase, each in its own process (bench/phase.py) and ending with ``sync``:

* ``cp -r`` of the source shards (the yardstick every ratio is taken against),
* ``zckpt ingest`` (the store of the last run is kept for the exports),
* ``zckpt export`` to every destination,
* ``zckpt transform`` (the direct path) to every destination, when the CLI has that command,
* MindSpore 2.10 ``transform_checkpoints`` when ``--mindspore-python`` / $ZCKPT_MS_PYTHON is given,
* with ``--cp-output``, ``cp -r`` of each destination's output tree: where a destination writes more
  than the source holds (replicas), a copy of the bytes written is the fair yardstick, not the source's.

Shapes (``--shape``): ``512`` = pp 4 x tp 8 x dp 16 -> tp 8 x dp 2 and 1 rank; ``256`` =
pp 4 x tp 8 x dp 8 -> the same; ``8`` = tp 4 x dp 2 -> tp 2 x dp 2 (the shape zckpt was tuned
on); or any ``--src pp2xtp2xdp2 --dst tp2xdp2,1``. The optimizer shards over dp on both sides.

Cold cache is the headline: before every cold run the page cache is dropped (``sync; echo 3 >
/proc/sys/vm/drop_caches``, root only; when that is refused the figures are labelled warm). Warm
runs follow, labelled apart. Every phase runs ``--repeat`` times per cache state; the median is
reported. Generated jobs are reused between invocations (``WORK/job-*``); outputs are deleted.

    python bench/bench_jobs.py --shape 512 --size-gib 2 --work /var/tmp/zb --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib import GiB, MiB, drop_caches, machine, peak, phase_env, run_phase, tree_bytes, tree_files
from jobs_model import (
    ModelDims,
    Parallel,
    box_value,
    data_bytes,
    model_bytes,
    size_model,
    width_unit,
    write_job,
    write_strategy,
)

from zckpt.core.layout import Box
from zckpt.formats.ckpt import CkptReader

PRESETS = {
    "512": ("pp4xtp8xdp16", "tp8xdp2,1"),
    "256": ("pp4xtp8xdp8", "tp8xdp2,1"),
    "8": ("tp4xdp2", "tp2xdp2"),
}
PHASES = ("cp", "ingest", "export", "transform", "mindspore")
DTYPES = {"bf16": "BFloat16", "fp32": "Float32"}
"""``--dtype``: the weights' MindSpore type (the moments are fp32 either way)."""
DTYPES_INV = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Job:
    """A generated source job and the destination strategies, on disk."""

    root: Path
    src: Path
    src_strategy: Path | None
    dims: ModelDims
    par: Parallel
    dsts: tuple[tuple[Parallel, Path | None], ...]


def job_dir(work: Path, src: Parallel, dims: ModelDims, optimizer: str) -> Path:
    """Where the generated source job of this shape and model lives below ``work`` (reused by every run that
    asks for the same one)."""
    tag = f"{src.pp}x{src.tp}x{src.dp}{'' if src.opt else 'n'}-h{dims.hidden}-l{dims.layers}-{optimizer}"
    tag += "" if dims.weight_type == "BFloat16" else f"-{DTYPES_INV[dims.weight_type]}"
    return work / f"job-{tag}"


def prepare(work: Path, size: int, src: Parallel, dsts: list[Parallel], optimizer: str, gen_workers: int,
            weight_type: str = "BFloat16") -> Job:
    """Generate the source job once (reused while ``WORK/job-*/ready`` exists) and the destination strategies."""
    dims = size_model(size, width_unit([src, *dsts]), src.pp, weight_type)
    root = job_dir(work, src, dims, optimizer)
    ready = root / "ready"
    if not ready.is_file():
        shutil.rmtree(root, ignore_errors=True)
        t0 = time.perf_counter()
        write_job(root / "src", dims, src, optimizer=optimizer, workers=gen_workers)
        print(f"generated {src} in {time.perf_counter() - t0:.1f} s: {root / 'src'}", file=sys.stderr)
        ready.write_text("ok")
    if src.unsharded:
        strategy = None
    elif src.pp > 1:
        strategy = root / "src" / "strategy_merged.ckpt"
    else:
        strategy = root / "src" / "strategy.ckpt"
    out = tuple((d, write_strategy(root / f"dst-{d.tp}x{d.dp}{'' if d.opt else 'n'}.ckpt", dims, d,
                                   optimizer=optimizer)) for d in dsts)
    return Job(root, root / "src", strategy, dims, src, out)


def has_transform_command() -> bool:
    """Whether this checkout's CLI has ``zckpt transform`` (the direct path)."""
    proc = subprocess.run([sys.executable, "-m", "zckpt.cli", "transform", "--help"], capture_output=True,
                          env=phase_env(), check=False)
    return proc.returncode == 0


def check_unsharded(out: Path, job: Job) -> int:
    """Compare a one-rank export with the generator's values, tensor by tensor; the count checked."""
    files = sorted(out.glob("rank_0/*.ckpt"))
    if len(files) != 1:
        raise SystemExit(f"check: expected one file under {out}/rank_0, found {len(files)}")
    from jobs_model import scalars, tensors

    want = [t for s in tensors(job.dims, Parallel()) for t in s] + scalars()
    with CkptReader(files[0]) as r:
        for t in want:
            got = r.array(t.name)
            exp = box_value(t.name, t.shape, t.ms_type, Box.full(t.shape))
            if got.shape != exp.shape or got.tobytes() != exp.tobytes():
                raise SystemExit(f"check: {t.name} in {files[0]} differs from the generated value")
        extra = set(r.entries) - {t.name for t in want}
        if extra:
            raise SystemExit(f"check: unexpected entries in {files[0]}: {sorted(extra)[:5]}")
    return len(want)


def _median_run(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    good = sorted((r for r in results if "error" not in r), key=lambda r: float(r["seconds"]))
    return good[(len(good) - 1) // 2] if good else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0, help="model size, parameters and moments (1-16)")
    ap.add_argument("--shape", choices=sorted(PRESETS), default="512", help="source and destination preset")
    ap.add_argument("--src", help="source shape instead of the preset's, e.g. pp4xtp8xdp16 (':noopt' for no "
                                  "optimizer parallel)")
    ap.add_argument("--dst", help="destination shapes instead of the preset's, comma separated, e.g. tp8xdp2,1")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="type of the weights (moments: fp32)")
    ap.add_argument("--optimizer", choices=["adamw", "adam"], default="adamw",
                    help="moment names: MindFormers' adam_m./adam_v. or MindSpore Adam's moment1./moment2.")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/zckpt-jobs"),
                    help="work directory on the local disk (not a tmpfs): jobs, store, outputs")
    ap.add_argument("--repeat", type=int, default=3, help="runs of every phase per cache state (median shown)")
    ap.add_argument("--cache", default="cold,warm", help="cache states to measure: cold, warm or both")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"subset of {','.join(PHASES)}")
    ap.add_argument("--workers", type=int, default=1, help="zckpt --workers of every zckpt phase")
    ap.add_argument("--gen-workers", type=int, default=os.cpu_count() or 1, help="processes writing the source")
    ap.add_argument("--mindspore-python", default=os.environ.get("ZCKPT_MS_PYTHON"))
    ap.add_argument("--skip-mindspore", action="store_true")
    ap.add_argument("--mindspore-timeout", type=float, default=1800.0, help="seconds before a MindSpore run is "
                                                                           "killed (reported as such)")
    ap.add_argument("--check", action="store_true", help="compare the one-rank outputs (zckpt's and MindSpore's) "
                                                         "with the generated values")
    ap.add_argument("--cp-output", action="store_true", help="also time cp -r of each destination's output tree "
                                                             "(the yardstick where a job writes more than it reads)")
    ap.add_argument("--json-out", type=Path, help="also save the run as JSON")
    ap.add_argument("--render", type=Path, help="print the table of a saved JSON run and exit")
    ap.add_argument("--keep", action="store_true", help="keep the store and the outputs (the generated job is "
                                                        "always kept for the next run, unless --clean)")
    ap.add_argument("--clean", action="store_true", help="delete the generated job at the end")
    a = ap.parse_args()
    if a.render is not None:
        render(json.loads(a.render.read_text(encoding="utf-8")))
        return
    src = Parallel.parse(a.src or PRESETS[a.shape][0])
    dsts = [Parallel.parse(d) for d in (a.dst or PRESETS[a.shape][1]).split(",")]
    phases = [p.strip() for p in a.phases.split(",") if p.strip()]
    caches = [c.strip() for c in a.cache.split(",") if c.strip()]
    if set(phases) - set(PHASES) or set(caches) - {"cold", "warm"} or a.repeat < 1:
        raise SystemExit("bad --phases, --cache or --repeat")
    a.work.mkdir(parents=True, exist_ok=True)
    job = prepare(a.work, int(a.size_gib * GiB), src, dsts, a.optimizer, a.gen_workers, DTYPES[a.dtype])
    src_bytes = tree_bytes(job.src)
    src_files = sum(1 for _ in job.src.glob("rank_*/*.ckpt"))
    cold_ok = drop_caches() if "cold" in caches else False
    notes: list[str] = []
    if "cold" in caches and not cold_ok:
        notes.append("/proc/sys/vm/drop_caches is not writable (not root): the 'cold' runs below are WARM")
    if "transform" in phases and not has_transform_command():
        notes.append("this zckpt has no `transform` command: the direct path was skipped")
        phases.remove("transform")
    ms_python = None if a.skip_mindspore else (a.mindspore_python or None)
    if "mindspore" in phases and ms_python is None:
        notes.append("MindSpore skipped (no --mindspore-python / ZCKPT_MS_PYTHON, or --skip-mindspore)")
        phases.remove("mindspore")
    for n in notes:
        print(f"note: {n}", file=sys.stderr)

    runs = a.work / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir(parents=True)
    env = phase_env()
    ms_env = {**os.environ, "GLOG_v": "3"}
    rows: list[dict[str, Any]] = []
    checked = 0

    def measure(label: str, phase: str, python: str, args: list[str], out: Path, penv: dict[str, str],
                timeout: float | None = None, keep: bool = False, extra: dict[str, Any] | None = None) -> None:
        for cache in caches:
            results = []
            for _ in range(a.repeat):
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                dropped = drop_caches() if cache == "cold" else False
                r = run_phase(python, *args, "--sync", env=penv, timeout=timeout)
                r["cache_dropped"] = dropped
                results.append(r)
                print(f"  {label} [{cache}]: " + (f"{r['seconds']:.2f} s" if "error" not in r else r["error"]),
                      file=sys.stderr, flush=True)
                if "error" in r and "time limit" in r["error"]:
                    break
            med = _median_run(results)
            row: dict[str, Any] = {"label": label, "phase": phase, "cache": cache if cache == "warm" or cold_ok
                                   else "warm (drop refused)", **(extra or {})}
            if med is None:
                row["error"] = results[0].get("error", "failed")
            else:
                files, dirs = tree_files(out) if out.exists() else (0, 0)
                row.update({
                    "seconds": float(med["seconds"]),
                    "import_seconds": float(med.get("import_seconds", 0.0)),
                    "cpu_seconds": float(med.get("cpu_seconds", 0.0)),
                    "runs_seconds": [float(r["seconds"]) for r in results if "error" not in r],
                    "peak_rss_bytes": max(peak(r) for r in results if "error" not in r),
                    "read_bytes": int(med["read_chars"]),
                    "disk_read_bytes": int(med.get("disk_read_bytes", 0)),
                    "disk_write_bytes": int(med.get("disk_write_bytes", 0)),
                    "out_bytes": tree_bytes(out) if out.exists() else 0,
                    "out_files": files, "out_dirs": dirs,
                })
            rows.append(row)
        if not (keep or a.keep):
            shutil.rmtree(out, ignore_errors=True)

    strat = str(job.src_strategy) if job.src_strategy else ""
    if "cp" in phases:
        measure("cp -r of the source shards", "cp", sys.executable, ["copy", str(job.src), str(runs / "cp")],
                runs / "cp", env)
    store = runs / "store.zarr"
    if "ingest" in phases:
        measure("zckpt ingest", "ingest", sys.executable,
                ["ingest", str(job.src), strat, str(store), str(a.workers)], store, env, keep=True)
    for d, dpath in job.dsts:
        dstrat = str(dpath) if dpath else ""
        tag = {"dst": d.spec}
        copied = not a.cp_output  # the output tree of this destination was copied (or need not be)

        def copy_output(out: Path, d: Parallel = d, tag: dict[str, Any] = tag) -> bool:
            if out.exists():
                measure(f"cp -r of the output -> {d}", "cp-out", sys.executable,
                        ["copy", str(out), str(runs / "cp-out")], runs / "cp-out", env, extra=tag)
            return out.exists()

        if "export" in phases and store.exists():
            out = runs / f"export-{d.ranks}"
            measure(f"zckpt export -> {d}", "export", sys.executable,
                    ["export", str(store), dstrat, str(out), str(a.workers)], out, env, keep=a.check or not copied,
                    extra=tag)
            if a.check and d.unsharded and out.exists():
                checked += check_unsharded(out, job)
            copied = copied or copy_output(out)
            shutil.rmtree(out, ignore_errors=True)
        if "transform" in phases:
            out = runs / f"transform-{d.ranks}"
            cmd = ["cli", "transform", str(job.src), "--out", str(out), "--quiet"]
            cmd += ["--src-strategy", strat] if strat else []
            cmd += ["--dst-strategy", dstrat] if dstrat else []
            cmd += ["--workers", str(a.workers)] if a.workers != 1 else []
            measure(f"zckpt transform -> {d}", "transform", sys.executable, cmd, out, env,
                    keep=a.check or not copied, extra=tag)
            if a.check and d.unsharded and out.exists():
                checked += check_unsharded(out, job)
            copied = copied or copy_output(out)
            shutil.rmtree(out, ignore_errors=True)
        if "mindspore" in phases and ms_python:
            out = runs / f"ms-{d.ranks}"
            measure(f"MindSpore transform_checkpoints -> {d}", "mindspore", ms_python,
                    ["mindspore", str(job.src), str(out), strat, dstrat], out, ms_env, timeout=a.mindspore_timeout,
                    keep=a.check, extra=tag)
            if a.check and d.unsharded and out.exists():  # MindSpore itself agrees with the generated job
                checked += check_unsharded(out, job)
            shutil.rmtree(out, ignore_errors=True)
    store_files = tree_files(store) if store.exists() else (0, 0)
    if not a.keep:
        shutil.rmtree(runs, ignore_errors=True)
    if a.clean:
        shutil.rmtree(job.root, ignore_errors=True)
    report = {
        "command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
        "machine": machine(a.work),
        "cache_drop": ("sync; echo 3 > /proc/sys/vm/drop_caches before every cold run" if cold_ok
                       else "warm runs only (--cache warm)" if "cold" not in caches
                       else "not possible here (not root): every figure is warm"),
        "job": {"src": str(job.par), "dsts": [str(d) for d, _ in job.dsts], "dims": vars(job.dims),
                "optimizer": a.optimizer, "model_bytes": model_bytes(job.dims, a.optimizer),
                "src_bytes": src_bytes, "src_files": src_files, "src_spec": job.par.spec,
                "dst_specs": [d.spec for d, _ in job.dsts],
                "src_data_bytes": data_bytes(job.dims, job.par, a.optimizer),
                "needed_bytes": {d.spec: data_bytes(job.dims, d, a.optimizer, distinct=True) for d, _ in job.dsts},
                "dst_data_bytes": {d.spec: data_bytes(job.dims, d, a.optimizer) for d, _ in job.dsts},
                "store_files": store_files[0], "store_dirs": store_files[1]},
        "notes": notes, "checked_tensors": checked, "repeat": a.repeat, "phases": rows,
    }
    if a.json_out is not None:
        a.json_out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    render(report)


def render(report: dict[str, Any]) -> None:
    """Print a run as Markdown for bench/RESULTS.md (also for a saved run: ``--render FILE``)."""
    m, job = report["machine"], report["job"]
    dims = job["dims"]
    print(f"`{report['command']}`\n")
    print(f"{m['date']}; {m['cpus']} cpus, {m['ram_bytes'] / GiB:.0f} GiB RAM, Linux {m['kernel']}, "
          f"Python {m['python']}; disk {m['disk']}. Cache: {report['cache_drop']}.\n")
    print(f"Job: {job['src']} -> {' and '.join(job['dsts'])}. Model {job['model_bytes'] / GiB:.2f} GiB "
          f"(hidden {dims['hidden']}, {dims['layers']} layers, ffn {dims['ffn']}, vocab {dims['vocab']}; "
          f"{DTYPES_INV.get(dims.get('weight_type', 'BFloat16'), '?')} weights, "
          f"fp32 {job['optimizer']} moments); {job['src_files']} source files, {job['src_bytes'] / GiB:.2f} GiB; "
          f"store: {job['store_files']} files in {job['store_dirs']} directories. "
          f"Median of {report['repeat']} runs, each ending with `sync`.\n")
    for n in report["notes"]:
        print(f"Note: {n}\n")
    if report.get("checked_tensors"):
        print(f"Checked: {report['checked_tensors']} tensors of the one-rank outputs equal the generated values.\n")
    cps = {r["cache"]: r for r in report["phases"] if r["phase"] == "cp" and "error" not in r}
    print("| phase | cache | wall s | runs s | x cp | CPU s | imports s | peak RSS MiB | read MiB | disk read MiB "
          "| disk written MiB | output MiB | output files |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in report["phases"]:
        if "error" in r:
            print(f"| {r['label']} | {r['cache']} | error: {r['error']} | | | | | | | | | | |")
            continue
        cp = cps.get(r["cache"])
        ratio = f"{r['seconds'] / cp['seconds']:.2f}" if cp else "-"
        runs = " ".join(f"{x:.2f}" for x in r["runs_seconds"])
        print(f"| {r['label']} | {r['cache']} | {r['seconds']:.2f} | {runs} | {ratio} | "
              f"{r.get('cpu_seconds', 0.0):.2f} | {r.get('import_seconds', 0.0):.2f} | "
              f"{r['peak_rss_bytes'] / MiB:.0f} | {r['read_bytes'] / MiB:.0f} | "
              f"{r['disk_read_bytes'] / MiB:.0f} | "
              f"{r['disk_write_bytes'] / MiB:.0f} | {r['out_bytes'] / MiB:.0f} | {r['out_files']} |")
    print("\nCPU s: user + system CPU time of the phase's process and the processes it waited for (cp, MindSpore; "
          "not Dask worker processes), little changed by other work on the machine, unlike wall time; "
          "imports s: the part of the wall time spent importing zckpt and its libraries (numpy, zarr, dask); "
          "read MiB: bytes the phase read as zckpt counts them (for cp, MindSpore and transform: rchar); "
          "disk read/written: block-layer bytes of /proc/self/io (with a cold cache, what came from the disk).")


if __name__ == "__main__":
    main()
