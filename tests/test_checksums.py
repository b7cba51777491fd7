"""Every stored chunk has a CRC-32C recorded at ingest; export refuses a damaged chunk by name."""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import pytest

import zckpt
from zckpt.cli.main import main as cli_main
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.io.checksums import BLOCK_BYTES, ChunkSums
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef, global_value
from zckpt.jobs.ingest import IngestOptions
from zckpt.store.reader import StoreReader

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"
SRC_S = str(EXAMPLE / "src" / "strategy.ckpt")
DST_S = str(EXAMPLE / "dst" / "strategy.ckpt")


def _data_bytes(path: Path) -> int:
    """Bytes of a chunk file, or of a shard file's inner chunks (its index, 16 bytes per
    inner chunk and a CRC-32C, follows them), read from ``zarr.json`` alone."""
    doc = json.loads((path.parent / "zarr.json").read_text())
    codec = doc["codecs"][0]
    size = path.stat().st_size
    if codec["name"] != "sharding_indexed":
        return size
    grid = doc["chunk_grid"]["configuration"]["chunk_shape"]
    inner = codec["configuration"]["chunk_shape"]
    return size - 16 * math.prod(g // c for g, c in zip(grid, inner, strict=True)) - 4


def _records_by_file(st: zckpt.Store) -> dict[tuple[str, str], list[tuple[int, int | None, ChunkSums]]]:
    out: dict[tuple[str, str], list[tuple[int, int | None, ChunkSums]]] = {}
    for name, per in st.checksums().items():
        for key, want in per.items():
            file_key, _, at = key.partition("@")
            assert (at == "") == (want.length is None) and int(at or 0) == want.origin, key
            out.setdefault((name, file_key), []).append((want.origin, want.length, want))
    return out


@pytest.mark.parametrize("shard_bytes", [0, 1 << 20])  # a file per chunk (format 3's layout); shards
def test_every_chunk_has_a_checksum(tmp_path: Path, shard_bytes: int) -> None:
    """Every byte of every chunk (or of the inner chunks of every shard) is covered by
    exactly one record: the records of a file tile its data from its first byte."""
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), tmp_path / "s.zarr", SRC_S,
                 IngestOptions(shard_bytes=shard_bytes))
    st = zckpt.open_store(tmp_path / "s.zarr")
    records = _records_by_file(st)
    files = [p for p in (tmp_path / "s.zarr").rglob("c*") if p.is_file() and p.parent.parent.name in
             ("tensors", "maps")]
    sharded = 0
    for path in files:
        name = next(e.name for e in st.entries() if e.key == path.parent.relative_to(tmp_path / "s.zarr").as_posix())
        got = sorted(records.pop((name, path.name)), key=lambda r: r[0])
        end = 0
        for origin, length, _ in got:
            assert origin == end, (name, path.name, got)
            end = origin + (length if length is not None else path.stat().st_size)
        assert end == _data_bytes(path), (name, path.name)
        sharded += len(got) > 1
    assert files and not records and (sharded > 0) == (shard_bytes > 0)


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
    assert not out.exists(), "a failed export leaves no output directory it made"
    assert cli_main(["export", str(store), "--strategy", DST_S, "--out", str(out), "--no-verify-checksums"]) == 0


def test_missing_chunk_is_named(tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, SRC_S)
    chunk = sorted((store / "tensors" / "layer1.weight").glob("c.*"))[-1]
    chunk.unlink()
    with pytest.raises(zckpt.StoreError, match="missing") as err:
        zckpt.export(store, tmp_path / "o", DST_S)
    assert chunk.name in str(err.value)


