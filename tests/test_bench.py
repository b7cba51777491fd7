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
