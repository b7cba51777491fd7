"""The benchmark command runs end to end on a tiny model and reports every phase."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_transform.py"


def test_bench_transform_reports_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--size-gib", "0.005", "--work", str(tmp_path / "work"),
         "--scratch", str(tmp_path / "scratch"), "--repeat", "2", "--mindspore-python", "", "--json-out", str(out)],
        capture_output=True, text=True, check=False, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text(encoding="utf-8"))
    labels = [r["label"] for r in report["phases"]]
    assert labels == ["zckpt ingest, 2 worker(s)", "zckpt ingest, 1 worker(s)", "zckpt export, 1 worker(s)",
                      "zckpt export, 2 worker(s)", "zckpt export, 2 worker(s), overlap",
                      "zckpt export, 1 worker(s), no overlap", "zckpt ingest, 1 worker(s), no overlap",
                      "zckpt transform (direct), 1 worker(s)", "zckpt transform (direct), 2 worker(s)",
                      "cp -r of the export output", "cp of the export output, 2 at once"]
    for r in report["phases"]:
        assert "error" not in r, r
        assert len(r["runs_seconds"]) == 2 and r["seconds"] in r["runs_seconds"]
        assert r["bytes_out"] > 0 and r["max_rss_bytes"] > 0
    exported = report["phases"][2]
    assert exported["read_chars"] >= exported["bytes_out"] * 0.9  # zckpt's own read counter, not rchar
    assert "export / cp of its output" in proc.stdout and "speed-up with 2 workers" in proc.stdout
    assert "export speed-up of 2 workers over 1 thread (--no-overlap)" in proc.stdout
    assert "speed-up of 2 cp processes over 1" in proc.stdout and "over forced overlap" in proc.stdout
    assert "zckpt transform, direct (1 worker(s)) / ingest+export" in proc.stdout
    direct = report["phases"][7]
    assert direct["bytes_out"] == exported["bytes_out"]  # the same files as the store path
    copies = [r for r in report["phases"] if r["label"].startswith("cp")]
    assert len(copies) == 2 and copies[0]["bytes_out"] == copies[1]["bytes_out"] == report["phases"][2]["bytes_out"]


BENCH_DIR = BENCH.parent


def test_bench_jobs_runs_every_phase_and_checks_values(tmp_path: Path) -> None:
    """bench_jobs on a tiny pipeline job: every zckpt phase runs, the one-rank export equals
    the generator's values (--check), and the table names each phase."""
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_jobs.py"), "--src", "pp2xtp2xdp2", "--dst", "tp2xdp2,1",
         "--size-gib", "0.002", "--work", str(tmp_path / "work"), "--repeat", "1", "--cache", "warm",
         "--skip-mindspore", "--check", "--gen-workers", "1", "--json-out", str(out)],
        capture_output=True, text=True, check=False, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text(encoding="utf-8"))
    phases = [r["phase"] for r in report["phases"]]
    assert [p for p in phases if p != "transform"] == ["cp", "ingest", "export", "export"]
    assert phases.count("transform") in (0, 2)  # the direct path when this zckpt has `transform`
    for r in report["phases"]:
        assert "error" not in r, r
        assert r["cache"] == "warm" and r["out_bytes"] > 0 and r["peak_rss_bytes"] > 0
    assert report["checked_tensors"] > 0 and report["job"]["src_files"] == 8
    assert report["job"]["store_files"] > 0
    assert "| zckpt ingest | warm |" in proc.stdout and "x cp" in proc.stdout


