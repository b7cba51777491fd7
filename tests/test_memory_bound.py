"""Bounded memory whatever the tensor shape: C-order pieces, rows wider than the budget."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zckpt
from zckpt.cli.args import parse_size
from zckpt.core.layout import Box, c_order_pieces
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef, global_value
from zckpt.jobs.transform import TransformOptions, transform
from zckpt.run.engines import memory_budget
from zckpt.sources.reader import SourceReader
from zckpt.store.reader import StoreReader
from zckpt.write import boxes


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    data=st.data(),
    limit=st.integers(1, 80),
)
def test_c_order_pieces_concatenate_to_the_box(shape: list[int], data: st.DataObject, limit: int) -> None:
    start = [data.draw(st.integers(0, s - 1)) for s in shape]
    stop = [data.draw(st.integers(a + 1, s)) for a, s in zip(start, shape, strict=True)]
    box = Box(tuple(start), tuple(stop))
    full = np.arange(int(np.prod(shape))).reshape(shape)
    pieces = c_order_pieces(box, limit)
    assert all(p.size <= limit or p.size == 1 for p in pieces)
    joined = np.concatenate([full[p.slices()].reshape(-1) for p in pieces])
    assert np.array_equal(joined, full[box.slices()].reshape(-1))


def test_rows_wider_than_the_budget(tmp_path: Path) -> None:
    """A (3, 4096) float32 tensor whose single row (16 KiB) exceeds every step size used here."""
    lay = make_layout((2,), [[], [0]])
    wide = TensorDef("wide", (3, 4096), "Float32", lay)
    col = TensorDef("col", (4096,), "BFloat16", make_layout((2,), [[0]]))
    model = write_model(tmp_path / "src", [wide, col], device_num=2)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, str(model.strategy_path),
                 zckpt.IngestOptions(block_bytes=1000, chunk_bytes=512, verify_replicas=True))
    arr = zckpt.open_store(store).array("wide")
    assert arr.chunks[0] == 1 and arr.chunks[1] < 2048
    dst = StrategyMap(layouts={"wide": {0: make_layout((3,), [[0], []])}, "col": {0: make_layout((3,), [[]])}})
    (tmp_path / "d.ckpt").write_bytes(encode_strategy(dst))
    zckpt.export(store, tmp_path / "o", str(tmp_path / "d.ckpt"), options=zckpt.ExportOptions(block_bytes=700))
    for r in range(3):
        with CkptReader(tmp_path / "o" / f"rank_{r}" / f"checkpoint_{r}.ckpt") as f:
            assert f.array("wide").tobytes() == global_value("wide", (3, 4096), "Float32")[r : r + 1].tobytes()
            assert f.array("col").tobytes() == global_value("col", (4096,), "BFloat16").tobytes()


def test_memory_budget_from_max_mem() -> None:
    b = memory_budget(parse_size("1GiB"))
    assert (b.block_bytes, b.chunk_bytes) == (256 * 2**20, 64 * 2**20)
    small = memory_budget(parse_size("64MiB"))
    assert small.block_bytes == 16 * 2**20 and small.chunk_bytes == 4 * 2**20
    assert parse_size("1.5G") == int(1.5 * 2**30) and parse_size("1000") == 1000 * 2**20
    for bad in ("lots", "-1GiB", "0"):
        try:
            parse_size(bad)
        except zckpt.UsageError:
            continue
        raise AssertionError(f"{bad!r} accepted")


def _mapped_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


def test_opening_a_shard_keeps_none_of_it_mapped(tmp_path: Path) -> None:
    """Indexing a shard touches every Value's header through the mapping. On Linux 6.18
    each touch maps the whole large folio around it once a big sequential read has cached
    the file (the way MindSpore or cp read it): 515 MiB of a 1 GiB shard stayed resident
    before the reader released what the walk touched. Now the walk releases as it goes."""
    import os

    from zckpt.formats.ckpt_writer import CkptWriter

    path = tmp_path / "big.ckpt"
    block = np.zeros(512 * 1024, dtype=np.float32)  # 2 MiB per tensor, 96 MiB in all
    with CkptWriter(path, fsync=False) as w:
        for i in range(48):
            w.write_array(f"w{i}", "Float32", block)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        while os.read(fd, 16 << 20):
            pass
    finally:
        os.close(fd)
    with CkptReader(path, verify_crc=False) as r:
        assert len(r.entries) == 48
        assert _mapped_kib(path) <= 4 * 1024
        r.array("w7").sum()  # touching data maps it; releasing drops it again
        r.release_pages()
        assert _mapped_kib(path) <= 4 * 1024


def test_bands_from_local_files_are_read_in_small_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the budget, bands of local files are read at most ``LOCAL_BATCH_BYTES`` at a
    time (fresh batches of half the budget were memory faulted in anew, batch after batch),
    and the files stay exact: rows that span two chunk columns (export) or two source boxes
    (transform) are cut through memory here."""
    lay = make_layout((2,), [[], [0]])
    wide = TensorDef("wide", (3, 4096), "Float32", lay)
    model = write_model(tmp_path / "src", [wide], device_num=2)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, str(model.strategy_path), zckpt.IngestOptions())
    dst = StrategyMap(layouts={"wide": {0: make_layout((3,), [[0], []])}})
    (tmp_path / "d.ckpt").write_bytes(encode_strategy(dst))
    monkeypatch.setattr(boxes, "LOCAL_BATCH_BYTES", 1024)
    batches: list[int] = []
    for cls in (StoreReader, SourceReader):
        def record(self: Any, items: list[tuple[str, Box]], _real: Any = cls.materialise) -> list[np.ndarray]:
            got: list[np.ndarray] = _real(self, items)
            batches.append(sum(a.nbytes for a in got))
            return got
        monkeypatch.setattr(cls, "materialise", record)
    budget = 2**30
    zckpt.export(store, tmp_path / "e", str(tmp_path / "d.ckpt"), options=zckpt.ExportOptions(block_bytes=budget))
    exported = len(batches)
    transform(str(tmp_path / "src"), str(tmp_path / "t"), str(model.strategy_path), str(tmp_path / "d.ckpt"),
              options=TransformOptions(block_bytes=budget))
    assert exported and len(batches) > exported, "no band was read through memory"
    assert max(batches) <= 1024
    want = global_value("wide", (3, 4096), "Float32")
    for out in ("e", "t"):
        for r in range(3):
            with CkptReader(tmp_path / out / f"rank_{r}" / f"checkpoint_{r}.ckpt") as f:
                assert f.array("wide").tobytes() == want[r : r + 1].tobytes()


