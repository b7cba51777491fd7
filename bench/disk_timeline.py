"""When a phase waits for the disk and when for the CPU: a timeline of one command.

Issue 27 asks, where a shape stays above 1.2x ``cp -r && sync``, to show where the limit is.
:mod:`where_time_goes` says what the CPU time is spent on; this says *when* the disk and the
CPUs were busy: every ``--interval`` seconds it reads the block device's counters
(``/proc/diskstats``: bytes read and written, and the time the device had requests in flight)
and the CPU time of the machine and of each process of the command (``/proc/<pid>/stat``). A
phase whose disk is busy nearly all the time is bound by the disk; one whose busiest process
runs nearly a whole core (Python's interpreter lock) by that process; one with neither waits
on something else (latency: one read at a time, a pipeline stage idle). The same command
line for ``cp -r SRC DST`` shows the yardstick's own pattern (on the machine of
bench/RESULTS.md: every byte read first, then written back at the final ``sync``).

    python bench/disk_timeline.py --cold -- python -m zckpt.cli transform SRC ... --out OUT
    python bench/disk_timeline.py --cold -- cp -r SRC OUT

Each run ends with ``sync`` (timed, like every phase of the benchmark). ``--cold`` drops the
page cache first (root only). Linux only: it reads ``/proc``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib import drop_caches  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Sample:
    """Counters at one instant: seconds since the start, the device's bytes read and written
    and milliseconds busy, the machine's busy and idle CPU ticks, and the CPU ticks of the
    command's busiest process so far in this interval (per process, since the last sample)."""

    t: float
    read: int
    written: int
    busy_ms: int
    cpu_busy: int
    cpu_idle: int
    top_ticks: int


@dataclass(frozen=True)
class Summary:
    wall_s: float
    read_mib: float
    written_mib: float
    first_write_s: float | None
    disk_busy: float
    """Share of the wall time the device had requests in flight (``io_ticks``)."""
    cpu_machine: float
    """Share of all CPUs busy (any process)."""
    top_process: float
    """Mean over intervals of the busiest process's CPU (all its threads; 1.0 = one CPU)."""


def device_of(path: Path) -> str | None:
    """The block device (as named in ``/proc/diskstats``) holding ``path``, or ``None``."""
    try:
        st = os.stat(path)
        name = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve().name
    except OSError:
        return None
    return name if any(line.split()[2] == name for line in _lines("/proc/diskstats")) else None


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text(encoding="ascii").splitlines()
    except OSError:
        return []


def _disk(device: str | None) -> tuple[int, int, int]:
    for line in _lines("/proc/diskstats") if device else []:
        f = line.split()
        if f[2] == device:
            return int(f[5]) * 512, int(f[9]) * 512, int(f[12])
    return 0, 0, 0


def _cpu() -> tuple[int, int]:
    f = [int(x) for x in _lines("/proc/stat")[0].split()[1:8]]
    return f[0] + f[1] + f[2] + f[5] + f[6], f[3] + f[4]


