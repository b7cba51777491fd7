"""Format 4: a local store groups the chunks of an array into shard files (Zarr's
``sharding_indexed``), so a job on many ranks stays a few files; stores of format 3 still read.

Expected values come from the generator's global values sliced by hand (the destination
splits rows only), never from zckpt's output.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from ckpt_compare import diff_dirs

import zckpt
from zckpt.core.layout import Box
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.io import read_ahead
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef, global_value
from zckpt.jobs.ingest import IngestOptions
from zckpt.jobs.verify import verify
from zckpt.sources.same_layout import Layouts
from zckpt.store import chunk_writer, task_files
from zckpt.store.reader import StoreReader

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
V3_STORE = Path(__file__).resolve().parent / "data" / "store-v3.zarr"
"""The bundled example ingested by zckpt at format 3 (a65db7c): one file per chunk; the
manifest's source paths are relative to the repository."""

RANKS = 32
W = TensorDef("w", (64, 8), "Float32", make_layout((RANKS,), [[0], []]))
"""Split along rows only: each source rank holds 2 rows, the store's chunk."""
V = TensorDef("v", (32, 16), "Float32", make_layout((4, 8), [[1], [0]]))
"""Split along both dimensions: chunks of a quarter of the rows and an eighth of the columns."""


def _model(tmp_path: Path) -> tuple[Path, Path]:
    """The 32-rank source and a 2-rank destination strategy splitting both tensors by rows."""
    write_model(tmp_path / "src", [W, V], device_num=RANKS, scalars=False)
    dst = tmp_path / "dst.ckpt"
    halves = make_layout((2,), [[0], []])
    dst.write_bytes(encode_strategy(StrategyMap(layouts={"w": {0: halves}, "v": {0: halves}})))
    return tmp_path / "src", dst


def _ingest(src: Path, store: Path, shard_bytes: int) -> None:
    zckpt.ingest(str(src), store, str(src / "strategy.ckpt"), IngestOptions(shard_bytes=shard_bytes))


def _chunk_files(store: Path, name: str) -> list[Path]:
    return sorted(p for p in (store / "tensors" / name).iterdir() if p.name != "zarr.json")


def _check_export(out: Path) -> None:
    for rank in range(2):
        with CkptReader(out / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            for t in (W, V):
                half = t.shape[0] // 2
                want = global_value(t.name, t.shape, t.ms_type)[rank * half : (rank + 1) * half]
                assert r.array(t.name).tobytes() == want.tobytes(), (rank, t.name)


def test_many_ranks_make_one_shard_file_per_array(tmp_path: Path) -> None:
    src, dst = _model(tmp_path)
    _ingest(src, tmp_path / "flat.zarr", 0)
    _ingest(src, tmp_path / "s.zarr", 1 << 20)
    assert len(_chunk_files(tmp_path / "flat.zarr", "w")) == len(_chunk_files(tmp_path / "flat.zarr", "v")) == RANKS
    assert [p.name for p in _chunk_files(tmp_path / "s.zarr", "w")] == ["c.0.0"]
    assert [p.name for p in _chunk_files(tmp_path / "s.zarr", "v")] == ["c.0.0"]
    doc = json.loads((tmp_path / "s.zarr" / "tensors" / "v" / "zarr.json").read_text())
    assert doc["chunk_grid"]["configuration"]["chunk_shape"] == [32, 16]
    assert doc["codecs"][0]["name"] == "sharding_indexed"
    assert doc["codecs"][0]["configuration"]["chunk_shape"] == [8, 2]
    assert verify(tmp_path / "s.zarr").ok
    zckpt.export(tmp_path / "s.zarr", tmp_path / "out", str(dst))
    _check_export(tmp_path / "out")
    zckpt.export(tmp_path / "flat.zarr", tmp_path / "flat-out", str(dst))
    assert diff_dirs(tmp_path / "flat-out", tmp_path / "out") == []


def test_rows_of_many_source_ranks_are_one_byte_range(tmp_path: Path) -> None:
    """Row chunks follow each other in the shard: a destination slice over 16 source ranks'
    rows is one byte range of one file (copied in one piece), holding exactly its bytes."""
    src, _ = _model(tmp_path)
    _ingest(src, tmp_path / "s.zarr", 1 << 20)
    reader = StoreReader(zckpt.open_store(tmp_path / "s.zarr"), ExportOptions())
    ranges = reader.file_ranges("w", Box((32, 0), (64, 8)))
    assert ranges is not None and len(ranges) == 1
    r = ranges[0]
    assert r.length == 32 * 8 * 4
    with open(r.path, "rb") as f:
        f.seek(r.offset)
        got = f.read(r.length)
    assert got == global_value("w", W.shape, "Float32")[32:].tobytes()


def test_damaged_shard_is_named_by_export_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, dst = _model(tmp_path)
    _ingest(src, tmp_path / "s.zarr", 1 << 20)
    shard = tmp_path / "s.zarr" / "tensors" / "v" / "c.0.0"
    data = bytearray(shard.read_bytes())
    data[5 * 64 + 3] ^= 0x04  # inside the sixth inner chunk (8 x 2 float32 = 64 bytes each)
    shard.write_bytes(bytes(data))
    with pytest.raises(zckpt.StoreError, match="chunk c.0.0 fails its checksum") as err:
        zckpt.export(tmp_path / "s.zarr", tmp_path / "out", str(dst))
    assert err.value.param == "v"
    report = verify(tmp_path / "s.zarr")
    assert [(m.param, "c.0.0" in (m.region or "")) for m in report.mismatches] == [("v", True)]
    shard.write_bytes(bytes(data[:-1]))  # the index's CRC cut short
    report = verify(tmp_path / "s.zarr")
    assert len(report.mismatches) == 1 and "holds" in report.mismatches[0].message


def test_interrupted_shard_range_is_rewritten_on_resume(tmp_path: Path) -> None:
    """A rank without its progress group may have left its range half written: resuming
    writes that range again (the other ranks' ranges, already recorded, are kept)."""
    src, dst = _model(tmp_path)
    store = tmp_path / "s.zarr"
    _ingest(src, store, 1 << 20)
    st = zckpt.open_store(store)
    at = st.chunk_at("w", (7, 0))  # rank 7's rows
    assert at is not None
    _, shard, offset, _ = at
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 17)
    (store / "progress" / "rank_7.json").unlink()
    doc = json.loads((store / "zarr.json").read_text())
    doc["attributes"]["zckpt"]["complete"] = False
    (store / "zarr.json").write_text(json.dumps(doc))
    report = zckpt.ingest(str(src), store, str(src / "strategy.ckpt"), IngestOptions(shard_bytes=1 << 20))
    assert report.resumed and report.bytes_written == 2 * 8 * 4 + 8 * 2 * 4  # rank 7's rows of w, its block of v
    assert verify(store).ok
    zckpt.export(store, tmp_path / "out", str(dst))
    _check_export(tmp_path / "out")