def test_jobs_model_shards_match_an_independent_slicer(tmp_path: Path) -> None:
    """Each rank of a generated pp 2 x tp 2 x dp 2 job holds the slice of the global value that
    MindSpore's rule gives (dev_matrix (dp, tp), rank = dp_i * tp + tp_i; the optimizer splits
    dimension 0 of the tensor-parallel slice over dp, or over dp and tp for a replicated norm)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        from jobs_model import ModelDims, Parallel, box_value, write_job
    finally:
        sys.path.remove(str(BENCH_DIR))
    from zckpt.core.layout import Box
    from zckpt.formats.ckpt import CkptReader

    dims = ModelDims(hidden=64, layers=2, ffn=64, vocab=128)
    par = Parallel(pp=2, tp=2, dp=2)
    strategy = write_job(tmp_path / "src", dims, par, workers=1)
    assert strategy is not None and strategy.name == "strategy_merged.ckpt"
    assert len(list((tmp_path / "src" / "strategy").glob("strategy_*.ckpt"))) == 8
    cases = {"decoder.layers.0.self_attention.linear_qkv.weight": ("col", 0),
             "decoder.layers.1.mlp.linear_fc2.weight": ("row", 1),
             "adam_v.decoder.layers.0.input_layernorm.weight": ("norm", 0),
             "adam_m.output_layer.weight": ("col", 1)}
    for name, (kind, stage) in cases.items():
        with CkptReader(tmp_path / "src" / "rank_0" / "checkpoint_0.ckpt") as r0:
            assert (name in r0.entries) == (stage == 0)
        for local in range(4):
            rank = stage * 4 + local
            with CkptReader(tmp_path / "src" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
                got = r.array(name)
                ms_type = r.entries[name].ms_type
            shape = {"col": (2 * dims.hidden if "qkv" not in name else 3 * dims.hidden, dims.hidden),
                     "row": (dims.hidden, dims.ffn), "norm": (dims.hidden,)}[kind]
            if "output_layer" in name:
                shape = (dims.vocab, dims.hidden)
            full = box_value(name, shape, ms_type, Box.full(shape))
            tp_i, dp_i = local % 2, local // 2
            if kind == "col":
                part = full[tp_i * shape[0] // 2:(tp_i + 1) * shape[0] // 2]
                want = part[dp_i * part.shape[0] // 2:(dp_i + 1) * part.shape[0] // 2]
            elif kind == "row":
                part = full[:, tp_i * shape[1] // 2:(tp_i + 1) * shape[1] // 2]
                want = part[dp_i * shape[0] // 2:(dp_i + 1) * shape[0] // 2]
            else:
                want = full[local * shape[0] // 4:(local + 1) * shape[0] // 4]
            assert got.shape == want.shape and got.tobytes() == want.tobytes(), (name, rank)


def _model_by_hand(dims: dict[str, int]) -> tuple[int, int, int]:
    """Bytes of the generated model's matrices, norms and scalars, from its shapes alone: bf16 (or fp32)
    matrices, fp32 norms, two fp32 moments beside each, and the AdamW job's three 4-byte scalars."""
    h, f, v = dims["hidden"], dims["ffn"], dims["vocab"]
    w = 2 if dims.get("weight_type", "BFloat16") == "BFloat16" else 4
    matrices = 2 * v * h + dims["layers"] * (3 * h * h + h * h + 2 * f * h + h * f)
    norms = (2 * dims["layers"] + 1) * h
    return matrices * (w + 8), norms * 12, 3 * 4


def test_bench_matrix_runs_a_case_and_renders_the_targets(tmp_path: Path) -> None:
    """bench_matrix on one tiny case: the table has a row per phase (with the copy of the output tree
    where the destination holds replicas), the issue's columns, and 'needed' equals the model's bytes
    counted from its shapes; a second run skips the done case; --list names every case."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        from bench_matrix import CASES
    finally:
        sys.path.remove(str(BENCH_DIR))
    cmd = [sys.executable, str(BENCH_DIR / "bench_matrix.py"), "--work", str(tmp_path / "work"),
           "--results", str(tmp_path / "res")]
    run = [*cmd, "--only", "replicate", "--size-gib", "0.005", "--repeat", "1", "--cache", "warm",
           "--gen-workers", "1"]
    proc = subprocess.run(run, capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "res" / "replicate.json").read_text(encoding="utf-8"))
    matrices, norms, scalars = _model_by_hand(report["job"]["dims"])
    needed = matrices + norms + scalars
    assert report["job"]["needed_bytes"] == {"tp8xdp2:noopt": needed}
    # without the optimizer split the matrices are held twice (dp 2), norms and scalars by all 16 ranks
    assert report["job"]["dst_data_bytes"]["tp8xdp2:noopt"] == 2 * matrices + 16 * (norms + scalars)
    lines = proc.stdout.splitlines()
    header = next(x for x in lines if x.startswith("| case |"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "case", "phase", "cache", "wall s", "x cp", "x cp out", "CPU s", "read MiB", "needed MiB", "read / needed",
        "disk read MiB", "disk written MiB", "peak RSS MiB"]
    rows = {tuple(c.strip() for c in x.strip("|").split("|"))[:2]: [c.strip() for c in x.strip("|").split("|")]
            for x in lines if x.startswith("| replicate |")}
    dst = " -> tp8xdp2:noopt"
    assert set(rows) == {("replicate", p) for p in ("cp", "ingest", "export" + dst, "cp-out" + dst,
                                                    "transform" + dst)}
    for phase in ("export", "transform"):
        row = rows[("replicate", phase + dst)]
        assert row[8] == f"{needed / 2**20:.1f}" and row[5] != "-"  # against the copy of the output tree
        read = next(r["read_bytes"] for r in report["phases"] if r["phase"] == phase)
        assert row[9] == f"{read / needed:.2f}"
    assert rows[("replicate", "ingest")][5] == "-"
    assert "- **wall <= 1.2x copy**: " in proc.stdout and "- **read <= 1.1x needed**: " in proc.stdout
    assert "- **peak RSS <= 1 GiB**: 3 of 3 cells" in proc.stdout
    again = subprocess.run(run, capture_output=True, text=True, check=False, timeout=600)
    assert again.returncode == 0 and "replicate: done" in again.stderr
    listed = subprocess.run([*cmd, "--list"], capture_output=True, text=True, check=True, timeout=600).stdout
    names = [x.split("|")[1].strip() for x in listed.splitlines()[2:]]
    assert names == [c.name for c in CASES] and len(set(names)) == len(names)
    assert "| replicate | replicate | 2 | bf16 | tp8xdp2 | tp8xdp2:noopt |" in listed
    assert "| yes |" in listed.splitlines()[2 + names.index("replicate")]  # writes more, and done


def test_where_time_goes_sorts_perf_samples_into_categories() -> None:
    """``perf report --sort dso,sym`` lines, as perf prints them, summed per category."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from where_time_goes import CATEGORIES, shares

    report = """# Samples: 22K of event 'cpu-clock:ppp'
    40.00%  libpython3.11.so.1.0  [.] _PyEval_EvalFrameDefault
    20.00%  [kernel.kallsyms]     [k] copy_folio_from_iter_atomic
     5.00%  [kernel.kallsyms]     [k] __pi_memcpy
    10.00%  [kernel.kallsyms]     [k] ext4_da_get_block_prep
     8.00%  libc.so.6             [.] __memmove_avx512_unaligned_erms
     7.00%  libcrc32c-7ebc40c5.so.1.1.0  [.] crc32c::ExtendSse42
     6.00%  _multiarray_umath.cpython-311-x86_64-linux-gnu.so  [.] npy_copy
     4.00%  libc.so.6             [.] malloc
"""
    got = shares(report)
    assert [round(got[c]) for c in CATEGORIES] == [25, 10, 40, 8, 7, 6, 4]