@pytest.mark.parametrize("sum_block", [BLOCK_BYTES, 40])  # one block per chunk; several per chunk
@pytest.mark.parametrize("chunk_bytes", [64 << 20, 96])  # whole-shard chunks (copied file to file), small zarr-written
def test_recorded_checksums_are_crc32c_of_each_block_of_the_stored_bytes(
    tmp_path: Path, chunk_bytes: int, sum_block: int
) -> None:
    """Chunks copied file to file are summed in the copy, the others read back: either way
    the record must be the CRC-32C of each block of what the chunk file holds."""
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, SRC_S,
                 IngestOptions(chunk_bytes=chunk_bytes, checksum_block_bytes=sum_block))
    st = zckpt.open_store(store)
    checked = several = 0
    for name, per in st.checksums().items():
        key = st.entry(name).key
        for chunk, want in per.items():
            data = (store / key / chunk.partition("@")[0]).read_bytes()
            if want.length is not None:  # a run of a shard file
                data = data[want.origin : want.origin + want.length]
            assert want.algo == "crc32c" and want.block_bytes == sum_block
            assert list(want.values) == [google_crc32c.value(data[i : i + sum_block])
                                         for i in range(0, max(1, len(data)), sum_block)], (name, chunk)
            checked += 1
            several += len(want.values) > 1
    assert checked > 0 and (several > 0) == (sum_block == 40)


def _rewrite_records(store: Path, algo: str, of: Callable[[bytes], int]) -> None:
    """Replace the per-block records by one ``algo`` sum per chunk, as stores written by
    older versions hold them."""
    st = zckpt.open_store(store)
    for record in (store / "progress").glob("rank_*.json"):
        attrs = json.loads(record.read_text())
        per = attrs.pop("crc32c_blocks")["chunks"]
        attrs[algo] = {n: {k: of((store / st.entry(n).key / k).read_bytes()) for k in keys}
                       for n, keys in per.items()}
        record.write_text(json.dumps(attrs))
    meta = store / "zarr.json"  # nor had such stores digests (nor a format that requires them)
    doc = json.loads(meta.read_text())
    doc["attributes"]["zckpt"].pop("integrity", None)
    doc["attributes"]["zckpt"]["version"] = 2
    meta.write_text(json.dumps(doc))


@pytest.mark.parametrize(("algo", "of", "named"), [("crc32", zlib.crc32, "CRC-32 "),
                                                   ("crc32c", google_crc32c.value, "CRC-32C ")])
def test_stores_with_one_sum_per_chunk_still_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], algo: str, of: Callable[[bytes], int], named: str
) -> None:
    """Stores from before block sums recorded one sum per chunk: zlib CRC-32 under ``crc32``
    (before CRC-32C), CRC-32C under ``crc32c`` (store version 2). Both are still checked."""
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, SRC_S, IngestOptions(shard_bytes=0))  # no shards then
    _rewrite_records(store, algo, of)
    sums = [c for per in zckpt.open_store(store).checksums().values() for c in per.values()]
    assert sums and all(c.algo == algo and c.block_bytes is None and len(c.values) == 1 for c in sums)
    assert cli_main(["export", str(store), "--strategy", DST_S, "--out", str(tmp_path / "ok"), "--quiet"]) == 0
    chunk = sorted((store / "tensors" / "layer2.weight").glob("c.*"))[0]
    data = bytearray(chunk.read_bytes())
    data[1] ^= 1
    chunk.write_bytes(bytes(data))
    assert cli_main(["export", str(store), "--strategy", DST_S, "--out", str(tmp_path / "bad"), "--quiet"]) == 1
    assert named in capsys.readouterr().err


def _row_split_store(tmp_path: Path, sum_block: int) -> tuple[Path, Path]:
    """``w`` (8, 6) float32 in one chunk of 192 bytes, and a destination splitting its rows in two."""
    write_model(tmp_path / "src", [TensorDef("w", (8, 6), "Float32"), TensorDef("b", (), "Float32")],
                device_num=1, strategy_format=None, scalars=False)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, None, IngestOptions(checksum_block_bytes=sum_block))
    dst = tmp_path / "dst.ckpt"
    dst.write_bytes(encode_strategy(StrategyMap(layouts={"w": {0: make_layout((2,), [[0], [-1]])}})))
    return store, dst


