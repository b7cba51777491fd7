"""The store is the same bytes however its ingest ran (issue 25, docs/dask-cluster.md).

One process, the helper process (``IngestOptions(helper=True)``) and a Dask ``LocalCluster``
of two workers write every file of the store identically: progress records are canonical
JSON (their parts are gathered in whatever order threads and workers finish), and on a
cluster the records of consecutive ranks are grouped into the files one process writes.
Compared file by file, names and bytes, against the one-process store.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from zckpt.formats.strategy import make_layout
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef
from zckpt.jobs.ingest import IngestOptions, ingest

pytest.importorskip("distributed")


def _files(store: Path) -> dict[str, bytes]:
    return {p.relative_to(store).as_posix(): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("ranks", [8, 40])  # 40: more than 32 ranks, whose records share files
def test_helper_and_workers_write_the_one_process_store(tmp_path: Path, ranks: int) -> None:
    rng = np.random.default_rng(ranks)
    defs = [TensorDef(f"layer{i}.w", (80, 48), "Float32" if i % 3 else "BFloat16",
                      random_layout(rng, (80, 48), ranks, allow_opt=False)) for i in range(10)]
    defs += [TensorDef(f"bias{i}", (4,), "Float32") for i in range(3)]
    if ranks == 8:  # boxes of 1 MiB are copied on the second thread, of 512 KiB on the task's: gathered out of order
        defs[:0] = [TensorDef("embed.w", (1024, 512), "Float32", make_layout((2, 4), [1, -1])),
                    TensorDef("head.w", (512, 512), "Float32", make_layout((2, 4), [1, -1]))]
    model = write_model(tmp_path / "src", defs, device_num=ranks)
    assert model.strategy_path is not None
    runs = {"one": IngestOptions(helper=False, overlap=True),  # records' parts gathered as the two threads end
            "helper": IngestOptions(helper=True),
            "workers": IngestOptions(workers=2, helper=False, overlap=False)}  # in the order of the writes
    stores = {}
    for how, opts in runs.items():
        ingest(tmp_path / "src", tmp_path / f"{how}.zarr", model.strategy_path, opts)
        stores[how] = _files(tmp_path / f"{how}.zarr")
    one = stores["one"]
    assert any(n.startswith("progress/rank") for n in one)
    if ranks > 32:
        assert any(n.startswith("progress/ranks_") for n in one), sorted(one)
    for how in ("helper", "workers"):
        assert sorted(stores[how]) == sorted(one), how
        differ = [n for n in one if stores[how][n] != one[n]]
        assert not differ, (how, differ)
