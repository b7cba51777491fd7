"""docs/dask-cluster.md's walkthrough runs as written: its shell blocks are taken from the
page and run, the ones that keep running (the scheduler, a worker started twice) in the
background in a copy of the repository's example, the others in order from its root; only
the variables the blocks read are set (the scheduler's port and address, the S3 endpoint of
moto's server on loopback, the credentials). The files and objects written are MindSpore's
own destination files, byte for byte."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dask_hosts import free_port, wait_for_workers

pytest.importorskip("distributed")
pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'moto[server]')")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs)")

from s3_proxy import CREDENTIALS, moto_server  # noqa: E402  (after the skips: it needs moto)

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "dask-cluster.md"
BUCKET = "zckpt-walkthrough"
EXPECTED = ROOT / "docs" / "example" / "dst" / "expected"


def walkthrough_blocks(markdown: str) -> list[tuple[str, str]]:
    """``(how, block)`` for every ```bash block right after a ``<!-- walkthrough: HOW -->`` line:
    ``serve`` (keeps running), ``serve x2`` (the same, started twice) or ``run``."""
    return re.findall(r"^<!-- walkthrough: (serve|serve x2|run) -->\n```bash\n(.*?)^```$", markdown, re.S | re.M)


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    """Each background block's whole process group: terminated, then killed."""
    for p in reversed(procs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture
def walk(tmp_path: Path) -> Iterator[tuple[Path, Any, list[subprocess.CompletedProcess[str]]]]:
    """The walkthrough run in ``tmp_path``: ``(root, s3 filesystem, results of the run blocks)``."""
    blocks = walkthrough_blocks(PAGE.read_text(encoding="utf-8"))
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs" / "example", root / "docs" / "example")
    (root / "work").mkdir()
    (tmp_path / "hosts").mkdir()
    with moto_server() as endpoint:
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        fs.mkdir(BUCKET)
        port = free_port()
        env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "SCHEDULER_PORT": str(port),
               "SCHEDULER": f"tcp://127.0.0.1:{port}", "TMPDIR": str(tmp_path / "hosts"),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        serving: list[subprocess.Popen[str]] = []
        results: list[subprocess.CompletedProcess[str]] = []
        try:
            for how, block in blocks:
                if how.startswith("serve"):
                    for _ in range(2 if how.endswith("x2") else 1):
                        serving.append(subprocess.Popen(["bash", "-euo", "pipefail", "-c", block], cwd=root, env=env,
                                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                        text=True, start_new_session=True))
                    continue
                if not results:
                    wait_for_workers(env["SCHEDULER"], 2, lambda: all(p.poll() is None for p in serving))
                proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=root, env=env,
                                      capture_output=True, text=True, timeout=300, check=False)
                results.append(proc)
                if proc.returncode != 0:
                    break
            yield root, fs, results
        finally:
            _stop(serving)


def test_the_walkthrough_has_its_blocks() -> None:
    hows = [how for how, _ in walkthrough_blocks(PAGE.read_text(encoding="utf-8"))]
    assert hows == ["serve", "serve x2", "run", "run"]


def test_the_walkthrough_runs_as_written(walk: tuple[Path, Any, list[subprocess.CompletedProcess[str]]]) -> None:
    root, fs, results = walk
    for proc in results:
        assert proc.returncode == 0, f"walkthrough block failed:\n{proc.args[-1]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert len(results) == 2
    expected = {p.relative_to(EXPECTED).as_posix(): p.read_bytes() for p in EXPECTED.rglob("*.ckpt")}
    assert len(expected) == 4
    for out in ("cluster-dst", "cluster-direct", "cluster-from-s3"):
        got = root / "work" / out
        assert {p.relative_to(got).as_posix(): p.read_bytes() for p in got.rglob("*.ckpt")} == expected
    prefix = f"{BUCKET}/job/dst"
    assert {p[len(prefix) + 1:]: fs.cat_file(p) for p in fs.find(prefix) if p.endswith(".ckpt")} == expected
    hosts = root.parent / "hosts"  # the workers' directories: relative paths did not resolve there
    assert not [p for p in hosts.rglob("*") if p.is_file() and "dask-scratch-space" not in p.parts]
