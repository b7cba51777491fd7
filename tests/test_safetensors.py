"""safetensors output and input: the files load in the ``safetensors`` package with the exact
values of the .ckpt export, the layout is byte for byte the package's own, sharded
safetensors sources ingest to the same store as .ckpt sources, and broken headers are
refused with zckpt errors naming the file and tensor."""

from __future__ import annotations

import errno
import json
import os
import struct
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sf_models import STRINGS, entries_by_name, ingest_all_dtypes, save_safetensors_job

import zckpt
from zckpt.cli.main import main
from zckpt.core.errors import CheckpointFormatError, OutputError, SourceError
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.ckpt_writer import CkptWriter
from zckpt.formats.opener import open_shard
from zckpt.formats.rank_files import pick_rank_file
from zckpt.formats.safetensors import SF_TO_MS, STRING_PREFIX, SafetensorsReader, SafetensorsWriter, TensorHeader
from zckpt.formats.shard_reader import SafetensorsSetReader
from zckpt.jobs.generate import GeneratedModel

sn = pytest.importorskip("safetensors.numpy", reason="the safetensors package is needed (pip install safetensors)")
ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is needed for bf16 in safetensors.numpy")
safe_open = pytest.importorskip("safetensors").safe_open

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "example"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[GeneratedModel, Path]:
    """A 2-rank all-dtypes .ckpt job and its store."""
    return ingest_all_dtypes(tmp_path_factory.mktemp("sf"))


def _as_bits(arr: np.ndarray) -> bytes:
    return np.ascontiguousarray(arr).view(np.uint8).tobytes()


@pytest.mark.parametrize("dst", ["full", "sharded"])
def test_safetensors_equal_ckpt_export(job: tuple[GeneratedModel, Path], tmp_path: Path, dst: str) -> None:
    model, store = job
    strategy = str(model.strategy_path) if dst == "sharded" else None
    ck = zckpt.export(store, tmp_path / "ck", strategy)
    st = zckpt.export(store, tmp_path / "st", strategy, options=zckpt.ExportOptions(format="safetensors"))
    assert [Path(r.path).name for r in st.ranks] == [f"checkpoint_{r.rank}.safetensors" for r in ck.ranks]
    for c, s in zip(ck.ranks, st.ranks, strict=True):
        expected = entries_by_name(Path(c.path))
        loaded = sn.load_file(s.path)
        with safe_open(s.path, framework="np") as f:
            meta = f.metadata()
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        tensors = {n: v for n, v in expected.items() if v[0] == "tensor"}
        assert set(loaded) == set(tensors)
        for name, (_, ms_type, shape, raw) in tensors.items():
            got = loaded[name]
            assert SF_TO_MS[dtypes[name]] == ms_type, name
            assert got.shape == shape, name
            assert _as_bits(got) == raw, f"{name}: bytes differ"
            if ms_type == "BFloat16":  # safetensors' own bf16 handling: ml_dtypes.bfloat16, same bits
                assert got.dtype == np.dtype(ml_dtypes.bfloat16)
                f32 = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
                np.testing.assert_array_equal(got.astype(np.float32), f32)
        assert meta["format"] == "ms"
        assert {k[len(STRING_PREFIX):]: v for k, v in meta.items() if k.startswith(STRING_PREFIX)} == STRINGS


def test_layout_is_the_safetensors_packages(job: tuple[GeneratedModel, Path], tmp_path: Path) -> None:
    """With the same metadata, the file is what safetensors.numpy.save (MindSpore's writer) makes."""
    model, store = job
    opts = zckpt.ExportOptions(format="safetensors")
    rep = zckpt.export(store, tmp_path / "st", str(model.strategy_path), options=opts)
    for r in rep.ranks:
        ours = Path(r.path).read_bytes()
        with SafetensorsReader(r.path) as reader:
            meta = dict(reader.metadata)
        theirs = sn.save(sn.load_file(r.path), metadata=meta)
        assert _parts(ours) == _parts(theirs)
    plain = tmp_path / "plain.safetensors"
    tensors = [TensorHeader("b", "Bool", (3,)), TensorHeader("a", "Float64", (2,)), TensorHeader("c", "BFloat16", (5,))]
    values = {"b": np.array([1, 0, 1], np.bool_), "a": np.array([1.5, -2.0]), "c": np.arange(5, dtype=np.uint16)}
    with SafetensorsWriter(plain, tensors) as w:
        for t in w.order:
            w.write_tensor(t.name, [values[t.name]])
    ref = dict(values, c=values["c"].view(ml_dtypes.bfloat16))
    assert plain.read_bytes() == sn.save(ref, metadata={"format": "ms"})


