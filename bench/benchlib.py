"""What the benchmarks share: running one phase in its own process, sizes of trees, the machine.

Each phase runs ``phase.py`` in a fresh process so that its peak RSS and I/O counters are its
own (see phase.py); the scripts here only start phases, drop caches and print tables.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GiB = 1024**3
MiB = 1024**2


def tree_bytes(root: Path) -> int:
    """Bytes of every file below ``root``."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def tree_files(root: Path) -> tuple[int, int]:
    """``(files, directories)`` below ``root``."""
    files = dirs = 0
    for _, dn, fn in os.walk(root):
        files += len(fn)
        dirs += len(dn)
    return files, dirs


def peak(r: dict[str, Any]) -> int:
    """Peak RSS of the phase's largest process (itself, or a Dask worker / cp it started)."""
    return max(int(r["max_rss_bytes"]), int(r.get("max_child_rss_bytes", 0)))


def phase_env() -> dict[str, str]:
    """The environment of a zckpt phase: this checkout first on the import path, its modules
    compiled to bytecode once here, as an installed package's are (pip compiles them). With
    ``PYTHONDONTWRITEBYTECODE`` set, as in some containers, every phase process and its
    helper process compiled all of zckpt again: 0.3 s each, counted in the phase's time."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(HERE.parent / "zckpt")], check=False,
                   env=env, capture_output=True)
    return {**env, "PYTHONPATH": str(HERE.parent)}


def run_phase(python: str, *args: str, env: dict[str, str] | None = None,
              timeout: float | None = None) -> dict[str, Any]:
    """Run ``phase.py ARGS`` with ``python``; its JSON result, or ``{"error": ...}`` (a failure,
    or ``timeout`` seconds passed: the phase is killed)."""
    try:
        proc = subprocess.run([python, str(HERE / "phase.py"), *args], capture_output=True, text=True,
                              env=env, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"phase": args[0], "error": f"time limit of {timeout:.0f} s reached"}
    if proc.returncode != 0:
        return {"phase": args[0], "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache, dentries and inodes
    (``sync; echo 3 > /proc/sys/vm/drop_caches``); ``False`` when not allowed (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def _disk_of(path: Path) -> str:
    """The block device and file system holding ``path`` (and the device's model when known)."""
    best, dev, fstype = "", "?", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            src, mnt, fs = line.split()[:3]
            if str(path.resolve()).startswith(mnt) and len(mnt) > len(best):
                best, dev, fstype = mnt, src, fs
    except OSError:
        pass
    name = Path(dev).name
    model = ""
    for candidate in (Path("/sys/block") / name / "device" / "model", Path("/sys/block") / name.rstrip("0123456789")
                      / "device" / "model"):
        if candidate.is_file():
            model = candidate.read_text().strip()
            break
    rotational = Path("/sys/block") / name / "queue" / "rotational"
    kind = ""
    if rotational.is_file():
        kind = "rotational" if rotational.read_text().strip() == "1" else "non-rotational"
    extras = ", ".join(x for x in (model, kind) if x)
    return f"{dev} ({fstype}{', ' + extras if extras else ''}) mounted on {best or '?'}"


def machine(work: Path) -> dict[str, Any]:
    """What the figures were measured on."""
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "ram_bytes": mem, "kernel": platform.release(),
            "platform": platform.platform(), "python": platform.python_version(), "disk": _disk_of(work),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
