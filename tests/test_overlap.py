"""Reads overlapped with writes (``overlap``, CLI ``--overlap``/``--no-overlap``): same bytes
either way, a damaged chunk found on the helper thread still stops the file it feeds, and
auto overlap is on only where a core is free for the second thread."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import oracle
import pytest

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef, global_value
from zckpt.jobs.ingest import IngestOptions
from zckpt.run.engines import cores_to_spare, overlap_for, usable_cpus, wants_overlap

choose_module = importlib.import_module("zckpt.run.choose")  # where a phase's tasks are run


def _chunks(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("c*")) if p.is_file()}


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.ckpt"))}


@pytest.mark.parametrize(("seed", "src_n", "dst_n"), [(1, 4, 2), (2, 2, 4), (3, 8, 3)])
def test_overlapped_and_serial_runs_write_the_same_bytes(tmp_path: Path, seed: int, src_n: int, dst_n: int) -> None:
    """Random layouts, chunks and bands far smaller than the tensors (many chunk copies on
    the copy threads, many read-ahead batches, several checksum blocks per chunk)."""
    rng = np.random.default_rng(seed)
    tensors = []
    for i in range(8):
        shape = tuple(int(rng.choice([24, 48])) for _ in range(int(rng.integers(1, 3))))
        tensors.append(TensorDef(f"p{i}", shape, ["Float32", "BFloat16", "Int8"][i % 3],
                                 random_layout(rng, shape, src_n)))
    model = write_model(tmp_path / "src", tensors, device_num=src_n)
    layouts = {}
    for t in tensors:
        lay = random_layout(rng, t.shape, dst_n)
        if lay is not None:
            layouts[t.name] = {0: lay}
    smap = StrategyMap(layouts=layouts)
    (tmp_path / "dst.ckpt").write_bytes(encode_strategy(smap))
    stores = {}
    for overlap in (False, True):
        stores[overlap] = tmp_path / f"s{int(overlap)}.zarr"
        zckpt.ingest(str(tmp_path / "src"), stores[overlap], str(model.strategy_path),
                     IngestOptions(chunk_bytes=256, checksum_block_bytes=64, overlap=overlap))
    assert _chunks(stores[False]) == _chunks(stores[True])
    assert zckpt.open_store(stores[False]).checksums() == zckpt.open_store(stores[True]).checksums()
    outs = {}
    for overlap in (False, True):
        outs[overlap] = tmp_path / f"o{int(overlap)}"
        zckpt.export(stores[True], outs[overlap], str(tmp_path / "dst.ckpt"),
                     options=ExportOptions(block_bytes=512, overlap=overlap))
    files = _files(outs[True])
    assert files == _files(outs[False]) and len(files) == dst_n
    raw = oracle.read_layouts(tmp_path / "dst.ckpt")  # the slices from the file's raw fields, not zckpt.core.layout
    for r in range(dst_n):
        with CkptReader(outs[True] / f"rank_{r}" / f"checkpoint_{r}.ckpt") as got:
            for t in tensors:
                want = np.ascontiguousarray(oracle.cut(global_value(t.name, t.shape, t.ms_type), raw, t.name, r))
                assert got.array(t.name).shape == want.shape, (r, t.name)
                assert got.array(t.name).tobytes() == want.tobytes(), (r, t.name)


def _column_split(tmp_path: Path, chunk_bytes: int) -> tuple[Path, Path]:
    """``w`` (8, 6) split on columns over 2 source ranks; the destination keeps the split and
    shards rows over 2 (optimizer), so each slice is one chunk column's rows."""
    write_model(tmp_path / "src", [TensorDef("w", (8, 6), "Float32", make_layout((2,), [[], [0]]))],
                device_num=2, scalars=False)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, str(tmp_path / "src" / "strategy.ckpt"),
                 IngestOptions(chunk_bytes=chunk_bytes))
    dst = tmp_path / "dst.ckpt"
    dst.write_bytes(encode_strategy(StrategyMap(layouts={"w": {0: make_layout(
        (2, 2), [[], [0]], opt_shard_step=2, opt_shard_size=-1)}})))
    return store, dst


def _damage(store: Path, name: str, coords: tuple[int, ...]) -> str:
    """Flip the first byte of chunk ``coords`` (in its own file, or in its shard); returns
    the file's key."""
    at = zckpt.open_store(store).chunk_at(name, coords)
    assert at is not None
    key, path, offset, _ = at
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    return key


