"""The benchmark matrix of issue 27: every reshard shape class, one command, one table.

zckpt met its targets on the shapes bench_jobs.py was built around and missed them by 2-10x on
others. This module names the shapes that must be measured (``CASES``: the issue's table, tensor
parallel changes that re-cut both column- and row-parallel weights, scale-up to 512 and 1024
ranks, merge to one rank, row pieces of at most 512 bytes, a replicating destination, bf16 and
fp32; 2 GiB each, and one 16 GiB case per class), runs each as one ``bench_jobs.py`` invocation
(cold cache, median of ``--repeat``) into a results directory, and renders all of them as one
table with the issue's targets checked cell by cell. It measures; it does not generate jobs or
time phases itself (bench_jobs.py and phase.py do).

Resumable: a case whose ``RESULTS/NAME.json`` exists is skipped unless ``--force``; a generated
source job is kept under ``--work`` while a later selected case still uses it.

Yardsticks, per cell (a case x phase x destination):

* ``x cp``: wall time over the case's ``cp -r`` of the source shards + ``sync`` (same cache state).
* ``x cp out``: where the destination writes more than it reads (it holds replicas: its data bytes
  exceed the bytes it needs by over 1%), wall time over a measured ``cp -r`` + ``sync`` of that
  destination's own output tree (bench_jobs.py ``--cp-output``: the same files and bytes, written
  by the fastest tool there is). Scaling a source copy by bytes would be unsound: a copy's time
  follows the file count and the disk's write cost too. This is then the target's yardstick.
* ``needed``: bytes the destination needs read, each element once however many destination
  ranks hold it (jobs_model.data_bytes(..., distinct=True), counted from the layouts); for
  ingest (and cp), the data bytes of the source's files (what a copy reads, headers aside).

    python bench/bench_matrix.py --list
    python bench/bench_matrix.py --work /var/tmp/zckpt-jobs --results bench/matrix   # all small cases
    python bench/bench_matrix.py --size-class large --results bench/matrix
    python bench/bench_matrix.py --render bench/matrix
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench_jobs import DTYPES, job_dir
from benchlib import GiB, MiB, phase_env
from jobs_model import (
    MOMENT_NAMES,
    ModelDims,
    Parallel,
    data_bytes,
    layout_of,
    rank_boxes,
    size_model,
    tensors,
    width_unit,
)

from zckpt.core.layout import Box, all_boxes, resolve

HERE = Path(__file__).resolve().parent
TIME_TARGET, READ_TARGET, RSS_TARGET = 1.2, 1.1, GiB
WRITES_MORE = 1.01
"""A destination writes more than it reads when its data bytes exceed the bytes it needs by this
factor: replicas, not the per-rank scalars (some KiB over 1024 ranks)."""
TIMED = ("ingest", "export", "transform")


@dataclass(frozen=True)
class Case:
    """One bench_jobs.py run: a source shape, its destinations, a size and the weights' type."""

    name: str
    klass: str
    src: str
    dsts: str
    size_gib: float = 2.0
    dtype: str = "bf16"
    why: str = ""
    base: str = ""
    """For a 16 GiB case, the 2 GiB case of the same shape (peak RSS must stay flat between them)."""

    @property
    def size_class(self) -> str:
        return "large" if self.size_gib >= 16 else "small"


def _large(name: str, cases: Iterable[Case]) -> Case:
    """The 16 GiB run of a 2 GiB case."""
    c = next(c for c in cases if c.name == name)
    return Case(f"{name}-16g", c.klass, c.src, c.dsts, 16.0, c.dtype, f"{c.why}, at 16 GiB", base=name)


