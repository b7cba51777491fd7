"""Two Dask workers as two hosts on loopback, the sources, the store and the outputs on an S3
server (moto's, on loopback), one worker killed with SIGKILL in the middle of its writes
during an ingest, an export and a transform typed as a user types them.

Each worker starts in a directory of its own with the credentials and its endpoint in its
environment (``AWS_*``, as on a host of a cluster; the transform gives the endpoint as a
``--storage-option`` instead, which travels with the tasks); each reaches the server through a proxy
of its own (tests/s3_proxy.py) that delays every write a little and tells which worker is
writing, so the kill lands in the middle of a task's writes. Dask runs the lost tasks again
on the other worker: the store holds every object of a one-process ingest byte for byte,
the output prefix exactly the files of an undisturbed one-process run on local files (no
temporary object of the killed task), and a rerun writes nothing. The direct path
(transform) reads its sources from S3 and writes local files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ckpt_compare import diff_dirs
from dask_hosts import cluster, killing_one, lost_worker_job, writing_below

from zckpt.jobs.ingest import IngestOptions, ingest
from zckpt.jobs.transform import TransformOptions, transform

pytest.importorskip("distributed")
pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")

from s3_proxy import CREDENTIALS, Fault, Proxy, moto_server  # noqa: E402  (after the skips: it needs moto)

HERE = Path(__file__).resolve().parent
BUCKET = "zckpt-lost-worker"
DELAY = 0.1
"""Seconds each write of a worker waits (at its proxy, or before a local file is published):
time to catch it in the middle."""


@dataclass
class S3Hosts:
    address: str
    workers: list[subprocess.Popen[bytes]]
    proxies: list[Proxy]
    """One per worker, in the same order."""
    client: Proxy
    """The zckpt command's way to the server."""
    fs: Any
    endpoint: str

    def env(self) -> dict[str, str]:
        """The zckpt command's environment: credentials and endpoint, as a user sets them."""
        return {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": self.client.url}

    def writing(self, where: str) -> subprocess.Popen[bytes] | None:
        """The first live worker whose proxy has seen a write to a path containing ``where``."""
        return next((w for w, p in zip(self.workers, self.proxies, strict=True)
                     if w.poll() is None and p.writes(where)), None)

    def writes(self, where: str) -> list[str]:
        return [w for p in (*self.proxies, self.client) for w in p.writes(where)]

    def reset_counts(self) -> None:
        for p in (*self.proxies, self.client):
            p.reset_counts()

    def tree(self, root: str) -> dict[str, bytes]:
        """Every object below ``root`` (``bucket/prefix``), by its path relative to it."""
        self.fs.invalidate_cache()
        return {p[len(root) + 1:]: self.fs.cat_file(p) for p in sorted(self.fs.find(root))}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Any]]:
    with moto_server() as endpoint:
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        fs.mkdir(BUCKET)
        yield endpoint, fs


@pytest.fixture
def hosts(tmp_path: Path, server: tuple[str, Any]) -> Iterator[S3Hosts]:
    """A scheduler and two single-thread workers (no nanny: killing one kills its tasks), each
    in its own directory, each with its own environment and its own slow way to the server;
    local files are written as in tests/test_dask_lost_worker.py (named temporaries, slow)."""
    endpoint, fs = server
    with Proxy(endpoint) as a, Proxy(endpoint) as b, Proxy(endpoint) as c:
        spec = []
        for name, proxy in (("host-a", a), ("host-b", b)):
            proxy.faults = [Fault("/", "delay", method=m, stall_seconds=DELAY) for m in ("PUT", "POST")]
            home = tmp_path / name
            (home / "tmp").mkdir(parents=True)
            env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": proxy.url, "HOME": str(home),
                   "TMPDIR": str(home / "tmp")}
            env["ZCKPT_TEST_PUBLISH_DELAY"] = str(DELAY)
            slow = ["--preload", str(HERE / "dask_slow_worker.py")]
            spec.append((["--nthreads", "1", "--no-nanny", "--name", name, *slow], home, env))
        with cluster(tmp_path, spec, expect=2) as (address, workers):
            yield S3Hosts(address, workers, [a, b], c, fs, endpoint)


