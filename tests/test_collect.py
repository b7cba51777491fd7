"""Every public job runs with few cycle collections, and gives the caller's settings back."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import zckpt
from zckpt.formats.strategy import make_layout
from zckpt.io import new_files
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef
from zckpt.jobs.transform import transform, transform_rank
from zckpt.run.collect import YOUNG, fewer_collections
from zckpt.run.helper import Helper


def _model(root: Path) -> Path:
    tensors = [TensorDef("w", (8, 4), "Float32", make_layout((2,), [[0], []]))]
    strategy = write_model(root / "src", tensors, device_num=2).strategy_path
    assert strategy is not None
    return strategy


def _jobs(root: Path, strategy: Path) -> dict[str, Callable[[], Any]]:
    src = root / "src"
    return {
        "ingest": lambda: zckpt.ingest(str(src), str(root / "s.zarr"), str(strategy)),
        "export": lambda: zckpt.export(str(root / "s.zarr"), str(root / "e")),
        "transform": lambda: transform(str(src), str(root / "t"), str(strategy)),
        "transform_rank": lambda: transform_rank({0: src / "rank_0" / "checkpoint_0.ckpt",
                                                  1: src / "rank_1" / "checkpoint_1.ckpt"},
                                                 0, root / "r.ckpt", str(strategy)),
        "unified_safetensors": lambda: zckpt.unified_safetensors(str(src), str(strategy), str(root / "u")),
    }


def test_every_job_writes_with_few_collections_and_restores_the_callers(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = _model(tmp_path)
    seen: list[int] = []
    opened = new_files.NewFile.__init__

    def spy(self: new_files.NewFile, *args: Any, **kwargs: Any) -> None:
        seen.append(gc.get_threshold()[0])
        opened(self, *args, **kwargs)

    monkeypatch.setattr(new_files.NewFile, "__init__", spy)
    before = gc.get_threshold()
    for name, run in _jobs(tmp_path, strategy).items():
        seen.clear()
        run()
        assert seen, f"{name} wrote no file"
        assert min(seen) >= YOUNG, f"{name} wrote with the young generation collected every {min(seen)}"
        assert gc.get_threshold() == before, name


def test_a_callers_higher_threshold_is_kept() -> None:
    before = gc.get_threshold()
    gc.set_threshold(10 * YOUNG, *before[1:])
    try:
        with fewer_collections():
            assert gc.get_threshold()[0] == 10 * YOUNG
        assert gc.get_threshold()[0] == 10 * YOUNG
    finally:
        gc.set_threshold(*before)


def test_the_helper_process_runs_its_call_with_few_collections() -> None:
    with Helper() as h:
        h.submit(gc.get_threshold)
        assert h.result()[0] >= YOUNG
