"""Several readers of one store and an ingest waiting for them (issue 25).

The store lock (``<store>.lock``, :mod:`zckpt.io.locks`) is removed by its last holder. A
reader leaving while another still reads must not remove it: an ingest would then lock a
new file of the same name and rewrite the store under the remaining reader. Here one reader
is this process, the other a separate process; the first leaves, an ``ingest --overwrite``
is attempted (refused while the second reads), then the second leaves and the ingest runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from zckpt.io import locks
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef
from zckpt.jobs.ingest import IngestOptions, ingest

ROOT = Path(__file__).resolve().parents[1]

_READER = """
import sys, time
from pathlib import Path
from zckpt.io import locks
store, leave = Path(sys.argv[1]), Path(sys.argv[2])
with locks.store_reading(store):
    print("reading", flush=True)
    while not leave.exists():
        time.sleep(0.01)
print("left", flush=True)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _ingest_args(src: Path, strategy: Path, store: Path) -> list[str]:
    return [sys.executable, "-m", "zckpt.cli", "ingest", str(src), "--strategy", str(strategy), "--store", str(store),
            "--overwrite", "--quiet"]


def test_ingest_waits_until_the_last_of_several_readers_left(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    model = write_model(tmp_path / "src", [TensorDef("w", (32, 16), "Float32", random_layout(rng, (32, 16), 2))],
                        device_num=2)
    assert model.strategy_path is not None
    store = tmp_path / "store.zarr"
    ingest(tmp_path / "src", store, model.strategy_path, IngestOptions(helper=False))
    lock = locks.store_lock_path(store)
    root_before = (store / "zarr.json").read_bytes()
    leave = tmp_path / "leave"
    first = locks.store_reading(store)
    first.__enter__()
    try:
        second = subprocess.Popen([sys.executable, "-c", _READER, str(store), str(leave)], env=_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert second.stdout is not None
        assert second.stdout.readline().strip() == "reading", second.stderr.read() if second.stderr else ""
    finally:
        first.__exit__(None, None, None)  # the first reader leaves; the second still reads
    try:
        assert lock.exists(), "the first reader to leave removed the lock the second still holds"
        refused = subprocess.run(_ingest_args(tmp_path / "src", model.strategy_path, store), capture_output=True,
                                 text=True, env=_env(), check=False)
        assert refused.returncode == 1 and "lock held" in refused.stderr, refused.stderr
        assert (store / "zarr.json").read_bytes() == root_before
    finally:
        leave.touch()
        out, err = second.communicate(timeout=60)
    assert second.returncode == 0 and out.strip().endswith("left"), err
    assert not lock.exists(), "the last reader left its lock file behind"
    done = subprocess.run(_ingest_args(tmp_path / "src", model.strategy_path, store), capture_output=True, text=True,
                          env=_env(), check=False)
    assert done.returncode == 0, done.stderr
    assert not lock.exists()
