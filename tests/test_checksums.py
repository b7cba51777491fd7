"""Every stored chunk has a CRC-32C recorded at ingest; export refuses a damaged chunk by name."""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import google_crc32c
import pytest
import zarr

import zckpt
from zckpt.cli import main as cli_main
from zckpt.export import ExportOptions, StoreReader
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.generate import TensorDef, global_value, write_model
from zckpt.ingest import IngestOptions

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SRC_S = str(EXAMPLE / "src" / "strategy.ckpt")
DST_S = str(EXAMPLE / "dst" / "strategy.ckpt")


def test_every_chunk_has_a_checksum(tmp_path: Path) -> None:
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), tmp_path / "s.zarr", SRC_S)
    st = zckpt.open_store(tmp_path / "s.zarr")
    recorded = sum(len(v) for v in st.checksums().values())
    files = [p for p in (tmp_path / "s.zarr").rglob("c*") if p.is_file() and p.parent.parent.name in
             ("tensors", "maps")]
    assert recorded == len(files) > 0


def test_export_refuses_a_damaged_chunk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, SRC_S)
    chunk = sorted((store / "tensors" / "layer2.weight").glob("c.*"))[0]
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x10
    chunk.write_bytes(bytes(data))
    out = tmp_path / "out"
    code = cli_main(["export", str(store), "--strategy", DST_S, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    assert "layer2.weight" in err and chunk.name in err and "checksum" in err
    assert not list(out.rglob("*.ckpt"))
    shutil.rmtree(out)
    assert cli_main(["export", str(store), "--strategy", DST_S, "--out", str(out), "--no-verify-checksums"]) == 0


def test_missing_chunk_is_named(tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, SRC_S)
    chunk = sorted((store / "tensors" / "layer1.weight").glob("c.*"))[-1]
    chunk.unlink()
    with pytest.raises(zckpt.StoreError, match="missing") as err:
        zckpt.export(store, tmp_path / "o", DST_S)
    assert chunk.name in str(err.value)


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 96])  # whole-shard chunks (copied file to file), small zarr-written
def test_recorded_checksums_are_crc32c_of_the_stored_bytes(tmp_path: Path, chunk_bytes: int) -> None:
    """Chunks copied file to file are summed from the source's mapped bytes, the others
    read back: either way the record must be the CRC-32C of what the chunk file holds."""
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, SRC_S, IngestOptions(chunk_bytes=chunk_bytes))
    st = zckpt.open_store(store)
    checked = 0
    for name, per in st.checksums().items():
        key = st.entry(name).key
        for chunk, want in per.items():
            assert want.algo == "crc32c"
            assert want.value == google_crc32c.value((store / key / chunk).read_bytes()), (name, chunk)
            checked += 1
    assert checked > 0


def test_stores_with_zlib_crc32_records_still_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Stores from before CRC-32C recorded zlib CRC-32 under ``crc32``: still checked."""
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, SRC_S)
    group = zarr.open_group(str(store), mode="r+")
    for _, child in group["progress"].groups():  # type: ignore[union-attr]
        attrs = dict(child.attrs)
        per = attrs.pop("crc32c")
        st = zckpt.open_store(store)
        attrs["crc32"] = {n: {k: zlib.crc32((store / st.entry(n).key / k).read_bytes()) for k in keys}
                          for n, keys in per.items()}
        child.attrs.clear()
        child.attrs.update(attrs)
    assert all(c.algo == "crc32" for per in zckpt.open_store(store).checksums().values() for c in per.values())
    assert cli_main(["export", str(store), "--strategy", DST_S, "--out", str(tmp_path / "ok"), "--quiet"]) == 0
    chunk = sorted((store / "tensors" / "layer2.weight").glob("c.*"))[0]
    data = bytearray(chunk.read_bytes())
    data[1] ^= 1
    chunk.write_bytes(bytes(data))
    assert cli_main(["export", str(store), "--strategy", DST_S, "--out", str(tmp_path / "bad"), "--quiet"]) == 1
    assert "CRC-32 " in capsys.readouterr().err


def test_a_chunk_read_in_part_is_still_checked_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 0 of a 2-way row split reads only the first half of each whole-tensor chunk;
    damage in the second half must still stop it (checksums cover whole chunks)."""
    write_model(tmp_path / "src", [TensorDef("w", (8, 6), "Float32"), TensorDef("b", (), "Float32")],
                device_num=1, strategy_format=None, scalars=False)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, None)
    dst = tmp_path / "dst.ckpt"
    dst.write_bytes(encode_strategy(StrategyMap(layouts={"w": {0: make_layout((2,), [[0], [-1]])}})))
    assert cli_main(["export", str(store), "--strategy", str(dst), "--out", str(tmp_path / "ok"), "--quiet"]) == 0
    with CkptReader(tmp_path / "ok" / "rank_0" / "checkpoint_0.ckpt") as r:
        assert r.array("w").tobytes() == global_value("w", (8, 6), "Float32")[:4].tobytes()
        assert r.array("b").tobytes() == global_value("b", (), "Float32").tobytes()
    chunk = store / "tensors" / "w" / "c.0.0"
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0x01  # last row: rank 1's half
    chunk.write_bytes(bytes(data))
    capsys.readouterr()
    code = cli_main(["export", str(store), "--strategy", str(dst), "--out", str(tmp_path / "bad"), "--quiet"])
    assert code == 1 and "c.0.0" in capsys.readouterr().err
    assert not list((tmp_path / "bad").rglob("*.ckpt"))


