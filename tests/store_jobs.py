"""A small generated job ingested into a store, shared by the store tests that damage,
forge or rerun a copy of it (test_store_seal, test_store_forgery, test_store_rerun)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef, global_value
from zckpt.jobs.ingest import IngestOptions, ingest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The zckpt program in a new process, its output captured, its exit code left to the caller."""
    return subprocess.run([sys.executable, "-m", "zckpt.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)


class StoreJob:
    """``defs`` written as MindSpore shards of ``ranks`` ranks under ``tmp/src`` and ingested into
    ``tmp/store.zarr`` in this process (``options``; the helper process off)."""

    def __init__(self, tmp: Path, defs: list[TensorDef], ranks: int, options: IngestOptions | None = None) -> None:
        self.model = write_model(tmp / "src", defs, device_num=ranks)
        assert self.model.strategy_path is not None
        self.src = tmp / "src"
        self.store = tmp / "store.zarr"
        ingest(self.src, self.store, self.model.strategy_path, options or IngestOptions(helper=False))

    def value(self, name: str) -> bytes:
        """The generator's global value of ``name``, as bytes."""
        t = self.model.tensor(name)
        return np.ascontiguousarray(global_value(t.name, t.shape, t.ms_type)).tobytes()

    def copy(self, tmp: Path) -> Path:
        """A copy of the store to damage."""
        store = tmp / "store.zarr"
        shutil.copytree(self.store, store)
        return store
