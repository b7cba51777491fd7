"""Two Dask workers as two hosts on loopback (each in a directory of its own), one killed
with SIGKILL in the middle of an ingest, an export and a transform typed as a user types
them (relative paths): Dask runs the lost tasks again on the other worker, the job finishes
with the bytes of an undisturbed one-process run, no temporary file of the killed task is
left, and a rerun writes nothing. The workers write new files under temporary names, as on
a filesystem without unnamed files (tests/dask_slow_worker.py), so a killed task does leave one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpt_compare import diff_dirs
from dask_hosts import cluster, killing_one, lost_worker_job, writing_below

from zckpt.jobs.export import export
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.ingest import IngestOptions, ingest
from zckpt.jobs.transform import TransformOptions, transform

pytest.importorskip("distributed")

HERE = Path(__file__).resolve().parent


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


def _temporaries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp-zckpt"))


@pytest.mark.parametrize("phase", ["ingest", "export", "transform"])
def test_a_worker_killed_mid_job_leaves_the_bytes_of_a_clean_run(
        hosts: tuple[str, list[subprocess.Popen[bytes]]], tmp_path: Path, phase: str) -> None:
    address, workers = hosts
    user = tmp_path / "user"
    user.mkdir()
    model, dst = lost_worker_job(user)
    clean = tmp_path / "clean"
    transform(model.root, clean, model.strategy_path, dst, options=TransformOptions(helper=False))
    on = ["--scheduler", address]
    if phase == "ingest":
        code = killing_one(["ingest", "src", "--strategy", "src/strategy.ckpt", "--store", "s.zarr", *on],
                           user, lambda: writing_below(workers, user / "s.zarr" / "progress"))
        assert code == 0
        export(user / "s.zarr", user / "out", dst, options=ExportOptions(helper=False))
    elif phase == "export":
        ingest(model.root, user / "s.zarr", model.strategy_path, IngestOptions(helper=False))
        code = killing_one(["export", "s.zarr", "--strategy", "dst.ckpt", "--out", "out", *on],
                           user, lambda: writing_below(workers, user / "out"))
        assert code == 0
    else:
        code = killing_one(["transform", "src", "--src-strategy", "src/strategy.ckpt", "--dst-strategy", "dst.ckpt",
                            "--out", "out", *on], user, lambda: writing_below(workers, user / "out"))
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