_SMALL = (
    Case("tuned-512", "tuned", "pp4xtp8xdp16", "tp8xdp2", why="the shape zckpt was tuned on (issue table row 1)"),
    Case("tp-512", "tp-change", "pp4xtp8xdp16", "tp4xdp4,tp16",
         why="tp 8 -> 4 and 16: column-parallel dim 0 and row-parallel dim 1 re-cut (row 2)"),
    Case("tp-up", "tp-change", "tp2xdp8", "tp8",
         why="tp 2 -> 8: column-parallel row bands merged in pairs, each row-parallel row split in 4 columns"),
    Case("tp-down", "tp-change", "tp8xdp2", "tp2xdp4",
         why="tp 8 -> 2: column-parallel row bands merged in pairs, row-parallel column bands merged by 4"),
    Case("dp-tp8", "dp-to-tp", "pp1xtp1xdp256", "tp8xdp2",
         why="data-parallel training -> tensor-parallel serving (row 3)"),
    Case("dp-tp16", "dp-to-tp", "pp1xtp1xdp256", "tp16", why="row-sharded -> 16 column bands (row 4)"),
    Case("up-512", "scale-up", "tp8xdp2", "tp8xdp64", why="scale-up to 512 ranks (row 5)"),
    Case("up-1024", "scale-up", "tp8xdp2", "tp8xdp128", why="scale-up to 1024 ranks"),
    Case("merge-1", "merge", "tp8xdp2", "1", why="merge to one file (row 6)"),
    Case("rows-512b", "small-rows", "tp32xdp8", "tp8xdp2",
         why="256 -> 16 in 2 x 8 blocks; row-parallel source rows <= 512 bytes"),
    Case("replicate", "replicate", "tp8xdp2", "tp8xdp2:noopt",
         why="optimizer split undone: each dp replica whole, writes 2x what it reads"),
    Case("dp-tp8-fp32", "dp-to-tp", "pp1xtp1xdp256", "tp8xdp2", dtype="fp32", why="dp-tp8 with fp32 weights"),
    Case("tp-up-fp32", "tp-change", "tp2xdp8", "tp8", dtype="fp32", why="tp-up with fp32 weights"),
    Case("up-512-fp32", "scale-up", "tp8xdp2", "tp8xdp64", dtype="fp32", why="up-512 with fp32 weights"),
    Case("rows-512b-fp32", "small-rows", "tp32xdp8", "tp8xdp2", dtype="fp32", why="rows-512b with fp32 weights"),
)
CASES: tuple[Case, ...] = (
    *_SMALL,
    *(_large(n, _SMALL) for n in ("tuned-512", "tp-512", "dp-tp16", "up-1024", "merge-1")),
    Case("rows-512b-16g", "small-rows", "tp64xdp4", "tp8xdp2", 16.0, base="rows-512b",
         why="256 -> 16 in 2 x 8 blocks at 16 GiB: tp 64 keeps row-parallel source rows <= 512 bytes"),
)
"""The matrix. At 16 GiB one case per class of the issue; small rows at 16 GiB take a finer source grid
(rows grow with the model). ``replicate`` has no 16 GiB case: its 32 GiB output and the output's
copy need about 96 GiB of disk."""


@dataclass(frozen=True)
class Shape:
    """What a case is on disk at a size: the model, the grids, and the facts --list shows."""

    dims: ModelDims
    src: Parallel
    dsts: tuple[Parallel, ...]
    src_bytes: int
    dst_bytes: tuple[int, ...]
    needed: tuple[int, ...]

    @property
    def writes_more(self) -> bool:
        return any(w > WRITES_MORE * n for w, n in zip(self.dst_bytes, self.needed, strict=True))

    def disk_bytes(self) -> int:
        """Peak disk use of the run: the source, and then its copy, or the store beside the largest output
        (and that output's copy when the output trees are copied). Headers aside."""
        out = max(self.dst_bytes) * (2 if self.writes_more else 1)
        return self.src_bytes + max(self.src_bytes, max(self.needed) + out)


def shape_of(case: Case, size_gib: float | None = None) -> Shape:
    """The case's model and grids as bench_jobs.py will generate them (at ``size_gib`` instead of its own)."""
    src = Parallel.parse(case.src)
    dsts = tuple(Parallel.parse(d) for d in case.dsts.split(","))
    gib = case.size_gib if size_gib is None else size_gib
    dims = size_model(int(gib * GiB), width_unit([src, *dsts]), src.pp, DTYPES[case.dtype])
    return Shape(dims, src, dsts, data_bytes(dims, src), tuple(data_bytes(dims, d) for d in dsts),
                 tuple(data_bytes(dims, d, distinct=True) for d in dsts))


def _cuts(kind: str, shape: tuple[int, ...], par: Parallel) -> list[set[int]]:
    boxes = [Box.full(shape)] if par.unsharded else list(all_boxes(resolve(layout_of(kind, par), shape)))
    return [{b.start[d] for b in boxes} for d in range(len(shape))]


def recut(s: Shape) -> str:
    """Per destination, the dimensions whose cuts change for column- and row-parallel weights
    (``col d0, row d1``): a tp change must re-cut both kinds."""
    out = []
    for d in s.dsts:
        parts = []
        for kind in ("col", "row"):
            shape = next(p[1] for p in s.dims.params() if p[3] == kind)
            a, b = _cuts(kind, shape, s.src), _cuts(kind, shape, d)
            dims = ",".join(f"d{i}" for i in range(len(shape)) if a[i] != b[i])
            parts.append(f"{kind} {dims or '-'}")
        out.append(" ".join(parts))
    return " / ".join(out)


