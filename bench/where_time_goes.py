"""Where a phase's CPU time goes: the kernel's page-cache copies, the rest of the kernel, the
Python interpreter, copies in user space, checksums, numpy, other — measured by ``perf``.

Issue 27 asks, where a shape stays above 1.2x ``cp -r && sync`` on 2 cores, to show with a
profile where the limit is. ``cProfile`` and py-spy see only Python frames (py-spy puts a
system call's kernel time on the Python line that made it); ``perf record`` samples every
thread of the phase and its helper processes in user and kernel space alike, so the bytes'
own cost (``copy_to_iter`` / ``copy_folio_from_iter``: the kernel copying between the page
cache and user buffers, which ``cp`` pays too) stands apart from zckpt's per-piece work.

    python bench/where_time_goes.py --cold -- export STORE --strategy DST --out OUT
    python bench/where_time_goes.py --cold --cp SRC OUT        # the yardstick, the same way

Needs ``perf`` and permission to sample the kernel (root, or ``kernel.perf_event_paranoid``
<= 1). Output removed before each run is the caller's business (the phase refuses to write
over a finished directory of another job). Prints one table: wall, CPU and the share of
samples per category.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib import drop_caches  # noqa: E402

KERNEL_COPIES = ("copy_folio_from_iter", "_copy_to_iter", "copy_page_to_iter", "copy_user", "copy_to_user",
                 "copy_from_user", "rep_movs", "clear_page", "memcpy", "memmove")
"""Kernel symbols that move a file's bytes: between the page cache and user memory, from page
to page (``cp``'s ``copy_file_range``), or zero new pages."""

CATEGORIES = ("kernel: page-cache copies", "kernel: other", "python interpreter", "user copies (memmove)",
              "checksums (crc32c)", "numpy", "other")


def category(dso: str, sym: str) -> str:
    """The category of one sample's DSO and symbol."""
    if dso.startswith("[kernel"):
        return CATEGORIES[0] if any(k in sym for k in KERNEL_COPIES) else CATEGORIES[1]
    if "libpython" in dso or dso.startswith("python"):
        return CATEGORIES[2]
    if "memmove" in sym or "memcpy" in sym:
        return CATEGORIES[3]
    if "crc32c" in dso or "crc32" in sym.lower():
        return CATEGORIES[4]
    if "_multiarray" in dso or "numpy" in dso:
        return CATEGORIES[5]
    return CATEGORIES[6]


def shares(report: str) -> dict[str, float]:
    """Per category, the percentage of samples in ``perf report --sort dso,sym`` text."""
    out: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    for line in report.splitlines():
        parts = line.split()
        if len(parts) < 4 or not parts[0].endswith("%"):
            continue
        try:
            pct = float(parts[0][:-1])
        except ValueError:
            continue
        dso, sym = parts[1], " ".join(parts[3:])
        out[category(dso, sym)] += pct
    return out


def profile(cmd: list[str], cold: bool) -> tuple[float, float, dict[str, float]]:
    """Run ``cmd`` under ``perf record``: wall seconds, CPU seconds, category shares."""
    if cold and not drop_caches():
        raise SystemExit("--cold needs root (echo 3 > /proc/sys/vm/drop_caches)")
    with tempfile.TemporaryDirectory(prefix="zckpt-perf-") as tmp:
        data = Path(tmp) / "perf.data"
        t = time.perf_counter()
        proc = subprocess.run(["perf", "record", "-q", "-F", "999", "-o", str(data), "--", "/usr/bin/time", "-f",
                               "%U %S", "-o", str(Path(tmp) / "cpu"), *cmd, ], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, check=False)
        subprocess.run(["sync"], check=True)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        user, system = (float(x) for x in (Path(tmp) / "cpu").read_text().split()[-2:])
        report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym",
                                 "--stdio", "-g", "none"], capture_output=True, text=True, check=True).stdout
    return wall, user + system, shares(report)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cold", action="store_true", help="drop the page cache first (root)")
    ap.add_argument("--cp", nargs=2, metavar=("SRC", "OUT"), help="profile cp -r SRC OUT instead")
    ap.add_argument("--label", default="", help="name of the row")
    ap.add_argument("zckpt", nargs=argparse.REMAINDER, help="-- then the zckpt command line")
    a = ap.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed")
    if a.cp:
        cmd = ["cp", "-r", *a.cp]
    else:
        args = a.zckpt[1:] if a.zckpt[:1] == ["--"] else a.zckpt
        if not args:
            raise SystemExit("give a zckpt command line after --, or --cp SRC OUT")
        cmd = [sys.executable, "-m", "zckpt.cli", *args]
    wall, cpu, got = profile(cmd, a.cold)
    label = a.label or ("cp" if a.cp else a.zckpt[1] if a.zckpt[:1] == ["--"] else a.zckpt[0])
    print("| run | wall s | CPU s | " + " | ".join(CATEGORIES) + " |")
    print("|---|---:|---:|" + "---:|" * len(CATEGORIES))
    print(f"| {label} | {wall:.2f} | {cpu:.2f} | " + " | ".join(f"{got[c]:.0f}%" for c in CATEGORIES) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
