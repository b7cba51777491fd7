"""Partial inputs: a pipeline source missing a stage, a strategy naming only a stage with no
rank file, a destination listing parameters the source cannot supply, two directories of
one rank. Each must end in a zckpt error naming the stage, ranks, parameters or
directories, never in files that silently lack tensors.

The expected names come from the job each test writes (its stage definitions), not from
zckpt's plans. MindSpore's own pipeline job (fixture s06) is used where present.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import scenario

from zckpt.cli.main import main as cli_main
from zckpt.core.errors import DiskFullError, LayoutError, SourceError, StoreError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout, read_strategy
from zckpt.jobs.export import export
from zckpt.jobs.generate import GeneratedModel, PipelineModel, write_model, write_pipeline_model
from zckpt.jobs.generate_model import TensorDef
from zckpt.jobs.ingest import IngestOptions, ingest
from zckpt.jobs.transform import TransformOptions, transform
from zckpt.store.store import Store

ROWS = make_layout((2,), [[0], []])
COLS = make_layout((2,), [[], [0]])
STAGE0 = [TensorDef("l0.w", (8, 16), "Float32", COLS), TensorDef("moments.l0.w", (8, 16), "Float32", COLS)]
STAGE1 = [TensorDef("l1.w", (16, 8), "Float32", ROWS), TensorDef("l1.b", (8,), "Float32", make_layout((2,), [[0]])),
          TensorDef("moments.l1.w", (16, 8), "Float32", ROWS)]
STAGE1_NAMES = sorted(t.name for t in STAGE1)


def _job(tmp_path: Path) -> PipelineModel:
    return write_pipeline_model(tmp_path / "job", [STAGE0, STAGE1], stage_device_num=2)


def _dst_strategy(tmp_path: Path) -> Path:
    """4 ranks without pipeline, listing every parameter of both stages."""
    four = make_layout((4,), [[0], []])
    layouts = {t.name: {0: four if len(t.shape) == 2 else make_layout((4,), [[0]])} for t in (*STAGE0, *STAGE1)}
    path = tmp_path / "dst.ckpt"
    path.write_bytes(encode_strategy(StrategyMap(layouts=layouts)))
    return path


def _stage0_strategy_dir(job: PipelineModel, tmp_path: Path) -> Path:
    """The per-rank strategy directory with stage 1's files missing."""
    out = tmp_path / "strategy_stage0"
    out.mkdir()
    for r in range(job.stage_device_num):
        shutil.copy(job.strategy_dir / f"strategy_{r}.ckpt", out)
    return out


def _merged_without_stage1(job: PipelineModel, tmp_path: Path) -> Path:
    """The merged strategy file with stage 1's entries removed."""
    smap = read_strategy(job.merged_strategy)
    kept = {n: {s: lay for s, lay in per.items() if s != 1} for n, per in smap.layouts.items()}
    path = tmp_path / "merged_stage0.ckpt"
    path.write_bytes(encode_strategy(StrategyMap(layouts={n: p for n, p in kept.items() if p}), merged=True))
    return path


def _names_in(message: str, names: list[str]) -> None:
    for n in names:
        assert n in message, (n, message)