def _parts(data: bytes) -> tuple[int, list[tuple[str, Any]], dict[str, str], bytes]:
    """Header length, tensor entries in header order, metadata, data bytes: the package writes
    metadata keys in hash order, so a file with several keys is compared part by part."""
    n = struct.unpack("<Q", data[:8])[0]
    pairs = json.loads(data[8 : 8 + n], object_pairs_hook=list)
    meta = dict(next((v for k, v in pairs if k == "__metadata__"), []))
    return n, [(k, v) for k, v in pairs if k != "__metadata__"], meta, data[8 + n :]


def test_crc_num_is_mindspores(job: tuple[GeneratedModel, Path], tmp_path: Path) -> None:
    model, store = job
    rep = zckpt.export(store, tmp_path / "st", str(model.strategy_path),
                       options=zckpt.ExportOptions(format="safetensors", crc=True))
    path = Path(rep.ranks[0].path)
    loaded = sn.load_file(str(path))
    crc = 0
    for k in sorted(loaded):  # MindSpore: crc32(name) then crc32(bytes(tensor)), names sorted
        crc = zlib.crc32(k.encode(), crc)
        crc = zlib.crc32(_as_bits(loaded[k]), crc)
    with SafetensorsReader(path) as r:
        assert r.has_crc and r.crc_expected == crc
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match="crc_num"):
        SafetensorsReader(path)
    SafetensorsReader(path, verify_crc=False).close()


def test_split_files_and_index(job: tuple[GeneratedModel, Path], tmp_path: Path) -> None:
    model, store = job
    out = tmp_path / "st"
    opts = zckpt.ExportOptions(format="safetensors", max_file_bytes=100)
    rep = zckpt.export(store, out, None, options=opts)
    index = Path(rep.ranks[0].path)
    assert index.name == "checkpoint_0.safetensors.index.json"
    doc = json.loads(index.read_text())
    parts = sorted(p.name for p in index.parent.glob("*.safetensors"))
    assert len(parts) > 1 and set(doc["weight_map"].values()) == set(parts)
    assert parts[0] == f"checkpoint_0-00001-of-{len(parts):05d}.safetensors"
    full = entries_by_name(Path(zckpt.export(store, tmp_path / "ck", None).ranks[0].path))
    tensors = {n: v for n, v in full.items() if v[0] == "tensor"}
    assert set(doc["weight_map"]) == set(tensors)
    assert doc["metadata"]["total_size"] == sum(len(v[3]) for v in tensors.values())
    for name, part in doc["weight_map"].items():
        assert _as_bits(sn.load_file(str(index.parent / part))[name]) == tensors[name][3]
    # ingest reads a split rank back through its index
    zckpt.ingest(str(out), tmp_path / "back.zarr", None)
    again = zckpt.export(tmp_path / "back.zarr", tmp_path / "ck2", None)
    assert entries_by_name(Path(again.ranks[0].path)) == full
    # overwriting with an unsplit export removes the parts and the index
    zckpt.export(store, out, None, options=zckpt.ExportOptions(format="safetensors", overwrite=True))
    assert sorted(p.name for p in index.parent.iterdir()) == ["checkpoint_0.safetensors"]