def _local(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("phase", ["ingest", "export", "transform"])
def test_a_worker_killed_mid_job_on_s3_leaves_the_bytes_of_a_clean_run(
        hosts: S3Hosts, tmp_path: Path, phase: str) -> None:
    """Sources on S3 in every phase; the store on S3 for ingest and export; the output on
    S3 for export; transform writes a relative local ``out`` here (its output URLs: tests/test_transform_urls.py)."""
    user = tmp_path / "user"
    user.mkdir()
    model, dst = lost_worker_job(user)
    clean = tmp_path / "clean"
    transform(model.root, clean, model.strategy_path, dst, options=TransformOptions(helper=False))
    so = {"endpoint_url": hosts.endpoint}
    prefix = f"{BUCKET}/{uuid.uuid4().hex[:10]}"
    hosts.fs.put(str(user / "src"), f"{prefix}/src", recursive=True)
    src, store, out = f"s3://{prefix}/src", f"s3://{prefix}/s.zarr", f"s3://{prefix}/out"
    on = ["--scheduler", hosts.address]
    if phase == "ingest":
        cmd = ["ingest", src, "--src-strategy", f"{src}/strategy.ckpt", "--store", store, *on]
        assert killing_one(cmd, user, lambda: hosts.writing("/s.zarr/"), hosts.env()) == 0
        alone = f"{prefix}/alone.zarr"  # the same ingest in one process
        ingest(src, f"s3://{alone}", f"{src}/strategy.ckpt", IngestOptions(helper=False, storage_options=so))
        got = hosts.tree(f"{prefix}/s.zarr")
        assert sorted(got) == sorted(hosts.tree(alone)), "objects other than a one-process ingest's"
        assert got == hosts.tree(alone)  # every object, byte for byte (the manifest and progress records too)
        written = "/s.zarr/"
    elif phase == "export":
        ingest(src, store, f"{src}/strategy.ckpt", IngestOptions(helper=False, storage_options=so))
        cmd = ["export", store, "--dst-strategy", "dst.ckpt", "--out", out, *on]
        assert killing_one(cmd, user, lambda: hosts.writing("/out/"), hosts.env()) == 0
        got = hosts.tree(f"{prefix}/out")
        assert got == _local(clean), "objects other than a one-process export's"
        written = "/out/"
    else:  # the endpoint as a storage option this time: it travels with the tasks, over the workers' own
        cmd = ["transform", src, "--src-strategy", f"{src}/strategy.ckpt", "--dst-strategy", "dst.ckpt",
               "--out", "out", "--storage-option", f"endpoint_url={hosts.client.url}", *on]
        assert killing_one(cmd, user, lambda: writing_below(hosts.workers, user / "out"), hosts.env()) == 0
        assert not [k for p in hosts.proxies for k in p.requests if "/src/" in k]
        got = _local(user / "out")
        assert diff_dirs(clean, user / "out") == []
        assert not list(user.rglob("*.tmp-zckpt"))
        written = "/out/"
    assert sum(w.poll() is None for w in hosts.workers) == 1

    hosts.reset_counts()
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (user / "out").rglob("*")} \
        if phase == "transform" else None
    rerun = subprocess.run([sys.executable, "-m", "zckpt.cli", *cmd, "--quiet"], cwd=user, env=hosts.env(),
                           check=False)
    assert rerun.returncode == 0
    assert hosts.writes(written) == []
    if before is not None:
        assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (user / "out").rglob("*")} == before
    else:
        assert hosts.tree(f"{prefix}/{'s.zarr' if phase == 'ingest' else 'out'}") == got
    spooled = [p for w in ("host-a", "host-b") for p in (tmp_path / w / "tmp").rglob("*")
               if p.is_file() and "dask-scratch-space" not in p.parts]
    assert not spooled, "a remote output went through a worker's local disk"