@pytest.mark.parametrize("overlap", [False, True])
def test_a_copied_range_is_read_once_and_checked_in_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """Whole chunks are copied through the writer's buffer and checked on the bytes read for
    the copy: each chunk is read once (no kernel copy followed by a second read), with or
    without the helper thread; a damaged one fails the file: no file under its final name,
    no temporary left."""
    store, dst = _column_split(tmp_path, 48)
    chunk_dir = store / "tensors" / "w"
    read: dict[str, int] = {}
    real_preadv = os.preadv

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        n = real_preadv(fd, buffers, offset)
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.parent == chunk_dir.resolve():
            read[path.name] = read.get(path.name, 0) + n
        return n

    def no_kernel_copy(*args: object) -> int:
        raise AssertionError("a checked range was copied by the kernel")

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "copy_file_range", no_kernel_copy)
    zckpt.export(store, tmp_path / "ok", str(dst), options=ExportOptions(overlap=overlap))
    (shard,) = [p.name for p in chunk_dir.iterdir() if p.name.startswith("c")]
    assert read == {shard: 4 * 48}  # four slices, each one inner chunk of 4 x 3 float32, read once
    value = global_value("w", (8, 6), "Float32")
    for rank in range(4):
        with CkptReader(tmp_path / "ok" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            rows, cols = rank // 2 * 4, rank % 2 * 3
            assert r.array("w").tobytes() == value[rows : rows + 4, cols : cols + 3].tobytes()
    key = _damage(store, "w", (0, 0))
    with pytest.raises(zckpt.StoreError, match=f"{key} fails its checksum"):
        zckpt.export(store, tmp_path / "bad", str(dst), options=ExportOptions(overlap=overlap))
    assert not list((tmp_path / "bad").rglob("*.ckpt")) and not list((tmp_path / "bad").rglob("*.tmp-zckpt"))


def test_a_damaged_chunk_read_ahead_stops_the_file(tmp_path: Path) -> None:
    """Slices across two chunk columns are read ahead on the helper (the array path); the
    error raised there reaches the writer, which leaves nothing behind."""
    write_model(tmp_path / "src", [TensorDef("w", (8, 6), "Float32", make_layout((2,), [[], [0]]))],
                device_num=2, scalars=False)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, str(tmp_path / "src" / "strategy.ckpt"))
    dst = tmp_path / "dst.ckpt"
    dst.write_bytes(encode_strategy(StrategyMap(layouts={"w": {0: make_layout(
        (2,), [[], []], opt_shard_step=1, opt_shard_size=-1)}})))
    key = _damage(store, "w", (0, 1))
    with pytest.raises(zckpt.StoreError, match=f"{key} fails its checksum"):
        zckpt.export(store, tmp_path / "bad", str(dst), options=ExportOptions(block_bytes=64))
    assert not list((tmp_path / "bad").rglob("*.ckpt")) and not list((tmp_path / "bad").rglob("*.tmp-zckpt"))


def test_cli_no_overlap(tmp_path: Path) -> None:
    store, dst = _column_split(tmp_path, 64 << 20)
    for i, flag in enumerate(([], ["--no-overlap"], ["--overlap"])):
        out = tmp_path / f"o{i}"
        assert cli_main(["export", str(store), "--strategy", str(dst), "--out", str(out), "--quiet", *flag]) == 0
    assert _files(tmp_path / "o0") == _files(tmp_path / "o1") == _files(tmp_path / "o2") != {}
    assert cli_main(["ingest", str(tmp_path / "src"), "--store", str(tmp_path / "n.zarr"), "--strategy",
                     str(tmp_path / "src" / "strategy.ckpt"), "--quiet", "--no-overlap"]) == 0
    assert _chunks(tmp_path / "n.zarr") == _chunks(store)


def _worker(host: str, nthreads: int = 1) -> dict[str, Any]:
    return {"host": host, "nthreads": nthreads}


def test_a_second_thread_needs_a_core_to_spare_on_every_host() -> None:
    one = {"tcp://a:1": _worker("a")}
    assert cores_to_spare(one, {"tcp://a:1": 2})
    assert not cores_to_spare(one, {"tcp://a:1": 1})
    two = {"tcp://a:1": _worker("a"), "tcp://a:2": _worker("a")}
    assert not cores_to_spare(two, {"tcp://a:1": 2, "tcp://a:2": 2})
    assert cores_to_spare(two, {"tcp://a:1": 4, "tcp://a:2": 4})
    assert not cores_to_spare(two, {"tcp://a:1": 4, "tcp://a:2": 2}), "a worker pinned to fewer cores counts"
    apart = {"tcp://a:1": _worker("a"), "tcp://b:1": _worker("b")}
    assert cores_to_spare(apart, {"tcp://a:1": 2, "tcp://b:1": 2})
    assert not cores_to_spare({"tcp://a:1": _worker("a", 2), "tcp://b:1": _worker("b")},
                              {"tcp://a:1": 2, "tcp://b:1": 2}), "one busy host is enough to turn it off"
    assert not cores_to_spare({}, {})


def test_auto_overlap_in_this_process_and_as_asked() -> None:
    assert wants_overlap(None) == (usable_cpus() > 1)
    assert wants_overlap(True) and not wants_overlap(False)
    assert overlap_for(None, None) == (usable_cpus() > 1)
    assert overlap_for(False, object()) is False and overlap_for(True, object()) is True


def test_auto_overlap_on_a_local_cluster_counts_its_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As many thread workers as cores leave none to spare: the tasks get overlap off,
    resolved before they are shipped; one worker on several cores keeps it."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        assert overlap_for(None, client) == (usable_cpus() > 1)
    store, dst = _column_split(tmp_path, 48)
    seen: list[Any] = []
    original = choose_module.run_all

    def spy(fn: Any, units: Any, url: Any, options: ExportOptions, *rest: Any, **kw: Any) -> Any:
        seen.append(options.overlap)
        return original(fn, units, url, options, *rest, **kw)

    monkeypatch.setattr(choose_module, "run_all", spy)
    workers = max(2, usable_cpus())
    zckpt.export(store, tmp_path / "auto", str(dst), options=ExportOptions(workers=workers))
    zckpt.export(store, tmp_path / "forced", str(dst), options=ExportOptions(workers=workers, overlap=True))
    assert seen == [False, True]
    assert _files(tmp_path / "auto") == _files(tmp_path / "forced") != {}