def test_failed_split_rewrite_leaves_no_index_over_mixed_parts(
    job: tuple[GeneratedModel, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A split rank rewritten over an earlier split export and failing at its second part must
    not leave the old index naming the new first part beside old later parts (mixed data that
    looks complete), nor parts without an index."""
    from zckpt.formats.safetensors import SafetensorsWriter

    _, store = job
    out = tmp_path / "st"
    opts = zckpt.ExportOptions(format="safetensors", max_file_bytes=100)
    first = Path(zckpt.export(store, out, None, options=opts).ranks[0].path)
    assert first.is_file() and len(list(first.parent.glob("*-of-*.safetensors"))) > 2
    original = SafetensorsWriter.write_tensor
    seen: list[Path] = []

    def fail_in_second_part(self: SafetensorsWriter, name: str, blocks: Any) -> None:
        if self.path not in seen:
            seen.append(self.path)
        if len(seen) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(self, name, blocks)

    monkeypatch.setattr(SafetensorsWriter, "write_tensor", fail_in_second_part)
    with pytest.raises(OSError):
        zckpt.export(store, out, None, options=replace(opts, overwrite=True))
    left = sorted(p.name for p in first.parent.iterdir() if not p.name.startswith("."))
    assert left == [], left


def test_existing_outputs_refused(job: tuple[GeneratedModel, Path], tmp_path: Path) -> None:
    _, store = job
    opts = zckpt.ExportOptions(format="safetensors")
    zckpt.export(store, tmp_path / "st", None, options=opts)
    again = zckpt.export(store, tmp_path / "st", None, options=opts)  # the same export: complete already
    assert (again.kept, again.ranks) == (1, ())
    with pytest.raises(OutputError, match="already exist"):  # another export (with crc_num) of the same names
        zckpt.export(store, tmp_path / "st", None, options=zckpt.ExportOptions(format="safetensors", crc=True))
    with pytest.raises(OutputError, match="unknown output format"):
        zckpt.export(store, tmp_path / "x", None, options=zckpt.ExportOptions(format="npz"))


def test_map_entries_refused(tmp_path: Path) -> None:
    """MapParameter entries have no safetensors form: refused, naming the parameter."""
    opts = zckpt.ExportOptions(format="safetensors")
    src = tmp_path / "maps" / "rank_0" / "checkpoint_0.ckpt"
    src.parent.mkdir(parents=True)
    with CkptWriter(src) as w:
        w.write_array("w", "Float32", np.ones((2, 2), np.float32))
        w.write_map("table", b"\x0a\x00")
    zckpt.ingest(str(tmp_path / "maps"), tmp_path / "m.zarr", None)
    with pytest.raises(OutputError, match="MapParameter") as err:
        zckpt.export(tmp_path / "m.zarr", tmp_path / "mo", None, options=opts)
    assert err.value.param == "table"


# ----------------------------------------------------------------------------- input


def test_safetensors_sources_ingest_like_ckpt_sources(job: tuple[GeneratedModel, Path], tmp_path: Path) -> None:
    model, store = job
    save_safetensors_job(model, tmp_path / "sfsrc", strings=True)
    st_store = tmp_path / "from_sf.zarr"
    zckpt.ingest(str(tmp_path / "sfsrc"), st_store, str(model.strategy_path))
    for strategy in (None, str(model.strategy_path)):
        tag = "full" if strategy is None else "sharded"
        a = zckpt.export(store, tmp_path / f"a_{tag}", strategy)
        b = zckpt.export(st_store, tmp_path / f"b_{tag}", strategy)
        for x, y in zip(a.ranks, b.ranks, strict=True):
            assert entries_by_name(Path(y.path)) == entries_by_name(Path(x.path))


def test_example_as_safetensors_gives_expected(tmp_path: Path) -> None:
    """MindSpore's 8 -> 4 example, its sources re-saved as safetensors: still dst/expected."""
    store = tmp_path / "s.zarr"
    zckpt.ingest(str(EXAMPLE / "src" / "checkpoints"), store, str(EXAMPLE / "src" / "strategy.ckpt"))
    opts = zckpt.ExportOptions(format="safetensors", crc=True)
    zckpt.export(store, tmp_path / "src8", str(EXAMPLE / "src" / "strategy.ckpt"), options=opts)
    zckpt.ingest(str(tmp_path / "src8"), tmp_path / "t.zarr", str(EXAMPLE / "src" / "strategy.ckpt"))
    out = zckpt.export(tmp_path / "t.zarr", tmp_path / "dst", str(EXAMPLE / "dst" / "strategy.ckpt"))
    for r in out.ranks:
        expected = EXAMPLE / "dst" / "expected" / f"rank_{r.rank}" / f"checkpoint_{r.rank}.ckpt"
        assert entries_by_name(Path(r.path)) == entries_by_name(expected)


def test_source_discovery(tmp_path: Path) -> None:
    rank = tmp_path / "job" / "rank_0"
    rank.mkdir(parents=True)
    for name in ("net-2_100.safetensors", "net-10_5.safetensors", "net-9_900.safetensors"):
        sn.save_file({"x": np.zeros(1, np.float32)}, str(rank / name))
    assert pick_rank_file(rank) == rank / "net-10_5.safetensors"  # MindSpore: largest (epoch, step)
    (tmp_path / "job" / "rank_1").mkdir()
    with CkptWriter(tmp_path / "job" / "rank_1" / "checkpoint_1.ckpt") as w:
        w.write_array("x", "Float32", np.zeros(1, np.float32))
    with pytest.raises(SourceError, match="mixes .ckpt"):
        zckpt.ingest(str(tmp_path / "job"), tmp_path / "s.zarr", None)
    with CkptWriter(rank / "checkpoint_0.ckpt") as w:
        w.write_array("x", "Float32", np.zeros(1, np.float32))
    with pytest.raises(SourceError, match="both .ckpt and .safetensors"):
        pick_rank_file(rank)


def test_open_shard_picks_reader_by_content(tmp_path: Path) -> None:
    st = tmp_path / "weights.bin"
    sn.save_file({"x": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(st))
    ck = tmp_path / "other.bin"
    with CkptWriter(ck) as w:
        w.write_array("x", "Float32", np.arange(6, dtype=np.float32).reshape(2, 3))
    with open_shard(st) as a, open_shard(ck) as b:
        assert isinstance(a, SafetensorsReader) and type(b) is CkptReader
        assert a.array("x").tobytes() == b.array("x").tobytes()
        view = a.rows("x", 1, 2)
        assert not view.flags.owndata and not view.flags.writeable  # a view of the mapping
        lo, n = a.row_bytes_range("x", 1, 2) or (0, 0)
        assert st.read_bytes()[lo : lo + n] == view.tobytes()


def test_split_reader_rejects_inconsistent_index(tmp_path: Path) -> None:
    sn.save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "p1.safetensors"))
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "p1.safetensors", "b": "p1.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match="disagree") as err:
        SafetensorsSetReader(index)
    assert err.value.param == "b"
    index.write_text(json.dumps({"weight_map": {"a": "../p1.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match="beside the index"):
        SafetensorsSetReader(index)


def _file(header: dict[str, Any] | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}

BAD: list[tuple[str, bytes, str, str | None]] = [
    ("short", b"\x01\x02", "too short", None),
    ("huge header", _file(b"{}", length=200_000_000), "exceeds", None),
    ("truncated header", _file(b"{}", length=64), "runs past the end", None),
    ("not json", _file(b"{not json"), "not valid JSON", None),
    ("not an object", _file(b"[1, 2]"), "does not start with", None),
    ("unknown dtype", _file({"a": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2),
     "no MindSpore equivalent", "a"),
    ("negative shape", _file({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
     "non-negative", "a"),
    ("size mismatch", _file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
     "needs 12", "a"),
    ("past the end", _file(GOOD, b"\0" * 4), "run past", "a"),
    ("gap", _file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12), "gap", "a"),
    ("overlap", _file({**GOOD, "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}, b"\0" * 8),
     "overlaps", "b"),
    ("trailing bytes", _file(GOOD, b"\0" * 12), "trailing", None),
    ("duplicate", _file(b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {"dtype": "U8", '
                        b'"shape": [1], "data_offsets": [1, 2]}}', b"\0\0"), "twice", "a"),
    ("metadata types", _file({"__metadata__": {"format": 1}, **GOOD}, b"\0" * 8), "strings to strings", None),
    ("bad offsets", _file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8),
     "begin <= end", "a"),
    ("qint4x2", _file({"__metadata__": {"a": "Int4"}, **GOOD}, b"\0" * 8), "Int4", "a"),
    ("string shadows tensor", _file({"__metadata__": {STRING_PREFIX + "a": "x"}, **GOOD}, b"\0" * 8),
     "both a tensor and a string", "a"),
    ("bad crc_num", _file({"__metadata__": {"crc_num": "abc"}, **GOOD}, b"\0" * 8), "crc_num", None),
]


@pytest.mark.parametrize(("case", "data", "message", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_headers_are_zckpt_errors(tmp_path: Path, case: str, data: bytes, message: str, param: str | None) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(CheckpointFormatError, match=message) as err:
        SafetensorsReader(path)
    assert err.value.path == str(path) and err.value.param == param
    assert str(path) in str(err.value)


def test_good_header_reads(tmp_path: Path) -> None:
    """The fixture the bad cases start from is itself valid (so each case fails for its own reason)."""
    path = tmp_path / "ok.safetensors"
    path.write_bytes(_file({"__metadata__": {STRING_PREFIX + "s": "text"}, **GOOD}, struct.pack("<2f", 1.5, -2)))
    with SafetensorsReader(path) as r:
        assert list(r.entries) == ["a", "s"]
        assert r.array("a").tolist() == [1.5, -2.0] and r.string("s") == "text"


def test_ingest_names_broken_source(tmp_path: Path) -> None:
    rank = tmp_path / "job" / "rank_0"
    rank.mkdir(parents=True)
    (rank / "checkpoint_0.safetensors").write_bytes(BAD[7][1])
    with pytest.raises(CheckpointFormatError, match="needs 12") as err:
        zckpt.ingest(str(tmp_path / "job"), tmp_path / "s.zarr", None)
    assert err.value.path is not None and err.value.path.endswith("checkpoint_0.safetensors")


def test_cli(job: tuple[GeneratedModel, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, store = job
    out = tmp_path / "out"
    assert main(["export", str(store), "--strategy", str(model.strategy_path), "--out", str(out),
                 "--format", "safetensors", "--max-file-mb", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [Path(r["path"]).name for r in doc["ranks"]] == ["checkpoint_0.safetensors", "checkpoint_1.safetensors"]
    assert main(["info", str(out / "rank_1" / "checkpoint_1.safetensors"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["type"] == "safetensors"
    assert {e["name"]: e["dtype"] for e in info["entries"]}["w.bf16"] == "BFloat16"
    assert main(["ingest", str(out), "--strategy", str(model.strategy_path), "--store", str(tmp_path / "s.zarr")]) == 0
    capsys.readouterr()
    assert main(["export", str(store), "--out", str(out), "--format", "safetensors"]) == 1
    assert "already exist" in capsys.readouterr().err


@pytest.fixture(scope="module")
def seed_file() -> bytes:
    """A valid file with strings, every dtype and an empty tensor: the fuzzer's starting point."""
    values = {f"t.{i}": (np.arange(6) % 2).astype(dt).reshape(2, 3) for i, dt in enumerate(
        [np.float32, np.float16, np.int64, np.uint8, np.bool_, np.float64])}
    values["empty"] = np.zeros((0, 2), np.float32)
    out: bytes = sn.save(values, metadata={"format": "ms", STRING_PREFIX + "s": "v", "crc_num": "1"})
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_files_give_zckpt_errors_only(seed_file: bytes, tmp_path: Path, data: st.DataObject) -> None:
    """Truncations, byte flips and splices of a valid file: accepted or CheckpointFormatError,
    and whatever is accepted serves exactly the bytes its header describes."""
    blob = bytearray(seed_file)
    how = data.draw(st.sampled_from(["truncate", "flip", "splice", "header"]))
    if how == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif how == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(blob) - 1))
            blob[i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "splice":
        i = data.draw(st.integers(0, len(blob)))
        blob[i:i] = data.draw(st.binary(min_size=1, max_size=40))
    else:
        n = struct.unpack("<Q", blob[:8])[0]
        text = data.draw(st.text(max_size=200)).encode()
        blob = bytearray(struct.pack("<Q", len(text)) + text + blob[8 + n :])
    path = tmp_path / "f.safetensors"
    path.write_bytes(bytes(blob))
    try:
        reader = SafetensorsReader(path, verify_crc=False)
    except CheckpointFormatError as err:
        assert err.path == str(path)
        return
    with reader:
        n = struct.unpack("<Q", blob[:8])[0]
        for name, e in reader.entries.items():
            if e.kind == "tensor":
                seg = e.segments[0]
                assert 8 + n <= seg.offset and seg.offset + seg.length <= len(blob)
                assert reader.array(name).tobytes() == bytes(blob[seg.offset : seg.offset + seg.length])
            else:
                assert isinstance(reader.string(name), str)