@pytest.mark.parametrize("variant", ["directory", "merged"])
def test_missing_stage_is_recorded_and_export_refuses_by_name(tmp_path: Path, variant: str) -> None:
    job = _job(tmp_path)
    strategy = _stage0_strategy_dir(job, tmp_path) if variant == "directory" else _merged_without_stage1(job, tmp_path)
    report = ingest(job.root, tmp_path / "s.zarr", strategy)
    assert report.left_behind["stages"] == [1]
    assert report.left_behind["ranks"] == [2, 3]
    assert sorted(report.left_behind["params"]) == STAGE1_NAMES
    assert Store.open(tmp_path / "s.zarr").manifest["source"]["left_behind"]["ranks"] == [2, 3]
    with pytest.raises(SourceError) as info:
        export(tmp_path / "s.zarr", tmp_path / "out", _dst_strategy(tmp_path))
    _names_in(str(info.value), STAGE1_NAMES)
    assert "rank file(s) [2, 3]" in str(info.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.ckpt"))


def test_missing_stage_cli_ingest_says_partial_and_export_exits_nonzero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _job(tmp_path)
    store = str(tmp_path / "s.zarr")
    assert cli_main(["ingest", str(job.root), "--strategy", str(_stage0_strategy_dir(job, tmp_path)),
                     "--store", store]) == 0
    said = capsys.readouterr().out
    assert "partial" in said and "[2, 3]" in said
    _names_in(said, STAGE1_NAMES)
    code = cli_main(["export", store, "--strategy", str(_dst_strategy(tmp_path)), "--out", str(tmp_path / "o")])
    assert code != 0
    _names_in(capsys.readouterr().err, STAGE1_NAMES)


def test_per_stage_parts_of_a_partial_store_stay_allowed(tmp_path: Path) -> None:
    """MindSpore's per-stage conversion converts one stage on purpose: its parts are named
    by stage, so a store of stage 0 exports ``_part0`` files holding stage 0's tensors."""
    job = _job(tmp_path)
    ingest(job.root, tmp_path / "s.zarr", _stage0_strategy_dir(job, tmp_path))
    from zckpt.jobs.export_job import ExportOptions

    export(tmp_path / "s.zarr", tmp_path / "out", _dst_strategy(tmp_path), options=ExportOptions(per_stage=True))
    with CkptReader(tmp_path / "out" / "rank_0" / "checkpoint_0_part0.ckpt") as r:
        assert {"l0.w", "moments.l0.w"} <= set(r.entries)
    assert not list((tmp_path / "out").rglob("*_part1.ckpt"))


def test_missing_stage_files_with_merged_strategy_refused_at_ingest_and_transform(tmp_path: Path) -> None:
    job = _job(tmp_path)
    for r in (2, 3):
        shutil.rmtree(job.root / f"rank_{r}")
    with pytest.raises(SourceError) as info:
        ingest(job.root, tmp_path / "s.zarr", job.merged_strategy)
    assert "stage 1" in str(info.value) and "2-3" in str(info.value)
    _names_in(str(info.value), STAGE1_NAMES)
    assert not (tmp_path / "s.zarr").exists()
    with pytest.raises(SourceError) as info:
        transform(job.root, tmp_path / "out", job.merged_strategy, _dst_strategy(tmp_path))
    _names_in(str(info.value), STAGE1_NAMES)
    assert not any((tmp_path / "out").rglob("*.ckpt")) if (tmp_path / "out").exists() else True


def test_optimizer_states_a_source_never_had_are_not_required(tmp_path: Path) -> None:
    """A weights-only source (no ``moments.*`` at all) into a training layout: the states it
    never had are not asked for, but every weight is."""
    job = write_pipeline_model(tmp_path / "job", [[STAGE0[0]], [STAGE1[0], STAGE1[1]]], stage_device_num=2)
    ingest(job.root, tmp_path / "s.zarr", job.merged_strategy)
    rep = export(tmp_path / "s.zarr", tmp_path / "out", _dst_strategy(tmp_path))
    assert len(rep.ranks) == 4
    with CkptReader(tmp_path / "out" / "rank_0" / "checkpoint_0.ckpt") as r:
        assert {"l0.w", "l1.w", "l1.b"} <= set(r.entries)


def test_strategy_naming_only_a_stage_without_ranks_is_refused(tmp_path: Path) -> None:
    job = _job(tmp_path)
    for r in (2, 3):
        shutil.rmtree(job.root / f"rank_{r}")
    stage1_file = job.strategy_dir / "strategy_2.ckpt"
    with pytest.raises(SourceError) as info:
        ingest(job.root, tmp_path / "s.zarr", stage1_file)
    assert "[1]" in str(info.value) and "2-3" in str(info.value) and "[0, 1]" in str(info.value)
    assert not (tmp_path / "s.zarr").exists()
    with pytest.raises(SourceError):
        transform(job.root, tmp_path / "out", stage1_file, _dst_strategy(tmp_path))


def test_destination_strategy_of_one_later_stage_is_refused(tmp_path: Path) -> None:
    """A per-rank strategy file of stage 1 as the destination: its ranks 0.. would get no
    listed parameter, only stage 0's unlisted tensors written whole."""
    job = _job(tmp_path)
    ingest(job.root, tmp_path / "s.zarr", job.strategy_dir)
    with pytest.raises(LayoutError) as info:
        export(tmp_path / "s.zarr", tmp_path / "out", job.strategy_dir / "strategy_2.ckpt")
    assert "stage 0" in str(info.value) and "[1]" in str(info.value)
    with pytest.raises(LayoutError):
        transform(job.root, tmp_path / "out2", job.strategy_dir, job.strategy_dir / "strategy_2.ckpt")


def test_whole_job_still_exports_every_parameter(tmp_path: Path) -> None:
    job = _job(tmp_path)
    ingest(job.root, tmp_path / "s.zarr", job.strategy_dir)
    export(tmp_path / "s.zarr", tmp_path / "out", _dst_strategy(tmp_path))
    transform(job.root, tmp_path / "direct", job.merged_strategy, _dst_strategy(tmp_path),
              options=TransformOptions())
    for out in ("out", "direct"):
        with CkptReader(tmp_path / out / "rank_3" / "checkpoint_3.ckpt") as r:
            assert {t.name for t in (*STAGE0, *STAGE1)} <= set(r.entries)


@pytest.mark.parametrize("stale", ["rank_01", "rank_001"])
def test_two_directories_of_one_rank_are_refused_naming_both(tmp_path: Path, stale: str) -> None:
    job = _job(tmp_path)
    shutil.copytree(job.root / "rank_1", job.root / stale)
    for run in (lambda: ingest(job.root, tmp_path / "s.zarr", job.strategy_dir),
                lambda: transform(job.root, tmp_path / "out", job.strategy_dir, _dst_strategy(tmp_path))):
        with pytest.raises(SourceError) as info:
            run()
        assert "'rank_1'" in str(info.value) and f"'{stale}'" in str(info.value), str(info.value)


def test_fixture_s06_stage_missing(tmp_path: Path) -> None:
    """MindSpore's own 2 x 4 pipeline job with stage 1's strategy files removed."""
    s06 = scenario("s06")
    strat = tmp_path / "strategy"
    strat.mkdir()
    for r in range(4):
        shutil.copy(s06 / "src" / "strategy" / f"strategy_{r}.ckpt", strat)
    report = ingest(s06 / "src" / "checkpoints", tmp_path / "s.zarr", strat, IngestOptions())
    assert report.left_behind["ranks"] == [4, 5, 6, 7]
    with CkptReader(s06 / "src" / "checkpoints" / "rank_4" / "checkpoint_4.ckpt") as r:
        stage1 = sorted(n for n in r.entries if n.startswith(("layer2", "layer3", "moments.layer2", "moments.layer3")))
    assert len(stage1) == 6
    with pytest.raises(SourceError) as info:
        export(tmp_path / "s.zarr", tmp_path / "out", s06 / "dst" / "strategy.ckpt")
    _names_in(str(info.value), stage1)
    doc = json.loads(json.dumps(report.left_behind))
    assert set(stage1) <= set(doc["params"])


# --------------------------------------------------------------------------- disk full


def _small_job(tmp_path: Path) -> GeneratedModel:
    """About 12 MiB over 4 ranks: more than the 8 MiB device below holds."""
    lay = make_layout((4,), [[0], []])
    return write_model(tmp_path / "big", [TensorDef(f"w{i}", (512, 1024), "Float32", lay) for i in range(6)],
                       device_num=4)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs (needs root and a kernel that lets this process mount: skipped otherwise)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root (the monkeypatched ENOSPC tests run everywhere)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (container without CAP_SYS_ADMIN?): {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith((".partial", ".tmp-zckpt"))]


def _check_store_values(store: Path, job: GeneratedModel) -> None:
    s = Store.open(store)
    assert s.complete
    for t in job.tensors:
        if t.layout is not None:
            got = np.asarray(s.array(t.name)[...])
            assert np.array_equal(got, job.global_value(t.name)), t.name


def test_disk_full_tmpfs_ingest_names_a_store_file_and_resumes(tmp_path: Path, full_disk: Path) -> None:
    job = _small_job(tmp_path)
    store = full_disk / "s.zarr"
    with pytest.raises(DiskFullError) as info:
        ingest(job.root, store, job.strategy_path)
    assert str(store) in str(info.value) and "no space left" in str(info.value)
    assert isinstance(info.value, OSError)
    assert not Store.open(store).complete  # never looks complete
    assert not _leftovers(full_disk)
    with pytest.raises(StoreError, match="incomplete"):
        export(store, tmp_path / "out", None)
    subprocess.run(["mount", "-o", "remount,size=64m", str(full_disk)], check=True)
    report = ingest(job.root, store, job.strategy_path)  # space freed: the same ingest runs again
    # tmpfs reserves a store's blocks when its arrays are defined (zckpt.io.fileio.allocate): the disk was full
    # before any data was written, so the rerun starts anew rather than resuming
    assert report.complete and not report.resumed
    _check_store_values(store, job)


@pytest.mark.parametrize("path", ["export", "transform"])
def test_disk_full_tmpfs_output_names_the_rank_file(tmp_path: Path, full_disk: Path, path: str) -> None:
    job = _small_job(tmp_path)
    out = full_disk / "out"
    with pytest.raises(DiskFullError) as info:
        if path == "export":
            ingest(job.root, tmp_path / "s.zarr", job.strategy_path)
            export(tmp_path / "s.zarr", out, None)
        else:
            transform(job.root, out, job.strategy_path, None)
    assert str(out / "rank_0" / "checkpoint_0.ckpt") in str(info.value)
    assert not list(out.rglob("*.ckpt")) and not _leftovers(out)


def _enospc(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_patched_ingest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = importlib.import_module("zckpt.store.chunk_writer")  # where the ingest copies run
    job = _small_job(tmp_path)
    store = tmp_path / "s.zarr"
    with monkeypatch.context() as m:
        m.setattr(writer, "copy_range_at", _enospc)
        m.setattr(writer, "write_at", _enospc)
        with pytest.raises(DiskFullError) as info:
            ingest(job.root, store, job.strategy_path)
    assert str(store / "tensors") in str(info.value)
    assert not Store.open(store).complete and not _leftovers(store)
    assert cli_main(["export", str(store), "--out", str(tmp_path / "o")]) != 0
    ingest(job.root, store, job.strategy_path)
    _check_store_values(store, job)


@pytest.mark.parametrize("path", ["export", "transform"])
def test_disk_full_patched_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    from zckpt.formats.ckpt_writer import CkptWriter

    job = _small_job(tmp_path)
    if path == "export":
        ingest(job.root, tmp_path / "s.zarr", job.strategy_path)
    original = CkptWriter.write_blocks
    calls = []

    def second_fails(self: CkptWriter, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            _enospc()
        original(self, *args, **kwargs)

    monkeypatch.setattr(CkptWriter, "write_blocks", second_fails)
    out = tmp_path / "out"
    with pytest.raises(DiskFullError) as info:
        if path == "export":
            export(tmp_path / "s.zarr", out, None)
        else:
            transform(job.root, out, job.strategy_path, None)
    assert str(out / "rank_0" / "checkpoint_0.ckpt") in str(info.value)
    assert not list(out.rglob("*.ckpt")) and not _leftovers(out)
