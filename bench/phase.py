"""Run one benchmark phase in this process and print its cost as JSON.

Each phase runs in its own process so that peak RSS and I/O counters
(/proc/self/io rchar/wchar) belong to that phase alone. Peak RSS is ``VmHWM`` of
/proc/self/status, the high-water mark of this program's own memory: ``ru_maxrss`` would
also count what the parent held when it forked this process (Linux keeps it across
``exec``), which put a floor of 121 MiB under every phase the benchmark started.

usage: python bench/phase.py ingest SRC STRATEGY STORE [WORKERS] [--max-mem SIZE] [--overlap|--no-overlap]
       python bench/phase.py export STORE STRATEGY OUT [WORKERS [READER]] [--max-mem SIZE] [--overlap|--no-overlap]
       python bench/phase.py transform SRC SRC_STRATEGY DST_STRATEGY OUT [WORKERS] [--max-mem SIZE] [--overlap|...]
       python bench/phase.py mindspore SRC OUT SRC_STRATEGY DST_STRATEGY   (MindSpore's python)
       python bench/phase.py copy SRC OUT
       python bench/phase.py copy2 SRC OUT   (two cp processes at once, each on half the bytes)
       python bench/phase.py cli ARGS...     (``zckpt ARGS...``, the command line in this process)

``import_seconds`` is the part of the wall time spent importing zckpt (numpy, zarr, dask...):
with a cold cache, the Python libraries come from the disk too.
``cpu_seconds`` is the user + system CPU time of the phase (and of the processes it waited for).
``--profile FILE`` saves a cProfile of the phase (after the imports; Dask worker processes are
not profiled: use 1 worker).
``--sync`` ends the timed part with ``sync`` (every phase's bytes on the disk, as ``cp -r && sync``).
An empty strategy argument means none (unsharded). Besides the counted bytes, ``disk_read_bytes``
and ``disk_write_bytes`` are what the phase made the block layer read and write (``read_bytes`` and
``write_bytes`` of /proc/self/io: with a cold cache, the bytes that really came from the disk).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path


def _io() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    except OSError:
        pass
    return out


def _cpu() -> float:
    """User + system CPU seconds of this process and its reaped children: unlike wall time,
    hardly changed by other work on the machine."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _max_mem(args: list[str]) -> tuple[list[str], int]:
    """Strip a trailing ``--max-mem SIZE`` (default 1 GiB)."""
    if "--max-mem" in args:
        i = args.index("--max-mem")
        from zckpt.cli.args import parse_size

        return args[:i] + args[i + 2 :], parse_size(args[i + 1])
    return args, 1024**3