def test_format_3_store_still_reads_exports_and_verifies(tmp_path: Path) -> None:
    st = zckpt.open_store(V3_STORE)
    assert st.manifest["version"] == 3
    assert all(st.chunk_info(e.name).per_shard is None for e in st.entries() if e.kind == "tensor")
    zckpt.export(V3_STORE, tmp_path / "out", str(EXAMPLE / "dst" / "strategy.ckpt"))
    assert diff_dirs(EXAMPLE / "dst" / "expected", tmp_path / "out") == []
    assert verify(V3_STORE).ok


def test_format_3_ingest_resumes_unsharded(tmp_path: Path) -> None:
    """An ingest that a format-3 zckpt began (one file per chunk) resumes as it began: a
    store whose fingerprint is the unsharded layout's (format 3 computed it the same way; the
    bundled store's own names a checkout elsewhere, so it is set here) is finished unsharded."""
    store = tmp_path / "s.zarr"
    shutil.copytree(V3_STORE, store)
    doc = json.loads((store / "zarr.json").read_text())
    src = EXAMPLE / "src" / "checkpoints"
    files = doc["attributes"]["zckpt"]["source"]["rank_files"]
    repo = EXAMPLE.parents[1]
    for rec in files.values():  # the bundled store names its sources relative to the repository
        rec["path"] = str((repo / rec["path"]).resolve())
    (store / "zarr.json").write_text(json.dumps(doc))
    flat = zckpt.ingest(str(src), tmp_path / "fresh.zarr", str(EXAMPLE / "src" / "strategy.ckpt"),
                        IngestOptions(shard_bytes=0))
    assert flat.complete
    fresh_fp = json.loads((tmp_path / "fresh.zarr" / "zarr.json").read_text())["attributes"]["zckpt"]["fingerprint"]
    doc["attributes"]["zckpt"].update(complete=False, fingerprint=fresh_fp)
    (store / "zarr.json").write_text(json.dumps(doc))
    shutil.rmtree(store / "progress" / "rank_3")
    report = zckpt.ingest(str(src), store, str(EXAMPLE / "src" / "strategy.ckpt"))
    assert report.resumed and report.complete
    assert all(zckpt.open_store(store).chunk_info(e.name).per_shard is None
               for e in zckpt.open_store(store).entries() if e.kind == "tensor")
    zckpt.export(store, tmp_path / "out", str(EXAMPLE / "dst" / "strategy.ckpt"))
    assert diff_dirs(EXAMPLE / "dst" / "expected", tmp_path / "out") == []
    assert np.array_equal(np.asarray(zckpt.open_store(store).array("layer1.weight")[...]),
                          np.asarray(zckpt.open_store(V3_STORE).array("layer1.weight")[...]))


