"""Whole files read into the page cache before their reader gets to them, on a thread.

Planning a job from its shards walks each file's headers, which lie between its payloads, and
the copy that follows reads the payloads: with a cold page cache, asking the kernel first
(``posix_fadvise(WILLNEED)``) turns thousands of small synchronous reads into a few large ones,
and lets the disk work while the plan is made. Linux reads at most one read-ahead window per
such call (the larger of the device's ``read_ahead_kb`` and ``max_sectors_kb``: 8 MiB on the
machine of bench/RESULTS.md), so a file is asked for window by window: one call for a whole
132 MiB shard read its first 8 MiB, and the disk stayed idle through 1.5 s of planning. The
calls block while the device's queue is full (2.1 GiB: 1.0 s of calls), hence the thread; it
holds no memory of its own (only the page cache holds the bytes) and ends when every file was
asked for, or when :meth:`ReadAhead.stop` is called.

Its reads are of the idle I/O class (``ioprio_set`` of this thread alone, where Linux's system
call number is known here): a reader that gets ahead of it, or reads in another order, is
served first instead of queueing behind hundreds of read-ahead requests. A 2 GiB export to one
file, bound by its one writing process, waited so with CPUs idle and took 2.58-2.98 s against
2.46-2.60 s without read-ahead; with the idle class, 2.31-2.72 s against 2.78-2.88 s.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from collections.abc import Sequence
from pathlib import Path

from zckpt.io.fileio import available_memory

FALLBACK_BYTES = 128 * 1024
"""What one call is assumed to read where the device's limits are not known (Linux's
default read-ahead window): smaller steps than the kernel's cap cost calls, never bytes."""

MAX_BYTES = 64 * 1024 * 1024
"""The largest step, whatever the device reports."""


IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "riscv64": 30, "loongarch64": 30, "ppc64le": 273, "s390x": 282}
"""Linux's ``ioprio_set`` system call number by machine (Python has no wrapper)."""

_IDLE = 3 << 13
"""``IOPRIO_PRIO_VALUE(IOPRIO_CLASS_IDLE, 0)``."""


def idle_io() -> bool:
    """Put the calling thread's reads in the idle I/O class; whether that was done."""
    number = IOPRIO_SET.get(platform.machine())
    if number is None or not hasattr(os, "posix_fadvise"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(number, 1, 0, _IDLE)) == 0  # IOPRIO_WHO_PROCESS, 0: this thread
    except (OSError, AttributeError):
        return False


def request_bytes(fd: int) -> int:
    """The most one ``WILLNEED`` of ``fd`` makes the kernel read: the larger of its device's
    read-ahead window and largest request (``/sys/dev/block/M:m/queue``, the disk's for a
    partition), or :data:`FALLBACK_BYTES`."""
    try:
        st = os.fstat(fd)
        base = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
        queue = base / "queue" if (base / "queue").is_dir() else base.parent / "queue"
        kib = max(int((queue / "read_ahead_kb").read_text()), int((queue / "max_sectors_kb").read_text()))
    except (OSError, ValueError):
        return FALLBACK_BYTES
    return min(MAX_BYTES, max(FALLBACK_BYTES, kib * 1024))


class ReadAhead:
    """The thread asking for ``paths``, in their order, window by window."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self._paths = list(paths)
        self._stop = threading.Event()
        self.asked = 0
        """Bytes asked for so far (for tests)."""
        self.idle = False
        """Whether the thread's reads are of the idle I/O class."""
        self._thread = threading.Thread(target=self._run, name="zckpt-read-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.idle = idle_io()
        for p in self._paths:
            if self._stop.is_set():
                return
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue  # only a hint: the reader reports the file by name
            try:
                self._ask(fd)
            except OSError:
                pass
            finally:
                os.close(fd)

    def _ask(self, fd: int) -> None:
        size, step = os.fstat(fd).st_size, request_bytes(fd)
        for offset in range(0, size, step):
            if self._stop.is_set():
                return
            n = min(step, size - offset)
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)
            self.asked += n

    def stop(self) -> None:
        """Ask for nothing more (a call under way ends first)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def read_soon(paths: Sequence[Path], share: float = 0.25) -> ReadAhead | None:
    """Start reading whole files about to be read (:class:`ReadAhead`), when together they fit
    in ``share`` of the available memory; ``None`` where it did not (larger jobs are left to
    the kernel's own read-ahead as they are read, a file missing is reported by its reader).

    At 512 ranks the headers of 512 files took 2.7-3.4 s walked cold, 1.2-1.5 s once asked
    for first, on a shared machine."""
    if not hasattr(os, "posix_fadvise"):
        return None
    sizes = []
    for p in paths:
        try:
            sizes.append(os.stat(p).st_size)
        except OSError:
            return None
    room = available_memory()
    if room is None or sum(sizes) > room * share:
        return None
    return ReadAhead(paths)