def test_a_chunk_read_in_part_is_checked_on_the_blocks_it_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_by_one: None
) -> None:
    """Rank 0 of a 2-way row split reads the first half of a chunk of 4 blocks: it checks
    blocks 0 and 1 only, so damage in block 3 (rank 1's half) stops rank 1 and not rank 0,
    and damage in block 1 stops rank 0."""
    store, dst = _row_split_store(tmp_path, 48)
    value = global_value("w", (8, 6), "Float32")
    chunk = store / "tensors" / "w" / "c.0.0"
    good = chunk.read_bytes()
    report = zckpt.export(store, tmp_path / "ok", str(dst))
    assert sum(r.read_bytes for r in report.ranks) == value.nbytes + 8  # w, and b on both ranks
    assert sum(r.checked_bytes for r in report.ranks) == 0  # the halves fall on block borders
    with CkptReader(tmp_path / "ok" / "rank_0" / "checkpoint_0.ckpt") as r:
        assert r.array("w").tobytes() == value[:4].tobytes()
        assert r.array("b").tobytes() == global_value("b", (), "Float32").tobytes()
    for byte, failing in ((191, 1), (95, 0)):
        data = bytearray(good)
        data[byte] ^= 0x01
        chunk.write_bytes(bytes(data))
        for rank in (0, 1):
            out = tmp_path / f"r{rank}-{byte}"
            if rank == failing:
                with pytest.raises(zckpt.StoreError, match=f"c.0.0 fails its checksum \\(block {byte // 48} of 4"):
                    zckpt.export(store, out, str(dst), ranks=[rank])
                assert not list(out.rglob("*.ckpt"))
            else:
                zckpt.export(store, out, str(dst), ranks=[rank])
        capsys.readouterr()
        code = cli_main(["export", str(store), "--strategy", str(dst), "--out", str(tmp_path / f"bad{byte}"),
                         "--quiet"])
        assert code == 1 and "c.0.0" in capsys.readouterr().err


def test_a_range_inside_a_block_reads_the_rest_of_it_to_check(tmp_path: Path, one_by_one: None) -> None:
    """With one block per chunk (the default for small chunks), each rank reads the other
    half of the chunk only to check it: counted as checked bytes, and damage there stops it."""
    store, dst = _row_split_store(tmp_path, BLOCK_BYTES)
    report = zckpt.export(store, tmp_path / "ok", str(dst))
    assert sum(r.checked_bytes for r in report.ranks) == 192  # 96 bytes on each rank
    chunk = store / "tensors" / "w" / "c.0.0"
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0x01  # rank 1's half
    chunk.write_bytes(bytes(data))
    with pytest.raises(zckpt.StoreError, match="c.0.0 fails its checksum"):
        zckpt.export(store, tmp_path / "r0", str(dst), ranks=[0])


def test_export_counts_the_store_bytes_it_reads(tmp_path: Path, one_by_one: None) -> None:
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
    tmp_path: Path, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    one_by_one: None,
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
    else:  # each rank copies half of a one-block chunk: the other half is read to check the block
        assert sum(r.checked_bytes for r in report.ranks) == value.nbytes
    chunk = store / "tensors" / "w" / "c.0.0"  # rank 0's first rows: the first file written
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0x01
    chunk.write_bytes(bytes(data))
    capsys.readouterr()
    code = cli_main(["export", str(store), "--strategy", str(dst), "--out", str(tmp_path / "bad"), "--quiet"])
    assert code == 1 and chunk.name in capsys.readouterr().err
    assert not list((tmp_path / "bad").rglob("*.ckpt"))


@pytest.mark.parametrize("sum_block", [BLOCK_BYTES, 48])  # one block per chunk, or one per rank's rows
@pytest.mark.parametrize("chunk_bytes", [64 << 20, 48])  # chunks of all rows, or of each rank's rows
def test_a_slice_across_chunk_columns_reads_its_rows_once(tmp_path: Path, chunk_bytes: int, sum_block: int,
                                                          one_by_one: None) -> None:
    """A slice spanning two chunk columns is cut out of the chunks' rows (the array path):
    each rank reads exactly its rows of each chunk, checked on the bytes read, plus the rest
    of a checksum block it covers in part (all-row chunks with one block per chunk)."""
    write_model(tmp_path / "src", [TensorDef("w", (8, 6), "Float32", make_layout((2,), [[], [0]]))],
                device_num=2, scalars=False)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, str(tmp_path / "src" / "strategy.ckpt"),
                 IngestOptions(chunk_bytes=chunk_bytes, checksum_block_bytes=sum_block))
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
    assert fetched == (2 * value.nbytes if chunk_bytes > 48 and sum_block > 48 else value.nbytes)