def test_each_shard_file_is_opened_once_per_ingest_and_closed_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """32 source ranks fill one shard file per array: the ingest opens each once (not once per
    rank) and holds none open when it returns."""
    opened: list[str] = []
    real = chunk_writer.open_chunk_file

    def counting(path: str, create: bool) -> int:
        opened.append(os.path.relpath(path, tmp_path / "s.zarr"))
        return real(path, create)

    monkeypatch.setattr(chunk_writer, "open_chunk_file", counting)
    monkeypatch.setattr(task_files, "open_chunk_file", counting)
    src, dst = _model(tmp_path)
    _ingest(src, tmp_path / "s.zarr", 1 << 20)
    assert sorted(opened) == ["tensors/v/c.0.0", "tensors/w/c.0.0"]
    if os.path.isdir("/proc/self/fd"):  # Linux: what this process holds open
        store = str((tmp_path / "s.zarr").resolve())
        assert not [p for p in map(_fd_target, os.listdir("/proc/self/fd")) if p.startswith(store)]
    zckpt.export(tmp_path / "s.zarr", tmp_path / "out", str(dst))
    _check_export(tmp_path / "out")


def _fd_target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the descriptor of the listing itself, closed since
        return ""


def test_sources_too_large_to_read_ahead_are_walked_sparsely(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the source files do not fit the read-ahead share of memory, planning opens each
    shard for its headers only (each page read alone, not 8 MiB of payload around it, which a
    job larger than the page cache would read twice); when they fit, they are read whole
    after the first, walked for its headers to see how large its entries are (small here). The
    index and the store are the same either way."""
    src, dst = _model(tmp_path)
    seen: list[bool] = []
    original = CkptReader.__init__

    def spy(self: CkptReader, path: str | os.PathLike[str], *, verify_crc: bool = True, sparse: bool = False) -> None:
        seen.append(sparse)
        original(self, path, verify_crc=verify_crc, sparse=sparse)

    monkeypatch.setattr(CkptReader, "__init__", spy)
    monkeypatch.setattr(Layouts, "index_of", lambda self, path, group=None: None)  # every file walked: how is tested
    monkeypatch.setattr(read_ahead, "read_soon", lambda paths, share=0.25, order="starts": None)
    _ingest(src, tmp_path / "sparse.zarr", 1 << 20)
    assert len(seen) == RANKS and all(seen)
    monkeypatch.setattr(read_ahead, "read_soon", lambda paths, share=0.25, order="starts": read_ahead.ReadAhead([]))
    seen.clear()
    _ingest(src, tmp_path / "whole.zarr", 1 << 20)
    assert seen == [True] + [False] * (RANKS - 1)
    zckpt.export(tmp_path / "sparse.zarr", tmp_path / "out", str(dst))
    _check_export(tmp_path / "out")
    with CkptReader(src / "rank_3" / "checkpoint_3.ckpt", sparse=True) as a, \
            CkptReader(src / "rank_3" / "checkpoint_3.ckpt") as b:
        assert a.entries == b.entries


HUGE = TensorDef("huge", (2048, 512), "Float32", make_layout((8,), [[0], []]))
"""4 MiB over 8 source ranks: entries of 512 KiB, large enough to walk every header first."""


@pytest.mark.parametrize("crc", [False, True])
def test_headers_of_large_entries_are_walked_before_the_files_are_read_ahead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crc: bool) -> None:
    """Where a shard's entries are large (:data:`zckpt.sources.indexes.HEADERS_FIRST_BYTES`),
    every shard is walked for its headers before the files are read ahead, so that the plan
    does not wait for the last byte of the job; where their checksums are verified (every
    byte read anyway) they are read ahead first. The store is the same either way."""
    write_model(tmp_path / "src", [HUGE], device_num=8, scalars=False, crc=crc)
    src = tmp_path / "src"
    events: list[str] = []
    original = CkptReader.__init__

    def spy(self: CkptReader, path: str | os.PathLike[str], *, verify_crc: bool = True, sparse: bool = False) -> None:
        events.append("sparse" if sparse else "whole")
        original(self, path, verify_crc=verify_crc, sparse=sparse)

    def soon(paths: object, share: float = 0.25, order: str = "starts") -> read_ahead.ReadAhead:
        events.append("read ahead")
        return read_ahead.ReadAhead([])

    monkeypatch.setattr(CkptReader, "__init__", spy)
    monkeypatch.setattr(Layouts, "index_of", lambda self, path, group=None: None)  # every file walked: when is tested
    monkeypatch.setattr(read_ahead, "read_soon", soon)
    report = zckpt.ingest(str(src), tmp_path / "s.zarr", str(src / "strategy.ckpt"))
    first = ["sparse", "read ahead", *["whole"] * 7]
    assert events[:9] == (first if crc else ["sparse"] * 8 + ["read ahead"])
    assert report.complete
    zckpt.export(tmp_path / "s.zarr", tmp_path / "out")
    with CkptReader(tmp_path / "out" / "rank_0" / "checkpoint_0.ckpt") as r:
        assert r.array(HUGE.name).tobytes() == global_value(HUGE.name, HUGE.shape, HUGE.ms_type).tobytes()


BIG = TensorDef("big", (512, 256), "Float32", make_layout((8,), [[0], []]))
"""512 KiB over 8 source ranks: a shard file of many disk blocks (a sparse one holds one, its index's)."""


def _big_model(tmp_path: Path) -> Path:
    write_model(tmp_path / "src", [BIG], device_num=8, scalars=False)
    return tmp_path / "src"


RESERVING = frozenset({"ext4", "xfs", "btrfs", "tmpfs", "f2fs", "bcachefs", "ocfs2", "gfs2"})
"""Linux filesystems whose ``fallocate(2)`` reserves blocks."""


def _reserves_blocks(path: Path) -> bool:
    """Whether ``path`` lies on one of :data:`RESERVING` (the longest mount point above it in
    /proc/self/mounts): told apart from zckpt's own allocation, which the test checks."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return False
    real = str(path.resolve())
    above = [(m, t) for m, t in mounts if real == m or real.startswith(m.rstrip("/") + "/")]
    return bool(above) and max(above, key=lambda mt: len(mt[0]))[1] in RESERVING


class _Stop(Exception):
    pass


def test_define_reserves_shard_blocks_that_still_read_as_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard files are allocated when the arrays are defined; an ingest stopped right
    after leaves a store that holds nothing (no rank recorded, not complete, export refuses),
    and the rerun writes every rank: allocated blocks are not data."""
    if not _reserves_blocks(tmp_path):
        pytest.skip("this filesystem does not reserve blocks (fallocate)")
    src, store = _big_model(tmp_path), tmp_path / "s.zarr"
    mod = importlib.import_module("zckpt.jobs.ingest")

    def stop(*args: object, **kwargs: object) -> None:
        raise _Stop

    with monkeypatch.context() as m:
        m.setattr(mod, "_run", stop)
        with pytest.raises(_Stop):
            _ingest(src, store, 1 << 20)
    (shard,) = _chunk_files(store, "big")
    st = shard.stat()
    assert st.st_size >= BIG.shape[0] * BIG.shape[1] * 4
    assert st.st_blocks * 512 >= st.st_size  # reserved, not sparse
    left = zckpt.open_store(store)
    assert not left.complete and left.ingested_ranks() == set()
    with pytest.raises(zckpt.StoreError):
        zckpt.export(store, tmp_path / "out")
    report = zckpt.ingest(str(src), store, str(src / "strategy.ckpt"), IngestOptions(shard_bytes=1 << 20))
    assert report.complete and report.bytes_written == BIG.shape[0] * BIG.shape[1] * 4
    assert verify(store).ok
    zckpt.export(store, tmp_path / "out")
    with CkptReader(tmp_path / "out" / "rank_0" / "checkpoint_0.ckpt") as r:
        assert r.array("big").tobytes() == global_value("big", BIG.shape, "Float32").tobytes()


def test_a_full_disk_at_define_names_the_shard_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No room for a shard file: the ingest stops before writing data, naming that file; the
    store it leaves holds no ingest (a rerun starts anew) and nothing looks complete."""
    import errno

    src, store = _big_model(tmp_path), tmp_path / "s.zarr"
    calls: list[int] = []

    def no_space(fd: int, mode: int, offset: int, length: int) -> int:
        calls.append(length)
        return errno.ENOSPC

    with monkeypatch.context() as m:
        m.setattr(zckpt.io.fileio, "_fallocate", lambda: no_space)
        with pytest.raises(zckpt.core.errors.DiskFullError) as err:
            _ingest(src, store, 1 << 20)
    assert calls
    assert err.value.path == str(store / "tensors" / "big" / "c.0.0")
    assert "no space left" in str(err.value)
    left = zckpt.open_store(store)
    assert not left.complete and left.ingested_ranks() == set()
    assert "fingerprint" not in left.manifest  # the next ingest starts anew
    with pytest.raises(zckpt.StoreError):
        zckpt.export(store, tmp_path / "out")
    report = zckpt.ingest(str(src), store, str(src / "strategy.ckpt"), IngestOptions(shard_bytes=1 << 20))
    assert report.complete and not report.resumed
    assert verify(store).ok