def test_disk_timeline_sums_its_samples_and_runs_a_command(tmp_path: Path) -> None:
    """The timeline's totals come from its first and last samples (bytes, busy time, CPU
    ticks), the first write is the first sample whose written bytes grew; run on a command,
    it prints a summary and exits with the command's own code."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from disk_timeline import TICK, Sample, summarise

    mib = 2**20
    samples = [Sample(0.0, 0, 0, 0, 0, 0, 0), Sample(0.5, 100 * mib, 0, 400, 50, 50, TICK // 2),
               Sample(1.0, 200 * mib, 0, 900, 80, 120, TICK // 4), Sample(2.0, 200 * mib, 300 * mib, 1900, 100, 300, 0)]
    got = summarise(samples, 0.5)
    assert (got.wall_s, got.read_mib, got.written_mib, got.first_write_s) == (2.0, 200.0, 300.0, 2.0)
    assert (got.disk_busy, got.cpu_machine, got.top_process) == (0.95, 0.25, 0.75)
    script = Path(__file__).resolve().parents[1] / "bench" / "disk_timeline.py"
    write = f"open({str(tmp_path / 'f')!r}, 'wb').write(bytes(1 << 20)); raise SystemExit(3)"
    proc = subprocess.run([sys.executable, str(script), "--interval", "0.02", "--", sys.executable, "-c", write],
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "wall_s" in proc.stdout and (tmp_path / "f").stat().st_size == 1 << 20


def test_alternate_takes_the_trees_in_turn_and_runs_each_tree_s_own_zckpt(tmp_path: Path) -> None:
    """Rounds alternate which tree goes first; the summary gives each tree its runs in order
    and their median; a run imports zckpt from its own tree (a tree whose zckpt fails shows
    as failed runs and a non-zero exit)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from alternate import Run, Tree, order, summary

    a, b = Tree("a", tmp_path), Tree("b", tmp_path)
    assert [t.name for t in order([a, b], 3)] == ["a", "b", "b", "a", "a", "b"]
    runs = [Run("a", 3.0, True), Run("b", 2.0, True), Run("b", 4.0, True), Run("a", 1.0, True),
            Run("a", 2.0, False), Run("b", 3.0, True)]
    assert summary(runs) == ["a: median 2.00 s, 1.00-3.00 (3.00 1.00 2.00!)",
                             "b: median 3.00 s, 2.00-4.00 (2.00 4.00 3.00)"]
    broken = tmp_path / "broken" / "zckpt"
    (broken / "cli").mkdir(parents=True)
    (broken / "__init__.py").write_text("")
    (broken / "cli" / "__init__.py").write_text("")
    (broken / "cli" / "__main__.py").write_text("raise SystemExit(7)\n")
    script = Path(__file__).resolve().parents[1] / "bench" / "alternate.py"
    here = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(script), "--tree", f"good={here}", "--tree", f"bad={broken.parent}",
                           "--pairs", "1", "--warm", "--out", str(tmp_path / "o"), "--", "info",
                           str(here / "docs" / "example" / "src" / "strategy.ckpt")],
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "good: median" in proc.stdout and "bad: every run failed (" in proc.stdout