@pytest.mark.parametrize("overlap", [False, True])  # checks on the writer's thread, or on its checks thread
def test_copied_ranges_are_checked_on_every_block_they_touch(tmp_path: Path, overlap: bool) -> None:
    """Four source ranks write runs of 96 bytes into one shard, summed in blocks of 40 bytes
    (so blocks end inside runs); eight destination ranks copy 48 bytes each. A damaged byte
    stops exactly the destination files whose range meets the recorded block holding it
    (worked out here from the geometry alone), and no other."""
    write_model(tmp_path / "src", [TensorDef("w", (16, 6), "Float32", make_layout((4,), [[0], [-1]]))],
                device_num=4, scalars=False)
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(tmp_path / "src"), store, str(tmp_path / "src" / "strategy.ckpt"),
                 IngestOptions(shard_bytes=1 << 20, checksum_block_bytes=40))
    records = sorted((want.origin, want.length) for want in zckpt.open_store(store).checksums()["w"].values())
    assert records == [(96 * k, 96) for k in range(4)]  # the geometry the expectations below rest on
    dst = tmp_path / "dst.ckpt"
    dst.write_bytes(encode_strategy(StrategyMap(layouts={"w": {0: make_layout((8,), [[0], [-1]])}})))
    options = ExportOptions(overlap=overlap)
    value = global_value("w", (16, 6), "Float32")
    zckpt.export(store, tmp_path / "ok", str(dst), options=options)
    for rank in range(8):
        with CkptReader(tmp_path / "ok" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            assert r.array("w").tobytes() == value[2 * rank : 2 * rank + 2].tobytes()
    (shard,) = [p for p in (store / "tensors" / "w").iterdir() if p.name.startswith("c")]
    good = shard.read_bytes()
    for byte in (0, 45, 100, 200, 383):
        run = byte // 96 * 96
        block = run + (byte - run) // 40 * 40
        span = (block, min(run + 96, block + 40))
        data = bytearray(good)
        data[byte] ^= 0x10
        shard.write_bytes(bytes(data))
        for rank in range(8):
            out = tmp_path / f"b{byte}-r{rank}"
            if 48 * rank < span[1] and span[0] < 48 * rank + 48:
                with pytest.raises(zckpt.StoreError, match="fails its checksum"):
                    zckpt.export(store, out, str(dst), ranks=[rank], options=options)
                assert not list(out.rglob("*.ckpt")) and not list(out.rglob("*.tmp-zckpt"))
            else:
                zckpt.export(store, out, str(dst), ranks=[rank], options=options)
    shard.write_bytes(good)


def test_a_run_of_one_block_is_copied_whole_with_its_crc32c(tmp_path: Path) -> None:
    """The one-read copy of a small run writes exactly the source bytes at its place and sums
    them as the reference CRC-32C does; a source that ends early is left to the general copy."""
    from zckpt.store.chunk_writer import _copy_block

    payload = bytes(range(256)) * 40 + b"tail"
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(payload)
    dst.write_bytes(b"\xee" * 20000)
    buf = bytearray(1 << 16)
    with open(src, "rb") as s, open(dst, "r+b") as d:
        assert _copy_block(s.fileno(), d.fileno(), 100, 5000, 3000, buf) == [google_crc32c.value(payload[100:5100])]
        assert _copy_block(s.fileno(), d.fileno(), len(payload) - 10, 11, 0, buf) is None
    got = dst.read_bytes()
    assert got[3000:8000] == payload[100:5100]
    assert got[:3000] == b"\xee" * 3000 and got[8000:] == b"\xee" * 12000
