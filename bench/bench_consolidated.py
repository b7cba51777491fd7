"""Open times of a store with many parameters, with and without zarr's consolidated metadata.

usage: python bench/bench_consolidated.py [--params 5000] [--dir DIR] [--repeat 2]

Builds a store of ``--params`` small tensors (one rank, no strategy), copies it and runs
``zckpt consolidate`` on the copy, then times, each in a fresh process (as a user's tool
would start), how long zarr-python and zckpt take to open the root, list every array and
open every array. The figures in docs/store-format.md come from this script.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE = r"""
import sys, time, warnings
warnings.simplefilter("ignore")
import zarr
path, mode = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if mode == "open":
    g = zarr.open_group(path, mode="r"); n = len(g.attrs["zckpt"]["entries"])
elif mode == "open-no-consolidated":
    g = zarr.open_group(path, mode="r", use_consolidated=False); n = len(g.attrs["zckpt"]["entries"])
elif mode == "list":
    g = zarr.open_group(path, mode="r"); n = sum(1 for _ in g["tensors"].arrays())
elif mode == "by-key":
    g = zarr.open_group(path, mode="r"); n = 0
    for e in g.attrs["zckpt"]["entries"]:
        if e["kind"] == "tensor":
            g[e["key"]]; n += 1
else:
    from zckpt.store.store import Store
    s = Store.open(path); n = 0
    for e in s.entries():
        if e.kind == "tensor":
            s.array(e.name); n += 1
print(time.perf_counter() - t)
"""

MODES = {
    "open": "zarr.open_group + manifest",
    "open-no-consolidated": "same, use_consolidated=False",
    "list": "list every array",
    "by-key": "open every array by key",
    "zckpt": "zckpt Store.open + every array",
}


def build(root: Path, params: int) -> Path:
    import zckpt
    from zckpt.jobs.generate import write_model
    from zckpt.jobs.generate_model import TensorDef

    defs = [TensorDef(f"layers.{i // 10}.p{i % 10}.weight", (4, 8), "Float32") for i in range(params)]
    write_model(root / "src", defs, device_num=1, strategy_format=None)
    store = root / "plain.zarr"
    zckpt.ingest(str(root / "src"), store, None)
    return store


def probe(store: Path, mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, str(store), mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=5000)
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    from zckpt.store.consolidate import consolidate

    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        plain = build(root, a.params)
        print(f"built a {a.params}-parameter store in {time.perf_counter() - t0:.1f} s")
        cons = root / "consolidated.zarr"
        shutil.copytree(plain, cons)
        rep = consolidate(cons)
        print(f"consolidated {rep.nodes} nodes in {rep.seconds:.1f} s; root zarr.json "
              f"{(plain / 'zarr.json').stat().st_size / 1e6:.1f} MB -> {rep.root_bytes / 1e6:.1f} MB")
        print(f"{'operation':34s} {'plain':>16s} {'consolidated':>16s}")
        for mode, label in MODES.items():
            p = [probe(plain, mode) for _ in range(a.repeat)]
            c = [probe(cons, mode) for _ in range(a.repeat)]
            print(f"{label:34s} {min(p):6.2f}-{max(p):5.2f} s {min(c):8.2f}-{max(c):5.2f} s")


if __name__ == "__main__":
    main()