def row_bytes(s: Shape) -> int:
    """The longest row of a row-parallel source shard (weights and moments), in bytes."""
    row = {p[0] for p in s.dims.params() if p[3] == "row"}
    most = 0
    for stage in tensors(s.dims, s.src):
        for t in stage:
            param = next((t.name[len(m):] for m in MOMENT_NAMES["adamw"] if t.name.startswith(m)), t.name)
            if param in row:
                width = max(b.shape[-1] for b in rank_boxes(t, s.src))
                most = max(most, width * t.nbytes // math.prod(t.shape))
    return most


def list_cases(results: Path) -> None:
    """The matrix as a table: what each case is, what its grids re-cut, its rows, its disk need, whether it is done."""
    print("| case | class | GiB | dtype | source | destinations | re-cut (col, row) | row-parallel source row B "
          "| writes more | disk GiB | done |")
    print("|---|---|---:|---|---|---|---|---:|---|---:|---|")
    for c in CASES:
        s = shape_of(c)
        done = "yes" if (results / f"{c.name}.json").is_file() else ""
        print(f"| {c.name} | {c.klass} | {c.size_gib:g} | {c.dtype} | {c.src} | {c.dsts} | {recut(s)} | "
              f"{row_bytes(s)} | {'yes' if s.writes_more else ''} | {s.disk_bytes() / GiB:.0f} | {done} |")


def select(only: str | None, size_class: str) -> list[Case]:
    """The cases to run, in the matrix's order: ``--only`` names (any size class), or a ``--size-class``."""
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = set(names) - {c.name for c in CASES}
        if unknown:
            raise SystemExit(f"unknown case(s) {sorted(unknown)}; see --list")
        return [c for c in CASES if c.name in names]
    return [c for c in CASES if size_class in ("all", c.size_class)]


def _commit() -> str:
    proc = subprocess.run(["git", "-C", str(HERE.parent), "describe", "--always", "--dirty"], capture_output=True,
                          text=True, check=False)
    return proc.stdout.strip() or "?"


def run_cases(cases: list[Case], a: argparse.Namespace) -> int:
    """Run every case not yet done; the number that failed."""
    a.results.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    shapes = {c.name: shape_of(c, a.size_gib) for c in cases}
    jobs = {c.name: job_dir(a.work, shapes[c.name].src, shapes[c.name].dims, "adamw") for c in cases}  # the default
    pending = [c for c in cases if a.force or not (a.results / f"{c.name}.json").is_file()]
    first = [jobs[c.name] for c in pending]
    pending.sort(key=lambda c: first.index(jobs[c.name]))  # stable: the cases of one source job together
    for c in cases:
        if c not in pending:
            print(f"{c.name}: done ({a.results / (c.name + '.json')}; --force to run again)", file=sys.stderr)
    failed = 0
    for i, c in enumerate(pending):
        s = shapes[c.name]
        generated = (jobs[c.name] / "ready").is_file()
        need = s.disk_bytes() - (s.src_bytes if generated else 0)
        free = shutil.disk_usage(a.work).free
        if need > free:
            print(f"{c.name}: skipped, needs {need / GiB:.1f} GiB on {a.work}, {free / GiB:.1f} GiB free",
                  file=sys.stderr)
            failed += 1
            continue
        last_use = all(jobs[p.name] != jobs[c.name] for p in pending[i + 1:])
        part = a.results / f"{c.name}.json.part"
        size = c.size_gib if a.size_gib is None else a.size_gib
        cmd = [sys.executable, str(HERE / "bench_jobs.py"), "--src", c.src, "--dst", c.dsts,
               "--size-gib", repr(size), "--dtype", c.dtype,
               "--work", str(a.work), "--repeat", str(a.repeat), "--cache", a.cache, "--phases", a.phases,
               "--workers", str(a.workers), "--gen-workers", str(a.gen_workers), "--json-out", str(part)]
        cmd += ["--cp-output"] if s.writes_more else []
        cmd += ["--clean"] if last_use and not a.keep_jobs else []
        print(f"{c.name}: {c.src} -> {c.dsts}, {c.dtype}, {size:g} GiB", file=sys.stderr, flush=True)
        with open(a.results / f"{c.name}.md", "w", encoding="utf-8") as table:
            proc = subprocess.run(cmd, stdout=table, env=phase_env(), check=False)
        if proc.returncode != 0 or not part.is_file():
            print(f"{c.name}: bench_jobs.py exited with {proc.returncode}", file=sys.stderr)
            failed += 1
            continue
        report = json.loads(part.read_text(encoding="utf-8"))
        report["case"] = {**asdict(c), "size_gib": size}
        errors = [r["label"] for r in report["phases"] if "error" in r]
        if errors:
            print(f"{c.name}: failed phases (kept in the table; --force to run again): {errors}", file=sys.stderr)
        report["commit"] = _commit()
        part.write_text(json.dumps(report, indent=1), encoding="utf-8")
        part.replace(a.results / f"{c.name}.json")
    return failed


def _mib(n: float) -> str:
    return f"{n / MiB:.0f}" if n >= 10 * MiB else f"{n / MiB:.1f}"


@dataclass
class Cell:
    """One row of the table: a phase of a case (to one destination)."""

    case: str
    phase: str
    row: dict[str, Any]
    needed: int
    x_cp: float | None
    x_out: float | None

    @property
    def name(self) -> str:
        dst = f" -> {self.row['dst']}" if self.row.get("dst") else ""
        return f"{self.case} {self.phase}{dst} [{self.row['cache']}]"

    @property
    def x_copy(self) -> float | None:
        """The target's ratio: against the copy of the output where the phase writes more than it reads."""
        return self.x_out if self.x_out is not None else self.x_cp


def cells(report: dict[str, Any]) -> list[Cell]:
    """The rows of one case, each with its needed bytes and its ratios to the copies."""
    job, name = report["job"], report["case"]["name"]
    rows = [r for r in report["phases"] if "error" not in r]
    cps = {r["cache"]: r["seconds"] for r in rows if r["phase"] == "cp"}
    outs = {(r["cache"], r.get("dst")): r["seconds"] for r in rows if r["phase"] == "cp-out"}
    out: list[Cell] = []
    for r in report["phases"]:
        dst = r.get("dst")
        needed = (job["src_data_bytes"] if dst is None else job["dst_data_bytes"][dst] if r["phase"] == "cp-out"
                  else job["needed_bytes"][dst])
        if "error" in r:
            out.append(Cell(name, r["phase"], r, needed, None, None))
            continue
        cp = cps.get(r["cache"])
        x_cp = r["seconds"] / cp if cp else None
        more = dst is not None and job["dst_data_bytes"][dst] > WRITES_MORE * job["needed_bytes"][dst]
        cp_out = outs.get((r["cache"], dst)) if more and r["phase"] in ("export", "transform") else None
        out.append(Cell(name, r["phase"], r, needed, x_cp, r["seconds"] / cp_out if cp_out else None))
    return out


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def load(results: Path) -> list[dict[str, Any]]:
    """Saved cases in the matrix's order, then any others by name."""
    order = {c.name: i for i, c in enumerate(CASES)}
    reports = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(results.glob("*.json"))]
    return sorted(reports, key=lambda r: (order.get(r["case"]["name"], len(order)), r["case"]["name"]))


