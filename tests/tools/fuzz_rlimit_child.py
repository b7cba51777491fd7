"""Read checkpoint files under an address-space cap and report what happened, as JSON.

usage: python fuzz_rlimit_child.py CAP_MIB FILE [FILE ...]

After importing zckpt (whose imports reserve most of the process's address space), the
address-space limit is set to the current size plus CAP_MIB, so any allocation that scales
with a size field instead of with the file (a numpy array of 2**40 elements, a list of a
billion dims) fails with MemoryError instead of succeeding on a large machine. Each file
then goes through every CkptReader accessor (tests/fuzz_support.py::exercise_ckpt).
Printed: {"capped": bool, "results": {file: "accepted" | "refused" | "<exception repr>"},
"seconds": {file: float}}.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fuzz_support  # noqa: E402


def vm_size() -> int:
    """Current virtual memory size in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main(argv: list[str]) -> int:
    cap = int(argv[0]) * 1024 * 1024
    files = [Path(a) for a in argv[1:]]
    capped = True
    try:
        limit = vm_size() + cap
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (OSError, ValueError, RuntimeError):
        capped = False
    results: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for i, f in enumerate(files):
        t0 = time.perf_counter()
        try:
            results[str(f)] = fuzz_support.exercise_ckpt(f, f.read_bytes(), seed=i)
        except BaseException as err:  # noqa: BLE001 - everything that escapes is the finding
            results[str(f)] = f"{type(err).__name__}: {err}"[:300]
        seconds[str(f)] = time.perf_counter() - t0
    json.dump({"capped": capped, "results": results, "seconds": seconds}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
