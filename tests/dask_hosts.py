"""A Dask scheduler and worker processes on loopback for tests: started with the commands a
user types on each host, waited for, and stopped (terminated, then killed) afterwards; and
what the lost-worker tests share (their job, and a command run while one worker is killed)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.jobs.generate import GeneratedModel, write_model
from zckpt.jobs.generate_model import TensorDef

FILES = 16
"""Destination files of the lost-worker job."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def cluster(scheduler_dir: Path, workers: Sequence[tuple[list[str], Path, Mapping[str, str] | None]],
            expect: int) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    """A scheduler started in ``scheduler_dir`` and one ``dask worker`` per ``(extra
    arguments, working directory, environment)``, until ``expect`` workers have joined:
    ``(address, worker processes)``."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                               "--port", str(port), "--no-dashboard"], cwd=scheduler_dir, **quiet)]
    started: list[subprocess.Popen[bytes]] = []
    try:
        for args, cwd, env in workers:
            started.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address,
                                             "--no-dashboard", "--memory-limit", "0", *args],
                                            cwd=cwd, env=None if env is None else dict(env), **quiet))
            procs.append(started[-1])
        wait_for_workers(address, expect)
        yield address, started
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:  # a worker still saying goodbye to a scheduler gone first
                p.kill()
                p.wait()


def wait_for_workers(address: str, n: int, alive: Callable[[], bool] = lambda: True) -> None:
    """Wait until ``n`` workers have joined the scheduler at ``address`` (which may not listen
    yet), while ``alive()``."""
    from distributed import Client

    deadline = time.monotonic() + 60
    while True:
        assert alive(), "a scheduler or worker stopped"
        try:
            with Client(address, timeout=5) as c:
                c.wait_for_workers(n, timeout=30)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def lost_worker_job(root: Path) -> tuple[GeneratedModel, Path]:
    """4 row-split ranks -> :data:`FILES` row-split ranks (``root/src``, ``root/dst.ckpt``)."""
    model = write_model(root / "src", [TensorDef(f"w{i}", (128, 96), "Float32", make_layout([4], [0, -1]))
                                       for i in range(6)], device_num=4)
    dst = StrategyMap(layouts={t.name: {0: make_layout([FILES], [0, -1])} for t in model.tensors
                               if t.name.startswith("w")})
    (root / "dst.ckpt").write_bytes(encode_strategy(dst))
    return model, root / "dst.ckpt"


def writing_below(workers: Sequence[subprocess.Popen[bytes]], watch: Path) -> subprocess.Popen[bytes] | None:
    """The first worker writing a file below ``watch`` (a temporary name carries its writer's
    process id: workers preloaded with tests/dask_slow_worker.py)."""
    if not watch.exists():
        return None
    return next((w for w in workers if any(watch.rglob(f"*.{w.pid}.*.tmp-zckpt"))), None)


def killing_one(cmd: list[str], cwd: Path, caught: Callable[[], subprocess.Popen[bytes] | None],
                env: Mapping[str, str] | None = None) -> int:
    """Run ``zckpt cmd`` in ``cwd``; SIGKILL the first worker ``caught()`` names (one caught
    writing); the command's exit code."""
    proc = subprocess.Popen([sys.executable, "-m", "zckpt.cli", *cmd, "--quiet"], cwd=cwd,
                            env=None if env is None else dict(env))
    deadline = time.monotonic() + 60
    worker = None
    while worker is None and proc.poll() is None and time.monotonic() < deadline:
        worker = caught()
        time.sleep(0.02)
    assert worker is not None and proc.poll() is None, "no worker was caught writing"
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=20)
    return proc.wait(timeout=180)
