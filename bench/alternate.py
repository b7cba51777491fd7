"""Attribute a change: the same zckpt command run from two or more trees in turn, cold.

A matrix pass cannot tell a change of zckpt from a change of the machine: between two passes the
yardstick ``cp -r && sync`` of one case moved by up to 25%, and cells whose code had not changed
moved both ways (bench/RESULTS.md). Runs of the trees taken in turn (A B A B ...), each after
the page cache is dropped and ending with ``sync``, share whatever the machine does meanwhile;
a difference that holds pair after pair is the code's. Every tree is a checkout (``git worktree
add --detach W COMMIT``) compiled to bytecode first, as an installed package is, and imported by
``PYTHONPATH`` (``python -P``: not the one of the current directory); ``{out}`` in the command is
a fresh output path, removed before and after each run.

    python bench/alternate.py --tree old=W1 --tree new=W2 --pairs 4 --out /var/tmp/zo -- \\
        transform SRC --src-strategy S --dst-strategy D --out {out}
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib import drop_caches  # noqa: E402


@dataclass(frozen=True)
class Tree:
    name: str
    path: Path


@dataclass(frozen=True)
class Run:
    tree: str
    seconds: float
    ok: bool


def parse_tree(text: str) -> Tree:
    """``NAME=PATH`` of a checkout."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return Tree(name, Path(path))


def order(trees: list[Tree], pairs: int) -> list[Tree]:
    """The runs in turn, the first tree of each round alternating, so that neither tree always
    runs right after the other's write-back."""
    out: list[Tree] = []
    for i in range(pairs):
        out.extend(trees if i % 2 == 0 else trees[::-1])
    return out


def summary(runs: list[Run]) -> list[str]:
    """One line per tree: its runs in order, median, fastest and slowest (failed runs named)."""
    lines = []
    for name in dict.fromkeys(r.tree for r in runs):
        mine = [r for r in runs if r.tree == name]
        ok = [r.seconds for r in mine if r.ok]
        shown = " ".join(f"{r.seconds:.2f}" + ("" if r.ok else "!") for r in mine)
        stats = (f"median {statistics.median(ok):.2f} s, {min(ok):.2f}-{max(ok):.2f}" if ok else "every run failed")
        lines.append(f"{name}: {stats} ({shown})")
    return lines


def env_of(tree: Tree) -> dict[str, str]:
    """The tree's zckpt first on the import path, compiled once (see benchlib.phase_env)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree.path / "zckpt")], check=False, env=env,
                   capture_output=True)
    return {**env, "PYTHONPATH": str(tree.path)}


def run_once(tree: Tree, env: dict[str, str], args: list[str], out: Path, cold: bool) -> Run:
    shutil.rmtree(out, ignore_errors=True)
    if cold:
        drop_caches()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-P", "-m", "zckpt.cli", *[a.replace("{out}", str(out)) for a in args]],
                          env=env, capture_output=True, text=True, check=False)
    os.sync()
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        print(f"{tree.name}: {proc.stderr.strip()[-400:]}", file=sys.stderr)
    shutil.rmtree(out, ignore_errors=True)
    return Run(tree.name, seconds, proc.returncode == 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=parse_tree, action="append", required=True, help="NAME=PATH of a checkout")
    p.add_argument("--pairs", type=int, default=4, help="rounds: each tree runs this many times")
    p.add_argument("--out", type=Path, required=True, help="what {out} stands for (local disk, not a tmpfs)")
    p.add_argument("--warm", action="store_true", help="keep the page cache (labelled warm)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then zckpt's arguments, with {out}")
    a = p.parse_args(argv)
    args = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not args:
        p.error("give zckpt's arguments after --")
    envs = {t.name: env_of(t) for t in a.tree}
    cold = not a.warm and drop_caches()
    runs = []
    for tree in order(a.tree, a.pairs):
        run = run_once(tree, envs[tree.name], args, a.out, cold)
        runs.append(run)
        print(f"{run.tree}: {run.seconds:.2f} s{'' if run.ok else ' (failed)'}", flush=True)
    print(f"{'cold' if cold else 'warm'}, wall to the end of sync; zckpt {' '.join(args)}")
    print("\n".join(summary(runs)))
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
