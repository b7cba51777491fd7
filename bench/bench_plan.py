"""Speed of ``zckpt plan`` on a large job: 4 096 ranks x 2 000 parameters (the target is under 2 s).

Writes synthetic strategy files (bench/jobs_model.py's LLaMA-like parameters and moments,
enough layers for ``--params`` entries) for a source of ``--src`` and a destination of
``--dst`` ranks, then times ``zckpt plan --src-strategy S --dst-strategy D`` (every
destination rank) in its own process, ``--repeat`` times, and prints the median.
``--profile FILE`` also saves a cProfile of one run in this process (``python -m pstats FILE``).

    python bench/bench_plan.py --src pp4xtp8xdp128 --dst tp8xdp512 --params 2000 --work /var/tmp/zb-plan
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import statistics
import sys
from pathlib import Path

from benchlib import machine, phase_env, run_phase
from jobs_model import ModelDims, Parallel, tensors, width_unit, write_strategy

from zckpt.formats.strategy import StrategyMap, encode_strategy
from zckpt.jobs.generate import write_pipeline_strategies


def dims_for(params: int, unit: int, pp: int) -> ModelDims:
    """A model with about ``params`` strategy entries (6 parameters a layer, each with 2 moments)."""
    layers = max(pp, round((params / 3 - 4) / 6 / pp) * pp)
    return ModelDims(hidden=4 * unit, layers=layers, ffn=8 * unit, vocab=32 * unit)


def write_src_strategy(root: Path, dims: ModelDims, par: Parallel) -> Path:
    """The source's strategy: merged pipeline file (and per-rank files) or one file."""
    stages = tensors(dims, par)
    if par.pp > 1:
        return write_pipeline_strategies(root, stages, stage_device_num=par.stage_devices)[1]
    path = root / "strategy.ckpt"
    root.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_strategy(StrategyMap(layouts={t.name: {0: t.layout} for s in stages for t in s
                                                          if t.layout is not None})))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default="pp4xtp8xdp128", help="source shape (4 096 ranks by default)")
    ap.add_argument("--dst", default="tp8xdp512", help="destination shape (4 096 ranks by default)")
    ap.add_argument("--params", type=int, default=2000, help="strategy entries (parameters and moments)")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/zckpt-plan"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", type=Path, help="also save a cProfile of one in-process run here")
    a = ap.parse_args()
    src, dst = Parallel.parse(a.src), Parallel.parse(a.dst)
    dims = dims_for(a.params, width_unit([src, dst]), src.pp)
    s_path = write_src_strategy(a.work / "src", dims, src)
    d_path = write_strategy(a.work / "dst.ckpt", dims, dst)
    assert d_path is not None
    entries = sum(len(s) for s in tensors(dims, src))
    args = ["cli", "plan", "--src-strategy", str(s_path), "--dst-strategy", str(d_path)]
    runs = []
    for _ in range(a.repeat):
        r = run_phase(sys.executable, *args, env=phase_env())
        if "error" in r:
            raise SystemExit(f"zckpt plan failed: {r['error']}")
        runs.append(float(r["seconds"]))
        print(f"  zckpt plan: {r['seconds']:.2f} s (imports {r['import_seconds']:.2f} s)", file=sys.stderr)
    m = machine(a.work)
    print(f"{m['date']}; {m['cpus']} cpus, Linux {m['kernel']}, Python {m['python']}")
    print(f"`zckpt plan`, {src} -> {dst}, {entries} strategy entries: median {statistics.median(runs):.2f} s "
          f"(runs {' '.join(f'{x:.2f}' for x in runs)}; target < 2 s)")
    if a.profile is not None:
        from zckpt.cli.main import main as cli_main

        prof = cProfile.Profile()
        with contextlib.redirect_stdout(io.StringIO()):
            prof.runcall(cli_main, args[1:])
        prof.dump_stats(str(a.profile))
        print(f"profile saved: python -m pstats {a.profile}")


if __name__ == "__main__":
    main()
