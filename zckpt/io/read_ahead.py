"""Source and store files read into the page cache before their reader gets to them: whole
files on a thread (:class:`ReadAhead`), or the headers of many files at once (:func:`read_headers`).

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

import contextlib
import ctypes
import itertools
import os
import platform
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

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
    if number is None or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(number, 1, 0, _IDLE)) == 0  # IOPRIO_WHO_PROCESS, 0: this thread
    except (OSError, AttributeError):
        return False


def request_bytes(device: int) -> int:
    """The most one ``WILLNEED`` makes the kernel read of a file on ``device`` (``st_dev``): the
    larger of the device's read-ahead window and largest request (``/sys/dev/block/M:m/queue``,
    the disk's for a partition), or :data:`FALLBACK_BYTES`."""
    try:
        base = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}").resolve()
        queue = base / "queue" if (base / "queue").is_dir() else base.parent / "queue"
        kib = max(int((queue / "read_ahead_kb").read_text()), int((queue / "max_sectors_kb").read_text()))
    except (OSError, ValueError):
        return FALLBACK_BYTES
    return min(MAX_BYTES, max(FALLBACK_BYTES, kib * 1024))


Order = Literal["files", "together", "starts"]
"""How a job reads its files after planning, and so the order they are asked for in:
``"files"`` every byte, file after file (an ingest copies rank after rank); ``"together"``
every byte, every file at the same pace (a transform reads each tensor from all the shards
that hold part of it); ``"starts"`` only what lies near each file's start, one window each
(a dry run, a plan, one rank's slice: the headers of small files, as the kernel reads them
for one call)."""


class ReadAhead:
    """The thread asking for ``paths`` window by window, in ``order``; one file open at a time
    (a job of thousands of files keeps its descriptors)."""

    def __init__(self, paths: Sequence[Path], order: Order = "files") -> None:
        self._paths = list(paths)
        self.order = order
        self._stop = threading.Event()
        self.asked = 0
        """Bytes asked for so far (for tests)."""
        self.idle = False
        """Whether the thread's reads are of the idle I/O class."""
        self._thread = threading.Thread(target=self._run, name="zckpt-read-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.idle = idle_io()
        fd, current = -1, None
        try:
            for path, offset, n in windows(self._paths, self.order):
                if self._stop.is_set():
                    return
                if path != current:
                    if fd >= 0:
                        os.close(fd)
                    fd, current = -1, path
                    with contextlib.suppress(OSError):  # only a hint: the reader reports the file by name
                        fd = os.open(path, os.O_RDONLY)
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)
                        self.asked += n
        finally:
            if fd >= 0:
                os.close(fd)

    def stop(self) -> None:
        """Ask for nothing more (a call under way ends first)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def windows(paths: Sequence[Path], order: Order) -> list[tuple[Path, int, int]]:
    """``(file, offset, length)`` of each call, in ``order`` (files that are gone left out)."""
    files: list[tuple[Path, int, int]] = []
    steps: dict[int, int] = {}  # by device: one look at /sys, not one per file
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        step = steps.get(st.st_dev)
        if step is None:
            step = steps[st.st_dev] = request_bytes(st.st_dev)
        files.append((p, st.st_size, step))
    per_file = [[(p, o, min(step, size - o)) for o in range(0, size, step)] for p, size, step in files]
    if order == "starts":
        return [w[0] for w in per_file if w]
    if order == "files":
        return [x for w in per_file for x in w]
    return [x for row in itertools.zip_longest(*per_file) for x in row if x is not None]


def read_soon(paths: Sequence[Path], share: float = 0.25, order: Order = "files") -> ReadAhead | None:
    """Start reading files about to be read (:class:`ReadAhead`, in ``order``), when together
    they fit in ``share`` of the available memory; ``None`` where it did not (larger jobs are
    left to the kernel's own read-ahead as they are read, a file missing is reported by its
    reader).

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
    return ReadAhead(paths, order)


def read_headers(paths: Sequence[Path], spans: Sequence[tuple[int, int]]) -> None:
    """Ask for the byte ranges ``spans`` (offset, length) of every file, all before any is
    read, in this thread (at the job's own priority: it waits for them next). Walked alone,
    the headers of large entries are one small read at a time, each waiting for the last (16
    shards of 282 entries: 0.25 s cold); asked for together, the disk serves them side by side
    (0.10 s). The spans come from a file walked first: shards of one job lay out their
    entries alike, and a file laid out otherwise costs a few pages read in vain."""
    if not hasattr(os, "posix_fadvise"):
        return
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            for offset, n in spans:
                os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
