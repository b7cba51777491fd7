"""Dask distributed: a LocalCluster and a real scheduler + workers on loopback give the same bytes."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpt_compare import diff_dirs
from dask_hosts import cluster

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.formats.ckpt import CkptReader

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SRC = str(EXAMPLE / "src" / "checkpoints")
SRC_S = str(EXAMPLE / "src" / "strategy.ckpt")
DST_S = str(EXAMPLE / "dst" / "strategy.ckpt")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.ckpt"))}


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_local_cluster_matches_in_process(tmp_path: Path, processes: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import distributed

    started: list[dict[str, object]] = []
    real = distributed.LocalCluster

    def spy(**kwargs: object) -> object:
        started.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(distributed, "LocalCluster", spy)
    zckpt.ingest(SRC, tmp_path / "a.zarr", SRC_S)
    zckpt.export(tmp_path / "a.zarr", tmp_path / "a", DST_S)
    assert started == []
    zckpt.ingest(SRC, tmp_path / "b.zarr", SRC_S,
                 zckpt.IngestOptions(workers=2, processes=processes, verify_replicas=True))
    zckpt.export(tmp_path / "b.zarr", tmp_path / "b", DST_S,
                 options=zckpt.ExportOptions(workers=2, processes=processes))
    assert [(k["n_workers"], k["processes"]) for k in started] == [(2, processes)] * 2
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert diff_dirs(EXAMPLE / "dst" / "expected", tmp_path / "b") == []
    assert zckpt.open_store(tmp_path / "b.zarr").complete


def test_errors_cross_the_cluster_with_their_class(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(SRC, src)
    f = src / "rank_6" / "checkpoint_6.ckpt"
    with CkptReader(f) as r:
        seg = r.entries["layer1.weight"].segments[0]
    data = bytearray(f.read_bytes())
    data[seg.offset] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(zckpt.SourceError, match="layer1.weight"):
        zckpt.ingest(str(src), tmp_path / "s.zarr", SRC_S, zckpt.IngestOptions(workers=2, verify_replicas=True))
    assert not (tmp_path / "s.zarr").exists()
    from zckpt.jobs.transform import transform

    with pytest.raises(zckpt.SourceError, match="layer1.weight"):
        transform(src, tmp_path / "direct", SRC_S, DST_S, options=zckpt.TransformOptions(workers=2,
                                                                                           verify_replicas=True))
    assert not list((tmp_path / "direct").rglob("*.ckpt")) if (tmp_path / "direct").exists() else True


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[str]:
    """A Dask scheduler and two worker processes on loopback, stopped after the test; the
    workers work in a directory of their own, as on another host."""
    elsewhere = tmp_path / "worker-home"
    elsewhere.mkdir()
    with cluster(tmp_path, [(["--nworkers", "2", "--nthreads", "1"], elsewhere, None)], expect=2) as (address, _):
        yield address


def test_cli_on_a_scheduler_with_workers(scheduler: str, tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    assert cli_main(["ingest", SRC, "--strategy", SRC_S, "--store", str(store), "--scheduler", scheduler,
                     "--verify-replicas"]) == 0
    assert cli_main(["export", str(store), "--strategy", DST_S, "--out", str(tmp_path / "o"),
                     "--scheduler", scheduler]) == 0
    assert diff_dirs(EXAMPLE / "dst" / "expected", tmp_path / "o") == []
    assert cli_main(["transform", SRC, "--src-strategy", SRC_S, "--dst-strategy", DST_S, "--out",
                     str(tmp_path / "direct"), "--scheduler", scheduler, "--verify-replicas"]) == 0
    assert diff_dirs(EXAMPLE / "dst" / "expected", tmp_path / "direct") == []


def test_relative_paths_reach_workers_working_elsewhere(scheduler: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Paths as a user types them, relative to the user's directory: the workers, started in
    another directory, get them made absolute (before, the export failed there with "not a
    zarr store" and left empty rank folders behind)."""
    user = tmp_path / "user"
    shutil.copytree(EXAMPLE / "src", user / "src")
    monkeypatch.chdir(user)
    src = ["src/checkpoints", "--strategy", "src/strategy.ckpt"]
    assert cli_main(["ingest", *src, "--store", "s.zarr", "--scheduler", scheduler, "--quiet"]) == 0
    assert cli_main(["export", "s.zarr", "--strategy", DST_S, "--out", "o", "--scheduler", scheduler,
                     "--quiet"]) == 0
    assert cli_main(["transform", "src/checkpoints", "--src-strategy", "src/strategy.ckpt", "--dst-strategy", DST_S,
                     "--out", "direct", "--scheduler", scheduler, "--quiet"]) == 0
    for out in ("o", "direct"):
        assert diff_dirs(EXAMPLE / "dst" / "expected", user / out) == [], out
    assert not list((tmp_path / "worker-home").iterdir())  # nothing written where the workers run