def render(results: Path) -> None:
    """One Markdown table over every saved case, then the issue's targets cell by cell."""
    reports = load(results)
    if not reports:
        raise SystemExit(f"no case results (*.json) in {results}")
    first = reports[0]
    m = first["machine"]
    cold = any(r["cache"] == "cold" for rep in reports for r in rep["phases"])
    print(f"{len(reports)} case(s) from {results}; {m['date']}; {m['cpus']} cpus, {m['ram_bytes'] / GiB:.0f} GiB "
          f"RAM, disk {m['disk']}; code {first.get('commit', '?')}. Cache: "
          f"{first['cache_drop'] if cold else 'warm (as asked)'}. Median of {first['repeat']} runs, each ending "
          "with `sync`.\n")
    print("| case | phase | cache | wall s | x cp | x cp out | CPU s | read MiB | needed MiB | read / needed "
          "| disk read MiB | disk written MiB | peak RSS MiB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    every: list[Cell] = []
    for rep in reports:
        c = rep["case"]
        for cell in cells(rep):
            r = cell.row
            phase = cell.phase + (f" -> {r['dst']}" if r.get("dst") else "")
            head = f"| {c['name']} | {phase} | {r['cache']} |"
            if "error" in r:
                print(f"{head} error: {r['error']} | | | | | | | | | |")
                continue
            every.append(cell)
            print(f"{head} {r['seconds']:.2f} | {_ratio(cell.x_cp)} | {_ratio(cell.x_out)} | "
                  f"{r['cpu_seconds']:.2f} | {_mib(r['read_bytes'])} | {_mib(cell.needed)} | "
                  f"{r['read_bytes'] / cell.needed:.2f} | {_mib(r['disk_read_bytes'])} | "
                  f"{_mib(r['disk_write_bytes'])} | {r['peak_rss_bytes'] / MiB:.0f} |")
    print("\nCases: " + "; ".join(f"{r['case']['name']} = {r['job']['src_spec']} -> "
                                 f"{','.join(r['job']['dst_specs'])}, {r['case']['size_gib']:g} GiB "
                                 f"{r['case']['dtype']}" for r in reports) + ".")
    print("\nx cp: over the case's `cp -r` + `sync` of the source shards; x cp out: where a destination writes "
          "more than it reads (replicas), over a `cp -r` + `sync` of that destination's output tree, the "
          "yardstick of the time target there; needed: the bytes the destination needs read, each element "
          "once (for cp and ingest: the data bytes of the source files); read: zckpt's own count (rchar for cp); "
          "disk read/written: block-layer bytes (/proc/self/io).\n")
    summary(every, reports)


def summary(every: list[Cell], reports: list[dict[str, Any]]) -> None:
    """Per target of the issue, the cells that meet it and the ones that miss, worst first."""
    timed = [c for c in every if c.phase in TIMED]
    checks: list[tuple[str, list[tuple[Cell, float]], float, str]] = [
        (f"wall <= {TIME_TARGET}x copy", [(c, c.x_copy) for c in timed if c.x_copy is not None], TIME_TARGET, "x"),
        (f"read <= {READ_TARGET}x needed", [(c, c.row["read_bytes"] / c.needed) for c in timed], READ_TARGET, "x"),
        ("peak RSS <= 1 GiB", [(c, c.row["peak_rss_bytes"] / MiB) for c in timed], RSS_TARGET / MiB, " MiB"),
    ]
    for title, values, limit, unit in checks:
        miss = sorted(((c, v) for c, v in values if v > limit), key=lambda cv: -cv[1])
        fmt = "{:.0f}" if unit == " MiB" else "{:.2f}"
        tail = "; misses: " + ", ".join(f"{c.name} {fmt.format(v)}{unit}" for c, v in miss) if miss else ""
        print(f"- **{title}**: {len(values) - len(miss)} of {len(values)} cells{tail}")
    by_name = {r["case"]["name"]: r for r in reports}
    flat = []
    for r in reports:
        base = by_name.get(r["case"].get("base", ""))
        if base is None:
            continue
        small = {(x["phase"], x.get("dst"), x["cache"]): x for x in base["phases"] if "error" not in x}
        for x in r["phases"]:
            y = small.get((x["phase"], x.get("dst"), x["cache"]))
            if x["phase"] in TIMED and y is not None and "error" not in x:
                dst = f" -> {x['dst']}" if x.get("dst") else ""
                flat.append(f"{r['case']['name']} {x['phase']}{dst} {x['peak_rss_bytes'] / y['peak_rss_bytes']:.2f}")
    if flat:
        print(f"- **peak RSS flat from 2 to 16 GiB** (16 GiB / 2 GiB): {', '.join(flat)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the cases (with --results: which are done) and exit")
    ap.add_argument("--render", type=Path, metavar="DIR", help="print the table of the cases saved in DIR and exit")
    ap.add_argument("--only", help="comma-separated case names (any size class)")
    ap.add_argument("--size-class", choices=["small", "large", "all"], default="small",
                    help="the 2 GiB cases, the 16 GiB ones, or both")
    ap.add_argument("--size-gib", type=float, help="run every selected case at this size instead of its own")
    ap.add_argument("--repeat", type=int, default=3, help="runs of every phase (median shown)")
    ap.add_argument("--cache", default="cold", help="cache states: cold, warm or both (bench_jobs.py --cache)")
    ap.add_argument("--phases", default="cp,ingest,export,transform", help="bench_jobs.py --phases")
    ap.add_argument("--workers", type=int, default=1, help="zckpt --workers of every zckpt phase")
    ap.add_argument("--gen-workers", type=int, default=os.cpu_count() or 1, help="processes writing the sources")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/zckpt-jobs"),
                    help="work directory on the local disk (not a tmpfs): jobs, store, outputs")
    ap.add_argument("--results", type=Path, help="directory of the cases' JSON and tables (default: WORK/matrix)")
    ap.add_argument("--force", action="store_true", help="run cases whose results exist again")
    ap.add_argument("--keep-jobs", action="store_true", help="keep every generated source job (default: delete "
                                                             "one after the last selected case that uses it)")
    a = ap.parse_args()
    if a.render is not None:
        render(a.render)
        return
    results = a.results or a.work / "matrix"
    if a.list:
        list_cases(results)
        return
    a.results = results
    failed = run_cases(select(a.only, a.size_class), a)
    if failed:
        raise SystemExit(f"{failed} case(s) failed or were skipped; run again to retry")
    render(results)


if __name__ == "__main__":
    main()