def test_remote_stores_keep_batches_of_half_the_budget(tmp_path: Path) -> None:
    """A remote store's batch is one round of concurrent requests: it stays as large as the
    budget allows, only local files are read in small batches."""
    fsspec = pytest.importorskip("fsspec")
    model = write_model(tmp_path / "src", [TensorDef("w", (4, 8), "Float32", make_layout((2,), [[0], []]))],
                        device_num=2)
    base = f"memory://zckpt-{uuid.uuid4().hex[:8]}"
    zckpt.ingest(str(tmp_path / "src"), f"{base}/s.zarr", str(model.strategy_path))
    try:
        budget = 64 * boxes.LOCAL_BATCH_BYTES
        remote = StoreReader(zckpt.open_store(f"{base}/s.zarr"), zckpt.ExportOptions(block_bytes=budget, overlap=True))
        assert remote.band_bytes == budget // 2
        local = boxes.batch_bytes(budget, True)
        assert local == boxes.LOCAL_BATCH_BYTES < remote.band_bytes
    finally:
        fs, path = fsspec.core.url_to_fs(base)
        fs.rm(path, recursive=True)


class _CountingReader:
    """A reader of one (8, 4) float32 tensor, one row per batch, that counts the batches
    asked of it and holds back the first until released."""

    band_bytes = 16
    read_bytes = checked_bytes = 0

    def __init__(self, ahead: int) -> None:
        self.batches_ahead = ahead
        self.asked: list[int] = []
        self.release = threading.Event()

    def kind(self, name: str) -> str:
        return "tensor"

    def ms_type(self, name: str) -> str:
        return "Float32"

    def bands(self, name: str, box: Box) -> list[Box]:
        return c_order_pieces(box, 4)

    def materialise(self, batch: list[tuple[str, Box]]) -> list[np.ndarray]:
        self.asked.append(batch[0][1].start[0])
        if len(self.asked) == 1:
            self.release.wait(10)
        return [np.full(b.shape, b.start[0], np.float32) for _, b in batch]


@pytest.mark.parametrize("ahead", [1, 3])
def test_band_source_reads_its_readers_batches_ahead(ahead: int) -> None:
    """While one batch is read, ``batches_ahead`` more are asked for, never more: the reader
    runs ahead of the writer by that many (in memory: that many batches and the one written);
    the bands still come out in order."""
    reader = _CountingReader(ahead)
    with ThreadPoolExecutor(1) as helper:
        source = boxes.BandSource(reader, [("w", Box((0, 0), (8, 4)))], helper)
        threading.Timer(0.2, reader.release.set).start()
        first = source.next("w")
        assert len(source.ahead) == ahead  # the batch handed out, and `ahead` more asked for
        rest = [source.next("w") for _ in range(7)]
    assert reader.asked == list(range(8))
    assert [int(a[0, 0]) for a in [first, *rest]] == list(range(8))


def test_local_batches_and_those_read_ahead_fit_the_budget() -> None:
    for budget in (4 * 2**20, 16 * 2**20, 2**30):
        assert boxes.batch_bytes(budget, True) * (1 + boxes.batches_ahead(True)) <= budget