def test_thread_workers_share_the_memory_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread workers live in one process: each task gets 1/N of --max-mem's batch size;
    worker processes and remote workers each get the whole."""
    from zckpt.run.engines import Engine
    from zckpt.store.reader import StoreReader

    assert Engine(workers=2).share(1 << 20) == 1 << 19
    assert Engine(workers=2, processes=True).share(1 << 20) == 1 << 20
    assert Engine(workers=1).share(1 << 20) == 1 << 20
    assert Engine(scheduler="tcp://127.0.0.1:1").share(1 << 20) == 1 << 20
    seen: list[int] = []
    real_init = StoreReader.__init__

    def spy(self: StoreReader, store: object, options: zckpt.ExportOptions) -> None:
        seen.append(options.block_bytes)
        real_init(self, store, options)  # type: ignore[arg-type]

    monkeypatch.setattr(StoreReader, "__init__", spy)
    zckpt.ingest(SRC, tmp_path / "s.zarr", SRC_S)
    opts = zckpt.ExportOptions(workers=2, block_bytes=1 << 22)
    zckpt.export(tmp_path / "s.zarr", tmp_path / "o", DST_S, options=opts)
    assert seen and set(seen) == {1 << 21}
    assert diff_dirs(EXAMPLE / "dst" / "expected", tmp_path / "o") == []


def test_a_cluster_gets_a_group_per_worker_thread(scheduler: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Files that share source rows are written source-major in groups cut for the cluster's
    worker threads (two here), not for ``--workers`` (1 with a scheduler: one group, one
    worker busy, the other idle), in an export and in a transform alike."""
    import json

    from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
    from zckpt.jobs.generate import write_model
    from zckpt.jobs.generate_model import TensorDef

    model = write_model(tmp_path / "src", [TensorDef(f"w{i}", (64, 8), "Float32", make_layout([2], [0, -1]))
                                           for i in range(4)], device_num=2)
    dst = tmp_path / "dst.ckpt"
    dst.write_bytes(encode_strategy(StrategyMap(layouts={t.name: {0: make_layout([32], [0, -1])}
                                                         for t in model.tensors if t.name.startswith("w")})))
    zckpt.ingest(model.root, tmp_path / "s.zarr", model.strategy_path)
    zckpt.export(tmp_path / "s.zarr", tmp_path / "one", dst, options=zckpt.ExportOptions(helper=False))
    capsys.readouterr()
    zckpt.export(tmp_path / "s.zarr", tmp_path / "o", dst,
                 options=zckpt.ExportOptions(scheduler=scheduler, progress="json"))
    assert cli_main(["transform", str(model.root), "--src-strategy", str(model.strategy_path), "--dst-strategy",
                     str(dst), "--out", str(tmp_path / "direct"), "--scheduler", scheduler, "--json"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    tasks = {(e["phase"], e["task"]) for e in events if e.get("event") == "progress" and e["phase"] != "verify"}
    assert tasks == {(phase, f"ranks {a}-{b}") for phase in ("export", "transform") for a, b in ((0, 15), (16, 31))}
    for out in ("o", "direct"):
        assert _files(tmp_path / out) == _files(tmp_path / "one"), out
