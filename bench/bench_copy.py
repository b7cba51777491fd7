"""The byte path of ingest alone: copying runs of one file into another with their CRC-32C.

usage: python bench/bench_copy.py [--size 256M] [--runs 1M,64K] [--threads 1,2] [--shift 0,13]
                                  [--repeat 5] [--dir DIR]

Copies a page-cached file of ``--size`` into a preallocated (sparse) file in runs of each
``--runs`` size, on 1 or 2 threads (ingest copies on two), summing 256 KiB blocks of every
run, as ``zckpt ingest`` does for each run of a shard. ``--shift`` moves the destination
offsets by that many bytes (a ``.ckpt`` payload and an inner chunk seldom share an
alignment). Two ways are compared:

* ``read+write``: :func:`zckpt.io.fileio.copy_range_at`, one read into a buffer, sums, one
  ``pwrite`` (what ingest does);
* ``kernel+read``: ``copy_file_range`` of the run, then a second read of it for the sums
  (what ingest did before).

With ``--no-sums`` nothing is summed and the ways are ``read+write`` (through the buffer) and
``kernel`` (``copy_file_range`` alone): the choice of a ``.ckpt`` writer copying a range
nothing checks (the direct path), where the shift is the page phase between the range and
the file's end.

Prints the CPU seconds of the process (user + system, minimum and median of ``--repeat``)
and the median wall time. The file is copied warm (in the page cache): this measures the
CPU each way costs, not the disk.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import MiB, machine  # noqa: E402

from zckpt.io import fileio  # noqa: E402
from zckpt.io.checksums import BLOCK_BYTES, BlockSummer, Sink  # noqa: E402

Copy = Callable[[int, int, int, int, int, bytearray, Sink | None], None]


def kernel_then_read(src: int, dst: int, offset: int, length: int, at: int, buf: bytearray, sink: Sink) -> None:
    """The previous way: the kernel copies the run, then it is read again for the sums."""
    kernel_only(src, dst, offset, length, at, buf, None)
    view = memoryview(buf)
    done = 0
    while done < length:
        n = os.preadv(src, [view[: min(len(view), length - done)]], offset + done)
        if n == 0:
            raise OSError(f"source ended after {done} of {length} bytes")
        sink(offset + done, view[:n])
        done += n


def kernel_only(src: int, dst: int, offset: int, length: int, at: int, buf: bytearray, sink: Sink | None) -> None:
    """The kernel copies the run; nothing reads it (an unchecked range)."""
    done = 0
    while done < length:
        n = os.copy_file_range(src, dst, length - done, offset + done, at + done)
        if n <= 0:
            raise OSError("copy_file_range copied nothing")
        done += n


WAYS: dict[str, Copy] = {"read+write": fileio.copy_range_at, "kernel+read": kernel_then_read}
UNSUMMED: dict[str, Copy] = {"read+write": fileio.copy_range_at, "kernel": kernel_only}


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def copy_all(copy: Copy, src: int, dst: int, size: int, run: int, threads: int, shift: int,
             summed: bool = True) -> list[list[int]]:
    """Every run of the file copied (runs dealt to the threads in turn); the sums of each run
    (none unless ``summed``)."""
    starts = list(range(0, size - shift, run))
    sums: list[list[int]] = [[] for _ in starts]

    def work(mine: range) -> None:
        buf = bytearray(fileio.BLOCK)
        for i in mine:
            summer = BlockSummer(BLOCK_BYTES, starts[i])
            copy(src, dst, starts[i], min(run, size - shift - starts[i]), starts[i] + shift, buf,
                 summer.feed if summed else None)
            sums[i] = summer.result() if summed else []

    pool = [threading.Thread(target=work, args=(range(t, len(starts), threads),)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sums


def parse_size(text: str) -> int:
    from zckpt.cli.args import parse_size as parse

    return parse(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256M")
    ap.add_argument("--runs", default="1M,64K,16M")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shift", default="0,13")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    ap.add_argument("--no-sums", action="store_true", help="copy unchecked ranges: read+write against the kernel alone")
    a = ap.parse_args()
    size = parse_size(a.size)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        root = Path(tmp)
        src_path, dst_path = root / "src", root / "dst"
        with open(src_path, "wb") as f:
            for _ in range(0, size, 16 * MiB):
                f.write(os.urandom(min(16 * MiB, size - f.tell())))
        what = "no sums" if a.no_sums else "256 KiB CRC-32C blocks"
        print(f"{size / MiB:.0f} MiB copied warm in runs, {what}; {machine(root)}")
        print(f"{'runs':>6} {'threads':>7} {'shift':>5} {'way':>12} {'CPU s min':>9} {'median':>7} {'wall s':>7}")
        src = os.open(src_path, os.O_RDONLY)
        try:
            for run in (parse_size(r) for r in a.runs.split(",")):
                for threads in (int(t) for t in a.threads.split(",")):
                    for shift in (int(s) for s in a.shift.split(",")):
                        measure(src, dst_path, size, run, threads, shift, a.repeat, not a.no_sums)
        finally:
            os.close(src)


def measure(src: int, dst_path: Path, size: int, run: int, threads: int, shift: int, repeat: int,
            summed: bool = True) -> None:
    """Each way ``repeat`` times, alternated; their sums must agree."""
    ways = WAYS if summed else UNSUMMED
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    first: list[list[int]] | None = None
    for _ in range(repeat):
        for name, copy in ways.items():
            dst_path.unlink(missing_ok=True)
            dst = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                os.pwrite(dst, b"\0", size + shift)  # the preallocated shard file: sparse until written
                c0, t0 = cpu(), time.perf_counter()
                sums = copy_all(copy, src, dst, size, run, threads, shift, summed)
                got[name].append((cpu() - c0, time.perf_counter() - t0))
            finally:
                os.close(dst)
            os.sync()  # the next copy does not pay for this one's write-back
            if first is None:
                first = sums
            elif sums != first:
                raise SystemExit(f"{name} summed other bytes than the first way")
    for name, xs in got.items():
        c = [x[0] for x in xs]
        print(f"{run // 1024:>5}K {threads:>7} {shift:>5} {name:>12} {min(c):>9.3f} {statistics.median(c):>7.3f} "
              f"{statistics.median(x[1] for x in xs):>7.3f}", flush=True)


if __name__ == "__main__":
    main()
