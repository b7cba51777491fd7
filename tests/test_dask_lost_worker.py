"""Two Dask workers as two hosts on loopback (each in a directory of its own), one killed
with SIGKILL in the middle of an ingest, an export and a transform typed as a user types
them (relative paths): Dask runs the lost tasks again on the other worker, the job finishes
with the bytes of an undisturbed one-process run, no temporary file of the killed task is
left, and a rerun writes nothing. The workers write new files under temporary names, as on
a filesystem without unnamed files (tests/dask_slow_worker.py), so a killed task does leave one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpt_compare import diff_dirs
from dask_hosts import cluster

from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.jobs.export import export
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.generate import GeneratedModel, write_model
from zckpt.jobs.generate_model import TensorDef
from zckpt.jobs.ingest import IngestOptions, ingest
from zckpt.jobs.transform import TransformOptions, transform

pytest.importorskip("distributed")

HERE = Path(__file__).resolve().parent
FILES = 16


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    """A scheduler and two single-thread workers (no nanny: killing one kills its tasks),
    each worker in its own directory with its own environment."""
    spec = []
    for name in ("host-a", "host-b"):
        home = tmp_path / name
        home.mkdir()
        env = dict(os.environ, ZCKPT_TEST_PUBLISH_DELAY="0.25", HOME=str(home))
        spec.append((["--nthreads", "1", "--no-nanny", "--name", name,
                      "--preload", str(HERE / "dask_slow_worker.py")], home, env))
    with cluster(tmp_path, spec, expect=2) as (address, workers):
        yield address, workers


def _job(root: Path) -> tuple[GeneratedModel, Path]:
    """4 row-split ranks -> 16 row-split ranks, written where the user works."""
    model = write_model(root / "src", [TensorDef(f"w{i}", (128, 96), "Float32", make_layout([4], [0, -1]))
                                       for i in range(6)], device_num=4)
    dst = StrategyMap(layouts={t.name: {0: make_layout([FILES], [0, -1])} for t in model.tensors
                               if t.name.startswith("w")})
    (root / "dst.ckpt").write_bytes(encode_strategy(dst))
    return model, root / "dst.ckpt"


def _killing_one(cmd: list[str], user: Path, workers: list[subprocess.Popen[bytes]], watch: Path) -> int:
    """Run ``zckpt cmd`` from ``user``; SIGKILL the first worker caught writing a file below
    ``watch`` (a temporary name carries its writer's process id); the command's exit code."""
    proc = subprocess.Popen([sys.executable, "-m", "zckpt.cli", *cmd, "--quiet"], cwd=user)
    deadline = time.monotonic() + 60
    caught = None
    while caught is None and proc.poll() is None and time.monotonic() < deadline:
        if watch.exists():
            caught = next((w for w in workers if any(watch.rglob(f"*.{w.pid}.*.tmp-zckpt"))), None)
        time.sleep(0.02)
    assert caught is not None and proc.poll() is None, "no worker was caught writing"
    caught.send_signal(signal.SIGKILL)
    caught.wait(timeout=20)
    return proc.wait(timeout=180)


def _temporaries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp-zckpt"))


@pytest.mark.parametrize("phase", ["ingest", "export", "transform"])
def test_a_worker_killed_mid_job_leaves_the_bytes_of_a_clean_run(
        hosts: tuple[str, list[subprocess.Popen[bytes]]], tmp_path: Path, phase: str) -> None:
    address, workers = hosts
    user = tmp_path / "user"
    user.mkdir()
    model, dst = _job(user)
    clean = tmp_path / "clean"
    transform(model.root, clean, model.strategy_path, dst, options=TransformOptions(helper=False))
    on = ["--scheduler", address]
    if phase == "ingest":
        code = _killing_one(["ingest", "src", "--strategy", "src/strategy.ckpt", "--store", "s.zarr", *on],
                            user, workers, user / "s.zarr" / "progress")
        assert code == 0
        export(user / "s.zarr", user / "out", dst, options=ExportOptions(helper=False))
    elif phase == "export":
        ingest(model.root, user / "s.zarr", model.strategy_path, IngestOptions(helper=False))
        code = _killing_one(["export", "s.zarr", "--strategy", "dst.ckpt", "--out", "out", *on],
                            user, workers, user / "out")
        assert code == 0
    else:
        code = _killing_one(["transform", "src", "--src-strategy", "src/strategy.ckpt", "--dst-strategy", "dst.ckpt",
                             "--out", "out", *on], user, workers, user / "out")
        assert code == 0
    assert diff_dirs(clean, user / "out") == []
    assert _temporaries(user) == []
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (user / "out").rglob("*")}
    again = subprocess.run([sys.executable, "-m", "zckpt.cli", *(
        ["export", "s.zarr", "--strategy", "dst.ckpt", "--out", "out"] if phase != "transform" else
        ["transform", "src", "--src-strategy", "src/strategy.ckpt", "--dst-strategy", "dst.ckpt", "--out", "out"]),
        *on, "--quiet"], cwd=user)
    assert again.returncode == 0
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (user / "out").rglob("*")} == before
