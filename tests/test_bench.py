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
    copies = [r for r in report["phases"] if r["label"].startswith("cp")]
    assert len(copies) == 2 and copies[0]["bytes_out"] == copies[1]["bytes_out"] == report["phases"][2]["bytes_out"]
