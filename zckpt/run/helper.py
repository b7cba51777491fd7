"""A second process on this machine that runs one batch of a phase's tasks.

One Python process copies on one core: at 512 source ranks an ingest's copies are CPU-bound
(a read, a checksum and a write per 74 KB run, 28 800 of them) while the machine's second
core idles. A helper process started here takes part of the ranks and the two copy at once.

Why not the usual engines: a Dask LocalCluster of worker processes takes about 2 s to start
(a third of a 2 GiB job; zckpt uses Dask to scale out, :mod:`zckpt.run.engines`), threads share
one interpreter lock (two copy threads gained nothing measurable), and ``multiprocessing``
runs the caller's main script again in the new process (a script that calls
``zckpt.ingest`` without a ``__main__`` guard would ingest twice). The helper is a plain
``python -m zckpt.run.helper``: it imports the modules named, waits for one pickled call on its
standard input, runs it and writes the pickled result (or the exception) on its standard
output. Nothing is shared but the files the call writes.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from zckpt.core.errors import ZckptError
from zckpt.run import engines
from zckpt.run.collect import fewer_collections

R = TypeVar("R")

HELPER_BYTES = 256 * 1024 * 1024
"""Jobs from this size on may run in two processes: starting the helper costs about 0.3 s of
CPU on the second core, and a 512-rank ingest's copies then take half the time (2 GiB:
1.8 s -> 1.0-1.2 s, bench/RESULTS.md)."""

HELPER_RANKS = 32
"""...and only when they come from or go to this many ranks or more: a job saved by (or cut
for) hundreds of ranks moves its bytes in 10 000s of small pieces, one core's work, where the helper
halves the time (512 ranks, 16 GiB: export 42 -> 23 s); a job of a few ranks moves a few
large sequential runs, the disk is the bound, and the helper cost 0.2-0.3 s (8 ranks,
2 GiB: export 2.72 -> 2.90 s, transform 2.96 -> 3.26 s; ingest unchanged)."""


def wanted(flag: bool | None, workers: int, scheduler: str | None, nbytes: int, ranks: int) -> bool:
    """Whether a phase takes a helper: as asked (``flag``), or (``None``, auto) when it runs
    in this process alone (no Dask workers or cluster), a second core is free and the
    phase moves at least :data:`HELPER_BYTES` between ``ranks`` (the more of its source and
    destination ranks) of at least :data:`HELPER_RANKS`."""
    if flag is not None:
        return flag
    return (workers == 1 and scheduler is None and engines.usable_cpus() > 1 and nbytes >= HELPER_BYTES
            and ranks >= HELPER_RANKS)


def start(modules: Sequence[str]) -> Helper | None:
    """A helper process, or ``None`` where none can be started (no Python executable to run,
    no processes left): the phase then runs in this process alone."""
    if not sys.executable:
        return None
    try:
        return Helper(modules)
    except OSError:
        return None


def hand_over(helper: Helper | None, units: Sequence[Any], sizes: Sequence[int], fn: Callable[..., list[R]],
              *args: Any, step: int = 1) -> tuple[int, Callable[[], list[R]]] | None:
    """Give the helper its share of ``units`` (:func:`share_from`) as ``fn(share, *args)``:
    the ``aside`` of :func:`zckpt.run.engines.run_all`, or ``None`` (no helper, or nothing for it)."""
    if helper is None:
        return None
    first = share_from(sizes, step)
    if first >= len(units):
        return None
    helper.submit(fn, list(units[first:]), *args)
    return first, helper.result


def overlap_beside(flag: bool | None, client: Any, helper: Helper | None) -> bool:
    """:func:`zckpt.run.engines.overlap_for`, except that auto (``None``) is off beside a helper:
    each process then has one core, and a second thread per task only contends."""
    return False if helper is not None and flag is None else engines.overlap_for(flag, client)


def share_from(sizes: Sequence[int], step: int = 1) -> int:
    """Where the helper's share of units of these sizes begins: the units from there on hold
    about half the bytes, and the border falls on a multiple of ``step``. ``len(sizes)``
    when the helper would get nothing."""
    total = sum(sizes)
    done = 0
    for i in range(0, len(sizes), step):
        if done * 2 >= total:
            return i
        done += sum(sizes[i:i + step])
    return len(sizes)


def package_root() -> Path:
    """The folder holding this ``zckpt`` package, wherever it was imported from (an install,
    a checkout on ``sys.path``): the helper must import the same code."""
    return Path(__file__).resolve().parents[2]


class Helper:
    """The helper process, started at once so that its imports overlap the caller's work:
    :meth:`submit` one call, :meth:`result` waits for it; leaving the context ends the
    process (killed if it is still running: the caller failed or was interrupted)."""

    def __init__(self, warm: Sequence[str] = ()) -> None:
        env = dict(os.environ)
        root = str(package_root())
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-m", "zckpt.run.helper", str(os.getpid()), *warm],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._submitted = False
        self._sending: threading.Thread | None = None

    def submit(self, fn: Callable[..., R], *args: Any) -> None:
        """Send the call (``fn`` must be a module-level function); at most one per helper.

        The call is pickled here, and sent on a thread: the helper reads it only once its
        own imports are done, and the pipe holds 64 KiB, so sending from here kept the
        caller from its own share of the work meanwhile (a 256-source transform: 6 MB,
        0.5 s waiting beside 0.2 s of pickling)."""
        if self._submitted:
            raise RuntimeError("a helper runs one call")
        self._submitted = True
        stdin = self.proc.stdin
        assert stdin is not None
        data = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        self._sending = threading.Thread(target=_send, args=(stdin, data), name="zckpt-helper-send", daemon=True)
        self._sending.start()

    def result(self) -> Any:
        """The call's result; its exception is raised here as the helper raised it."""
        if self._sending is not None:
            self._sending.join()
        stdout = self.proc.stdout
        assert stdout is not None
        try:
            kind, value = pickle.load(stdout)
        except (EOFError, pickle.UnpicklingError):
            code = self.proc.wait()
            raise ZckptError(f"the helper process ended without a result (exit status {code})") from None
        self.proc.wait()
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self._sending is not None:
            self._sending.join()  # the helper is gone: a write still under way fails at once
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()

    def __enter__(self) -> Helper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _send(stdin: IO[bytes], data: bytes) -> None:
    """Write a pickled call to the helper and close its input (on :meth:`Helper.submit`'s thread)."""
    try:
        stdin.write(data)
        stdin.close()
    except OSError:
        pass  # the helper ended early: result() says how


def _answer(out: IO[bytes], kind: str, value: object) -> None:
    try:
        data = pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an exception that cannot cross: its class and message still do
        data = pickle.dumps(("error", ZckptError(f"{type(value).__name__}: {value}")))
    out.write(data)
    out.flush()


def _end_with(parent: int) -> None:
    """Linux: be killed when the process that started this one ends (killed mid-ingest, its
    rerun must not meet a helper still writing into the store)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it ended before the request was made
        os._exit(1)


def main(argv: Sequence[str]) -> int:
    if sys.platform.startswith("linux"):
        _end_with(int(argv[0]))
    for name in argv[1:]:
        importlib.import_module(name)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # the call's prints must not mix with the result
    with fewer_collections():  # the call's arguments are a plan's many small values
        try:
            fn, args = pickle.load(sys.stdin.buffer)
        except EOFError:
            return 0  # not needed after all
        try:
            result = fn(*args)
        except BaseException as err:  # noqa: BLE001 - every failure goes back to the caller
            _answer(out, "error", err)
            return 1
        _answer(out, "ok", result)
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