def _high_water() -> int:
    """Peak resident bytes of this process since its ``exec`` (``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssWatch:
    """Samples the process's resident memory by kind (anonymous, file-mapped, shared
    memory) every 20 ms and keeps the sample of the largest total: what the peak was made of."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            now: dict[str, int] = {}
            for line in Path("/proc/self/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    now[key] = int(value.split()[0]) * 1024
            if now.get("VmRSS", 0) > self.peak.get("VmRSS", 0):
                self.peak = now

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def _pairs(files: list[Path], src: Path, out: Path) -> list[str]:
    return [str(x) for f in files for x in (f, out / f.relative_to(src))]


def _copy_in_two(src: Path, out: Path) -> None:
    """Copy a tree with two ``cp`` processes at once, files dealt largest first to the
    lighter half: what two cores can copy, the bound for two export workers."""
    files = sorted((f for f in src.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size, reverse=True)
    halves: list[list[Path]] = [[], []]
    sizes = [0, 0]
    for f in files:
        i = sizes.index(min(sizes))
        halves[i].append(f)
        sizes[i] += f.stat().st_size
    for f in files:
        (out / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
    script = 'while [ $# -gt 0 ]; do cp "$1" "$2" || exit 1; shift 2; done'
    procs = [subprocess.Popen(["sh", "-c", script, "sh", *_pairs(half, src, out)])
             for half in halves if half]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("cp failed")


def main(argv: list[str]) -> None:
    phase, args = argv[0], argv[1:]
    if phase in ("ingest", "export", "transform", "cli"):  # in the process the ``zckpt`` program makes
        from zckpt.cli.main import ONE_THREAD  # (zckpt.cli.main.run): BLAS on one thread, set before numpy's import

        for name in ONE_THREAD:
            os.environ.setdefault(name, "1")
    overlap = False if "--no-overlap" in args else True if "--overlap" in args else None
    sync = "--sync" in args
    profile: str | None = None
    if "--profile" in args:  # cProfile of the phase, saved for ``python -m pstats FILE``
        i = args.index("--profile")
        profile, args = args[i + 1], args[:i] + args[i + 2:]
    args = [x for x in args if x not in ("--no-overlap", "--overlap", "--sync")]
    args, max_mem = _max_mem(args)
    counted: int | None = None  # bytes read as zckpt counts them (rchar misses mmap and copy_file_range)
    io0 = _io()
    cpu0 = _cpu()
    watch = RssWatch()
    t0 = time.perf_counter()
    if phase in ("ingest", "export", "cli"):  # the time of Python's imports, part of the wall time
        import importlib

        import zckpt.cli.main  # noqa: F401

        # what the phase runs (a command imports only its own modules: transform never loads Zarr)
        command = args[0] if phase == "cli" and args else phase
        if command in ("ingest", "export", "transform"):
            importlib.import_module(f"zckpt.jobs.{command}")
    import_seconds = time.perf_counter() - t0
    prof = None
    if profile is not None:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    if phase == "ingest":
        from zckpt.jobs.ingest import IngestOptions, ingest
        from zckpt.run.engines import memory_budget

        b = memory_budget(max_mem)
        workers = int(args[3]) if len(args) > 3 else 1
        rep = ingest(args[0], args[2], args[1] or None,
                     IngestOptions(block_bytes=b.block_bytes, chunk_bytes=b.chunk_bytes, workers=workers,
                                   overlap=overlap))
        counted = rep.bytes_written + rep.bytes_compared  # each source byte of a written box, read once
    elif phase == "export":
        from zckpt.jobs.export import export
        from zckpt.jobs.export_job import ExportOptions
        from zckpt.run.engines import memory_budget

        workers = int(args[3]) if len(args) > 3 else 1
        reader = args[4] if len(args) > 4 else "zarr"
        opts = ExportOptions(workers=workers, reader=reader, block_bytes=memory_budget(max_mem).block_bytes,
                             overlap=overlap)
        counted = export(args[0], args[2], args[1] or None, options=opts).bytes_read
    elif phase == "transform":  # the direct path: source shards -> destination files, no store
        from zckpt.jobs.transform import TransformOptions, transform
        from zckpt.run.engines import memory_budget

        workers = int(args[4]) if len(args) > 4 else 1
        topts = TransformOptions(workers=workers, block_bytes=memory_budget(max_mem).block_bytes, overlap=overlap)
        counted = transform(args[0], args[3], args[1] or None, args[2] or None, options=topts).bytes_read
    elif phase == "mindspore":
        import mindspore as ms

        ms.transform_checkpoints(args[0], args[1], "checkpoint_", args[2] or None, args[3] or None)
    elif phase == "copy":  # the coreutils command itself, as a user would run it
        subprocess.run(["cp", "-r", args[0], args[1]], check=True)  # its I/O counts join ours once reaped
    elif phase == "copy2":
        _copy_in_two(Path(args[0]), Path(args[1]))
    elif phase == "cli":
        from zckpt.cli.main import main as cli_main

        code = cli_main(args)
        if code:
            raise SystemExit(f"zckpt {' '.join(args)} exited with {code}")
    else:
        raise SystemExit(f"unknown phase {phase}")
    if sync:
        os.sync()
    seconds = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    cpu_seconds = _cpu() - cpu0
    rss_at_peak = watch.stop()
    io1 = _io()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps({
        "phase": phase,
        "seconds": seconds,
        "import_seconds": import_seconds,
        "cpu_seconds": cpu_seconds,
        "max_rss_bytes": _high_water(),
        "max_child_rss_bytes": children,
        "read_chars": io1.get("rchar", 0) - io0.get("rchar", 0) if counted is None else counted,
        "write_chars": io1.get("wchar", 0) - io0.get("wchar", 0),
        "disk_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
        "disk_write_bytes": io1.get("write_bytes", 0) - io0.get("write_bytes", 0),
        "rss_at_peak": rss_at_peak,
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