def _tree_ticks(root: int) -> dict[int, int]:
    """User + system ticks of ``root`` and every process below it."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _lines(f"/proc/{entry}/stat")
        if not stat:
            continue
        f = stat[0].rsplit(")", 1)[1].split()
        parents[int(entry)] = int(f[1])
        ticks[int(entry)] = int(f[11]) + int(f[12])
    out = {}
    for pid, t in ticks.items():
        p = pid
        while p > 1 and p != root:
            p = parents.get(p, 0)
        if p == root:
            out[pid] = t
    return out


def record(argv: list[str], device: str | None, interval: float) -> tuple[int, list[Sample]]:
    """Run ``argv`` then ``sync``; the samples taken every ``interval`` seconds and the exit code."""
    t0 = time.perf_counter()
    samples = [Sample(0.0, *_disk(device), *_cpu(), 0)]
    proc = subprocess.Popen(argv)
    last: dict[int, int] = {}
    code: int | None = None
    while True:
        time.sleep(interval)
        code = proc.poll() if code is None else code
        now = _tree_ticks(proc.pid) if code is None else {}
        top = max((t - last.get(pid, 0) for pid, t in now.items()), default=0)
        last.update(now)
        samples.append(Sample(time.perf_counter() - t0, *_disk(device), *_cpu(), top))
        if code is not None:
            break
    os.sync()
    samples.append(Sample(time.perf_counter() - t0, *_disk(device), *_cpu(), 0))
    return code, samples


def summarise(samples: list[Sample], interval: float) -> Summary:
    """The run's totals from its samples (pure)."""
    first, end = samples[0], samples[-1]
    wall = end.t - first.t
    writes = [s.t for s, prev in zip(samples[1:], samples, strict=False) if s.written > prev.written]
    cpu = (end.cpu_busy - first.cpu_busy) / max(1, end.cpu_busy - first.cpu_busy + end.cpu_idle - first.cpu_idle)
    tops = [s.top_ticks / TICK / interval for s in samples[1:-1]]
    return Summary(
        wall_s=round(wall, 3),
        read_mib=round((end.read - first.read) / 2**20, 1),
        written_mib=round((end.written - first.written) / 2**20, 1),
        first_write_s=round(writes[0], 2) if writes else None,
        disk_busy=round(min(1.0, (end.busy_ms - first.busy_ms) / 1000 / wall), 2) if wall > 0 else 0.0,
        cpu_machine=round(cpu, 2),
        top_process=round(sum(tops) / len(tops), 2) if tops else 0.0,
    )


def rows(samples: list[Sample], every: int) -> list[str]:
    """One line per ``every`` samples: MiB/s read and written, disk busy, CPU busy, busiest process."""
    out = []
    for a in range(0, len(samples) - 1, every):
        s0, s1 = samples[a], samples[min(a + every, len(samples) - 1)]
        dt = max(1e-9, s1.t - s0.t)
        rd, wr = (s1.read - s0.read) / 2**20 / dt, (s1.written - s0.written) / 2**20 / dt
        busy = min(1.0, (s1.busy_ms - s0.busy_ms) / 1000 / dt)
        cb, ci = s1.cpu_busy - s0.cpu_busy, s1.cpu_idle - s0.cpu_idle
        top = max((s.top_ticks for s in samples[a + 1 : a + every + 1]), default=0) / TICK / (dt / every)
        out.append(f"{s1.t:6.2f} s  read {rd:6.0f} MiB/s  write {wr:6.0f} MiB/s  disk busy {busy:4.0%}  "
                   f"CPUs {cb / max(1, cb + ci):4.0%}  busiest process {min(top, 9.99):4.0%} of a CPU  "
                   f"{'R' * int(rd / 100)}{'W' * int(wr / 100)}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold", action="store_true", help="drop the page cache first (root only)")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between samples")
    ap.add_argument("--every", type=int, default=2, help="samples per printed line")
    ap.add_argument("--device", help="block device as in /proc/diskstats (default: the one holding the cwd)")
    ap.add_argument("--json-out", type=Path, help="write the summary and the samples here")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command line")
    a = ap.parse_args()
    argv = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not argv:
        ap.error("give the command after --")
    device = a.device or device_of(Path.cwd())
    if a.cold and not drop_caches():
        print("page cache not dropped (not root): the figures are warm", file=sys.stderr)
    code, samples = record(argv, device, a.interval)
    print("\n".join(rows(samples, max(1, a.every))))
    summary = summarise(samples, a.interval)
    figures = ", ".join(f"{k} {v}" for k, v in asdict(summary).items())
    print(f"device {device or 'unknown (no disk figures)'}: {figures}")
    if a.json_out:
        a.json_out.write_text(json.dumps({"command": argv, "device": device, "summary": asdict(summary),
                                          "samples": [asdict(s) for s in samples]}, indent=1), encoding="utf-8")
    return code


if __name__ == "__main__":
    sys.exit(main())
