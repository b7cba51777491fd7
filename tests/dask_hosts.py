"""A Dask scheduler and worker processes on loopback for tests: started with the commands a
user types on each host, waited for, and stopped (terminated, then killed) afterwards."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path


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
        from distributed import Client

        deadline = time.monotonic() + 60
        while True:
            try:
                with Client(address, timeout=5) as c:
                    c.wait_for_workers(expect, timeout=30)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        yield address, started
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