def test_export_counts_the_store_bytes_it_reads(tmp_path: Path) -> None:
    """Data reads are exactly the slices' bytes; checking checksums reads whole chunks on top."""
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, SRC_S)
    plain = zckpt.export(store, tmp_path / "a", DST_S, options=ExportOptions(verify_checksums=False))
    checked = zckpt.export(store, tmp_path / "b", DST_S)
    payload = 0
    for r in plain.ranks:
        with CkptReader(r.path) as reader:
            payload += sum(e.nbytes for e in reader.entries.values() if e.kind == "tensor")
    assert sum(r.read_bytes for r in plain.ranks) == payload and sum(r.checked_bytes for r in plain.ranks) == 0
    assert sum(r.read_bytes for r in checked.ranks) == payload
    assert sum(r.checked_bytes for r in checked.ranks) > 0 and checked.bytes_read > plain.bytes_read


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 48])  # one chunk per column block; several row chunks each
def test_column_blocks_are_copied_file_to_file_and_checked(
    tmp_path: Path, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A weight split on dimension 1 (row-parallel) is stored as one chunk column per
    block; a destination with the same split, optimizer-sharded on rows, reads each of its
    slices as byte ranges of those chunks (no array path), bit-exact, and a damaged chunk
    still stops it."""
    src_layout = make_layout((2,), [[], [0]])
    write_model(tmp_path / "src", [TensorDef("w", (8, 6), "Float32", src_layout)], device_num=2, scalars=False)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, str(tmp_path / "src" / "strategy.ckpt"),
                 IngestOptions(chunk_bytes=chunk_bytes))
    st = zckpt.open_store(store)
    assert st.chunk_info("w").chunks[1] == 3
    dst_layout = make_layout((2, 2), [[], [0]], opt_shard_step=2, opt_shard_size=-1)
    dst = tmp_path / "dst.ckpt"
    dst.write_bytes(encode_strategy(StrategyMap(layouts={"w": {0: dst_layout}})))

    def no_array_path(*args: object, **kwargs: object) -> None:
        raise AssertionError("slice read through the array path")

    monkeypatch.setattr(StoreReader, "_read_tiles", no_array_path)
    monkeypatch.setattr(StoreReader, "materialise", no_array_path)
    report = zckpt.export(store, tmp_path / "ok", str(dst))
    value = global_value("w", (8, 6), "Float32")
    for rank in range(4):
        rows, cols = divmod(rank, 2)
        with CkptReader(tmp_path / "ok" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            want = value[rows * 4 : rows * 4 + 4, cols * 3 : cols * 3 + 3]
            assert r.array("w").tobytes() == want.tobytes(), rank
    assert sum(r.read_bytes for r in report.ranks) == value.nbytes
    if chunk_bytes == 48:  # every chunk copied whole: checked in the copy pass, nothing read twice
        assert sum(r.checked_bytes for r in report.ranks) == 0
    else:  # each rank copies half of a chunk: the whole chunk is read once more to check it
        assert sum(r.checked_bytes for r in report.ranks) == 2 * value.nbytes
    chunk = store / "tensors" / "w" / "c.0.0"  # rank 0's first rows: the first file written
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0x01
    chunk.write_bytes(bytes(data))
    capsys.readouterr()
    code = cli_main(["export", str(store), "--strategy", str(dst), "--out", str(tmp_path / "bad"), "--quiet"])
    assert code == 1 and chunk.name in capsys.readouterr().err
    assert not list((tmp_path / "bad").rglob("*.ckpt"))


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 48])  # chunks of all rows, or of each rank's rows
def test_a_chunk_mapped_for_a_slice_is_counted_once(tmp_path: Path, chunk_bytes: int) -> None:
    """A slice spanning two chunk columns is cut out of mapped chunks (the array path):
    each chunk it touches is fetched once, checked and sliced from the same bytes, so the
    rank reads exactly those chunks: the whole tensor with all-row chunks, its own rows with
    chunks that match them."""
    write_model(tmp_path / "src", [TensorDef("w", (8, 6), "Float32", make_layout((2,), [[], [0]]))],
                device_num=2, scalars=False)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, str(tmp_path / "src" / "strategy.ckpt"),
                 IngestOptions(chunk_bytes=chunk_bytes))
    dst = tmp_path / "dst.ckpt"
    dst.write_bytes(encode_strategy(StrategyMap(layouts={"w": {0: make_layout(
        (2,), [[], []], opt_shard_step=1, opt_shard_size=-1)}})))
    report = zckpt.export(store, tmp_path / "o", str(dst))
    value = global_value("w", (8, 6), "Float32")
    for rank in range(2):
        with CkptReader(tmp_path / "o" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            assert r.array("w").tobytes() == value[rank * 4 : rank * 4 + 4].tobytes()
    assert sum(r.read_bytes for r in report.ranks) == value.nbytes
    fetched = sum(r.checked_bytes for r in report.ranks) + value.nbytes
    assert fetched == (2 * value.nbytes if chunk_bytes > 48 else value.nbytes)
