"""The ``.ckpt`` codec: exact round trips, MindSpore's odd encodings, and refusal of damage.

Files come from three independent encoders so that no test only reads back what the same
code wrote: :class:`CkptWriter`, the generator's own ``value_header``-based encoder, and
hand-built wire bytes. The protobuf classes generated from ``proto/`` are the referee.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import zlib
from collections.abc import Iterator
from pathlib import Path

import google_crc32c
import numpy as np
import oracle
import pytest

from zckpt.core.dtypes import MS_DTYPES, ms_dtype
from zckpt.core.errors import CheckpointFormatError, UsageError
from zckpt.core.layout import resolve
from zckpt.formats import ckpt_encoding, ckpt_writer, wire
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.ckpt_encoding import CRC_MAGIC, value_header
from zckpt.formats.ckpt_writer import CkptWriter
from zckpt.formats.entries import FileRange
from zckpt.formats.strategy import fold_layout, make_layout, read_strategy
from zckpt.io.checksums import BlockCheck, ChunkSums, Mismatch
from zckpt.jobs import generate
from zckpt.jobs.generate import encode_string, encode_tensor, write_model
from zckpt.jobs.generate_layouts import random_layout
from zckpt.jobs.generate_model import TensorDef, global_value, transformer_like
from zckpt.third_party.mindspore_proto import ms_checkpoint_pb2

ALL_TYPES = sorted(MS_DTYPES)
SCENARIOS = ["s01", "s02", "s03", "s03b", "s04", "s05", "s06", "s07", "s08", "s09", "s10", "s11", "s12", "s14", "s15"]


# --------------------------------------------------------------------------- helpers


def special_values(ms_type: str) -> np.ndarray:
    """Edge values of a type in storage form: extremes, signed zero, NaN payloads, subnormals."""
    storage = ms_dtype(ms_type).storage
    if ms_type == "BFloat16":
        bits = [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0xFF81, 0x3F80, 0x7F7F]
        return np.array(bits, dtype=np.uint16)
    if ms_type == "Bool":
        return np.array([True, False, True], dtype=np.bool_)
    if storage.kind == "f":
        finfo = np.finfo(storage)
        vals = [0.0, -0.0, np.inf, -np.inf, np.nan, finfo.max, finfo.min, finfo.smallest_subnormal, 1.0]
        return np.array(vals, dtype=storage)
    iinfo = np.iinfo(storage)
    return np.array([iinfo.min, iinfo.max, 0, 1, iinfo.max // 3], dtype=storage)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bytes (NaN payloads and signed zeros included)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def pb_entries(data: bytes) -> list[tuple[str, tuple[int, ...], str, bytes]]:
    """(tag, dims, tensor_type, content) of every Value, parsed by the generated classes."""
    msg = ms_checkpoint_pb2.Checkpoint()
    msg.ParseFromString(data)
    return [(v.tag, tuple(v.tensor.dims), v.tensor.tensor_type, v.tensor.tensor_content) for v in msg.value]


def backed_by_mapping(a: np.ndarray) -> bool:
    """True when ``a`` is a view of foreign memory (the file mapping), not of a numpy copy."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root.base is not None


def write_bytes(tmp_path: Path, data: bytes, name: str = "bad.ckpt") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def raw_value(tag: bytes, tensor: bytes) -> bytes:
    """A top-level ``Checkpoint.value`` field from a raw tag and a raw TensorProto body."""
    body = wire.encode_len_field(1, len(tag)) + tag + wire.encode_len_field(2, len(tensor)) + tensor
    return wire.encode_len_field(1, len(body)) + body


def raw_tensor(dims: list[int], ms_type: bytes, content: bytes | None) -> bytes:
    out = b"".join(wire.encode_key(1, wire.WIRE_VARINT) + wire.encode_varint(d) for d in dims)
    out += wire.encode_len_field(2, len(ms_type)) + ms_type
    if content is not None:
        out += wire.encode_len_field(3, len(content)) + content
    return out


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("ms_type", ALL_TYPES)
def test_every_dtype_round_trips_bit_exactly(tmp_path: Path, ms_type: str) -> None:
    values = global_value(f"w.{ms_type}", (5, 7), ms_type)
    special = special_values(ms_type)
    path = tmp_path / "t.ckpt"
    with CkptWriter(path) as w:
        w.write_array("values", ms_type, values)
        w.write_array("special", ms_type, special)
        w.write_array("transposed", ms_type, values.T)  # non-contiguous input
    with CkptReader(path) as r:
        assert r.names() == ["values", "special", "transposed"]
        for name, expect in (("values", values), ("special", special), ("transposed", values.T)):
            got = r.array(name)
            assert r.entries[name].ms_type == ms_type
            assert r.dtype(name).name == ms_type
            assert same_bits(got, expect), name
    entries = pb_entries(path.read_bytes())
    assert [(t, d, ty) for t, d, ty, _ in entries] == [
        ("values", (5, 7), ms_type),
        ("special", special.shape, ms_type),
        ("transposed", (7, 5), ms_type),
    ]
    assert entries[0][3] == values.tobytes()


@pytest.mark.parametrize("ms_type", ALL_TYPES)
def test_generated_values_are_deterministic_and_valid(ms_type: str) -> None:
    a = global_value("layer.weight", (64, 3), ms_type)
    assert a.dtype == ms_dtype(ms_type).storage
    assert a.shape == (64, 3)
    assert same_bits(a, global_value("layer.weight", (64, 3), ms_type))
    assert not same_bits(a, global_value("layer.bias", (64, 3), ms_type))
    assert len(np.unique(a)) > 1
    if ms_type == "BFloat16":
        exponent = (a >> 7) & 0xFF
        assert not np.any(exponent == 0xFF), "bf16 values must be finite numbers"
        as_f32 = (a.astype(np.uint32) << 16).view(np.float32)
        assert np.all(np.abs(as_f32) < 10)
    if a.dtype.kind == "f":
        assert np.all(np.isfinite(a))
    assert global_value("lr", (), ms_type).shape == ()


def test_zero_dim_and_dims_zero_scalars(tmp_path: Path) -> None:
    path = tmp_path / "s.ckpt"
    with CkptWriter(path) as w:
        w.write_array("lr", "Float32", np.array(0.25, dtype=np.float32))
        w.write_array("empty2d", "Int32", np.zeros((0, 3), dtype=np.int32))
    with path.open("ab") as f:
        # MindSpore of some versions writes a 0-d tensor with dims [0] and one element.
        f.write(value_header("old_style", "Float64", [0], 8) + np.float64(-3.5).tobytes())
        # dims [0] with no payload is a genuinely empty 1-D tensor.
        f.write(value_header("empty1d", "Float32", [0], 0))
    with CkptReader(path) as r:
        assert r.entries["lr"].dims == ()
        assert r.array("lr").shape == () and r.array("lr")[()] == np.float32(0.25)
        assert r.entries["old_style"].dims == (0,)
        assert r.entries["old_style"].shape == ()
        assert r.array("old_style")[()] == -3.5
        assert r.array("empty1d").shape == (0,)
        assert r.array("empty2d").shape == (0, 3)
        blocks = list(r.row_blocks("lr", 1))
        assert len(blocks) == 1 and blocks[0][1][()] == np.float32(0.25)
    assert pb_entries(path.read_bytes())[0][1] == ()


@pytest.mark.parametrize("text", ["", "ascii", "epoch 3 — ümlaut ✓ 中文", "inner\x00nul", "trailing nul\x00"])
def test_string_entries_round_trip(tmp_path: Path, text: str) -> None:
    path = tmp_path / "str.ckpt"
    with CkptWriter(path) as w:
        w.write_string("note", text)
        w.write_array("x", "Int8", np.arange(3, dtype=np.int8))
    expect = text.rstrip("\x00")  # numpy 'U' storage cannot keep trailing NULs either
    with CkptReader(path) as r:
        assert r.entries["note"].kind == "str"
        assert r.string("note") == expect
        with pytest.raises(CheckpointFormatError, match="note"):
            r.array("note")
    tag, dims, ms_type, content = pb_entries(path.read_bytes())[0]
    assert (tag, dims, ms_type) == ("note", (0,), "str")
    assert content == np.array(text).tobytes()
    # The generator's encoder writes byte-identical string entries.
    assert encode_string("note", text) == path.read_bytes()[: len(encode_string("note", text))]


# --------------------------------------------------------------------------- split tensors


def test_writer_splits_large_tensors_like_mindspore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt_encoding, "MS_SLICE_BYTES", 64)
    value = global_value("big", (10, 6), "Float32")  # 240 bytes -> ceil(240 / 64) = 4 Values
    path = tmp_path / "split.ckpt"
    with CkptWriter(path) as w:
        w.write_blocks("big", "Float32", value.shape, iter([value[:1], value[1:7], value[7:]]))
        w.write_array("small", "Float32", value[:2, :2])
    entries = pb_entries(path.read_bytes())
    pieces = np.array_split(value, 4)
    assert [t for t, *_ in entries] == ["big"] * 4 + ["small"]
    for (_, dims, _, content), piece in zip(entries, pieces, strict=False):
        assert dims == (10, 6)
        assert content == piece.tobytes()
    with CkptReader(path) as r:
        assert len(r.entries["big"].segments) == 4
        assert same_bits(r.array("big"), value)


@pytest.mark.parametrize(
    ("shape", "ms_type", "slice_bytes", "split", "n_values"),
    [
        ((10, 6), "Float32", 64, "rows", 4),
        ((2, 8), "Float32", 16, "rows", 4),  # more pieces than rows: two empty Values
        ((5, 3), "Int16", 8, "bytes", 4),  # byte chunks that cut rows
        ((7,), "BFloat16", 4, "bytes", 4),
        ((3, 2, 2), "Float64", 30, "bytes", 4),  # 30 is rounded down to whole elements
    ],
)
def test_generator_multi_value_tensors_read_back(
    tmp_path: Path, shape: tuple[int, ...], ms_type: str, slice_bytes: int, split: generate.SplitMode, n_values: int
) -> None:
    value = global_value("t", shape, ms_type)
    data = b"".join(bytes(c) for c in encode_tensor("t", ms_type, value, slice_bytes=slice_bytes, split=split))
    path = write_bytes(tmp_path, data, "multi.ckpt")
    entries = pb_entries(data)
    assert len(entries) == n_values
    assert all(t == "t" and d == shape and ty == ms_type for t, d, ty, _ in entries)
    assert b"".join(c for *_, c in entries) == value.tobytes()
    with CkptReader(path) as r:
        assert len(r.entries["t"].segments) == n_values
        assert same_bits(r.array("t"), value)
        for max_bytes in (1, value.itemsize * 3, 10**6):
            rebuilt = np.concatenate([b for _, b in r.row_blocks("t", max_bytes)])
            assert same_bits(rebuilt, value)


# --------------------------------------------------------------------------- row blocks


def test_row_blocks_are_views_of_the_mapping_for_one_segment(tmp_path: Path) -> None:
    value = global_value("w", (64, 16), "Float32")
    path = tmp_path / "w.ckpt"
    with CkptWriter(path) as w:
        w.write_array("w", "Float32", value)
    with CkptReader(path) as r:
        whole = r.array("w")
        assert backed_by_mapping(whole) and not whole.flags.writeable
        blocks = list(r.row_blocks("w", 5 * 64))  # 5 rows of 64 bytes per block
        assert [s for s, _ in blocks] == list(range(0, 64, 5))
        for start, block in blocks:
            assert block.nbytes <= 5 * 64
            assert np.shares_memory(block, whole)
            assert backed_by_mapping(block)
            assert same_bits(block, value[start : start + len(block)])
        tiny = list(r.row_blocks("w", 1))  # smaller than a row: still one row each
        assert len(tiny) == 64 and all(b.shape == (1, 16) for _, b in tiny)
        del whole, blocks, tiny, block


def test_row_blocks_across_segment_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt_encoding, "MS_SLICE_BYTES", 64)
    value = global_value("big", (10, 6), "Float32")  # segments of 3, 3, 2, 2 rows
    path = tmp_path / "split.ckpt"
    with CkptWriter(path) as w:
        w.write_array("big", "Float32", value)
    seg_rows = [(0, 3), (3, 6), (6, 8), (8, 10)]
    with CkptReader(path) as r:
        blocks = list(r.row_blocks("big", 2 * 24))
        assert [s for s, _ in blocks] == [0, 2, 4, 6, 8]
        for start, block in blocks:
            stop = start + len(block)
            assert same_bits(block, value[start:stop])
            inside_one = any(a <= start and stop <= b for a, b in seg_rows)
            assert backed_by_mapping(block) == inside_one, (start, stop)
        del blocks, block


# --------------------------------------------------------------------------- crc


def test_crc_trailer_written_and_verified(tmp_path: Path) -> None:
    value = global_value("w", (8, 8), "Float16")
    path = tmp_path / "crc.ckpt"
    with CkptWriter(path, crc=True) as w:
        w.write_array("w", "Float16", value)
        w.write_string("s", "x")
    data = path.read_bytes()
    content, trailer = data[: -ckpt_encoding.CRC_TRAILER_LEN], data[-ckpt_encoding.CRC_TRAILER_LEN :]
    assert trailer == CRC_MAGIC + zlib.crc32(content).to_bytes(10, "big")
    assert [t for t, *_ in pb_entries(content)] == ["w", "s"]
    with CkptReader(path) as r:
        assert r.has_crc and r.crc_expected == zlib.crc32(content)
        assert same_bits(r.array("w"), value)
    # The generator writes the same trailer for the same content.
    gen = tmp_path / "gen"
    model = write_model(gen, [TensorDef("w", (8, 8), "Float16")], device_num=1, scalars=False, crc=True)
    gdata = model.rank_files[0].read_bytes()
    assert gdata[-17:] == CRC_MAGIC + zlib.crc32(gdata[:-17]).to_bytes(10, "big")


@pytest.mark.parametrize("where", ["payload", "header", "trailer"])
def test_crc_mismatch_is_refused(tmp_path: Path, where: str) -> None:
    value = np.arange(32, dtype=np.int32)
    path = tmp_path / "crc.ckpt"
    with CkptWriter(path, crc=True) as w:
        w.write_array("w", "Int32", value)
    data = bytearray(path.read_bytes())
    pos = {"payload": len(data) - 17 - 5, "header": data.index(b"\x0a\x01w") + 2, "trailer": len(data) - 1}[where]
    if where == "header":  # change a tag byte: still well-formed, but different content
        assert data[pos : pos + 1] == b"w"
        data[pos] = ord("v")
    else:
        data[pos] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match="crc") as err:
        CkptReader(path)
    assert str(path) in str(err.value)
    with CkptReader(path, verify_crc=False) as r:
        assert r.has_crc
        if where == "payload":
            assert not np.array_equal(r.array("w"), value)


# --------------------------------------------------------------------------- damage


def three_entry_file() -> tuple[bytes, list[int]]:
    """A small file and the offsets at which complete top-level Values end."""
    parts = [
        b"".join(bytes(c) for c in encode_tensor("a", "Float32", global_value("a", (3, 2), "Float32"))),
        encode_string("b", "hi"),
        b"".join(bytes(c) for c in encode_tensor("c", "Int64", global_value("c", (4,), "Int64"))),
    ]
    return b"".join(parts), list(np.cumsum([len(p) for p in parts]))


def test_truncated_file_is_refused_at_every_cut(tmp_path: Path) -> None:
    data, ends = three_entry_file()
    path = tmp_path / "trunc.ckpt"
    refused = 0
    for cut in range(1, len(data)):
        path.write_bytes(data[:cut])
        if cut in ends:  # a cut between Values leaves a shorter valid file
            with CkptReader(path) as r:
                assert r.names() == ["a", "b", "c"][: ends.index(cut) + 1]
            continue
        with pytest.raises(CheckpointFormatError) as err:
            CkptReader(path)
        assert str(path) in str(err.value)
        refused += 1
    assert refused == len(data) - 1 - (len(ends) - 1)


def test_truncated_crc_trailer_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.ckpt"
    with CkptWriter(path, crc=True) as w:
        w.write_array("w", "UInt8", np.arange(5, dtype=np.uint8))
    data = path.read_bytes()
    for k in range(1, ckpt_encoding.CRC_TRAILER_LEN):
        path.write_bytes(data[:-k])
        with pytest.raises(CheckpointFormatError) as err:
            CkptReader(path)
        assert str(path) in str(err.value)


def _value_dims(name: str, dims: list[int], ms_type: str, content: bytes) -> bytes:
    return raw_value(name.encode(), raw_tensor(dims, ms_type.encode(), content))


F32x2 = np.array([1.0, 2.0], dtype=np.float32).tobytes()
MALFORMED: list[tuple[str, bytes, str | None, str]] = [
    # (case, file bytes, parameter the error must name, text the message must hold)
    ("over-long varint", b"\x0a" + b"\x80" * 10 + b"\x00", None, "varint longer than 10 bytes"),
    ("length past the end", b"\x0a\x64" + b"\x0a\x01w", None, "runs past the end"),
    ("field number 0", b"\x02\x00", None, "field number 0"),
    ("group wire type", b"\x0b\x0c", None, "wire type 3"),
    ("truncated fixed64", b"\x09\x01\x02", None, "truncated fixed64"),
    ("unexpected top-level field", b"\x12\x00", None, "unexpected top-level field 2"),
    ("top-level varint", b"\x08\x01", None, "unexpected top-level field 1"),
    ("value without tag", wire.encode_len_field(1, 2) + b"\x12\x00", None, "no tag"),
    ("non-utf8 tag", raw_value(b"\xff\xfe", raw_tensor([2], b"Float32", F32x2)), None, "not UTF-8"),
    ("value without tensor", wire.encode_len_field(1, 3) + b"\x0a\x01w", "w", "neither tensor nor maptensor"),
    ("tensor without tensor_type", raw_value(b"w", wire.encode_len_field(3, 8) + F32x2), "w", "no tensor_type"),
    ("unknown tensor_type", _value_dims("w", [2], "Float8", F32x2), "w", "unknown tensor_type 'Float8'"),
    ("non-ascii tensor_type", raw_value(b"w", raw_tensor([2], "Flöat".encode(), F32x2)), "w", "not ASCII"),
    (
        "payload shorter than dims",
        _value_dims("w", [3], "Float32", F32x2),
        "w",
        "8 bytes but dims [3] x Float32 need 12",
    ),
    ("payload longer than dims", _value_dims("w", [1], "Float32", F32x2), "w", "8 bytes but dims [1] x Float32 need 4"),
    ("payload missing", _value_dims("w", [2, 2], "Float32", b""), "w", "0 bytes but dims [2, 2] x Float32 need 16"),
    ("negative dimension", _value_dims("w", [-2], "Float32", F32x2), "w", "negative dimension"),
    (
        "truncated varint inside packed dims",
        raw_value(b"w", wire.encode_len_field(1, 1) + b"\x80" + raw_tensor([], b"Float32", b"")),
        None,
        "truncated varint",
    ),
    (
        "continuation disagrees on dims",
        _value_dims("w", [2], "Float32", F32x2[:4]) + _value_dims("w", [3], "Float32", F32x2[4:]),
        "w",
        "disagrees on type or dims",
    ),
    (
        "tag twice, not consecutively",  # the two halves would make a well-sized tensor
        _value_dims("w", [2], "Float32", F32x2[:4])
        + _value_dims("v", [2], "Float32", F32x2)
        + _value_dims("w", [2], "Float32", F32x2[4:]),
        "w",
        "not consecutively",
    ),
    (
        "segment splits an element",
        _value_dims("w", [2], "Float32", F32x2[:2]) + _value_dims("w", [2], "Float32", F32x2[2:]),
        "w",
        "splits an element",
    ),
]


@pytest.mark.parametrize(("case", "data", "param", "needle"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_files_are_refused_naming_file_and_parameter(
    tmp_path: Path, case: str, data: bytes, param: str | None, needle: str
) -> None:
    path = write_bytes(tmp_path, data, "model-rank3.ckpt")
    with pytest.raises(CheckpointFormatError) as err:
        CkptReader(path)
    assert isinstance(err.value, ValueError)
    assert err.value.path == str(path)
    assert str(path) in str(err.value)
    assert needle in err.value.message, case
    if param is not None:
        assert err.value.param == param, case
        assert repr(param) in str(err.value)


def test_malformed_cases_differ_from_valid_only_in_the_defect(tmp_path: Path) -> None:
    """The damage tests would be vacuous if the well-formed variant did not parse."""
    good = _value_dims("w", [2], "Float32", F32x2)
    with CkptReader(write_bytes(tmp_path, good, "good.ckpt")) as r:
        assert r.array("w").tolist() == [1.0, 2.0]
    packed = raw_value(b"w", wire.encode_len_field(1, 1) + b"\x02" + raw_tensor([], b"Float32", F32x2))
    with CkptReader(write_bytes(tmp_path, packed, "packed.ckpt")) as r:
        assert r.entries["w"].dims == (2,)
    split = _value_dims("w", [2], "Float32", F32x2[:4]) + _value_dims("w", [2], "Float32", F32x2[4:])
    with CkptReader(write_bytes(tmp_path, split, "split.ckpt")) as r:
        assert r.array("w").tolist() == [1.0, 2.0]


def test_missing_file_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "nope.ckpt"
    with pytest.raises(CheckpointFormatError) as err:
        CkptReader(path)
    assert str(path) in str(err.value)


# --------------------------------------------------------------------------- writer failures


def test_writer_refuses_bad_input_naming_the_parameter(tmp_path: Path) -> None:
    path = tmp_path / "w.ckpt"
    with CkptWriter(path) as w:
        with pytest.raises(CheckpointFormatError, match="'short'"):
            w.write_blocks("short", "Float32", (4, 2), iter([np.zeros((3, 2), np.float32)]))
        with pytest.raises(CheckpointFormatError, match="'long'"):
            w.write_blocks("long", "Float32", (1, 2), iter([np.zeros((2, 2), np.float32)]))
        with pytest.raises(CheckpointFormatError, match="'odd'"):
            w.write_array("odd", "Float8", np.zeros(2, np.uint8))
        with pytest.raises(CheckpointFormatError):
            w.write_array("wide", "Float32", np.zeros(2, np.float64))
        w.write_array("ok", "Int8", np.zeros(2, np.int8))
        with pytest.raises(CheckpointFormatError, match="'ok'"):
            w.write_array("ok", "Int8", np.zeros(2, np.int8))
        w.abort()  # the file now holds partial entries; do not publish it
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def failing_blocks(value: np.ndarray, fail_after: int) -> Iterator[np.ndarray]:
    for i, row in enumerate(value):
        if i == fail_after:
            raise RuntimeError("source disappeared")
        yield row[None]


@pytest.mark.parametrize("existing", [False, True])
def test_writer_failure_leaves_no_final_file(tmp_path: Path, existing: bool) -> None:
    path = tmp_path / "out.ckpt"
    old = b"previous complete file"
    if existing:
        path.write_bytes(old)
    value = global_value("w", (16, 4), "Float32")
    with pytest.raises(RuntimeError, match="disappeared"), CkptWriter(path) as w:
        w.write_array("first", "Float32", value)
        w.write_blocks("w", "Float32", value.shape, failing_blocks(value, 9))
    if existing:
        assert path.read_bytes() == old
    else:
        assert not path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out.ckpt"] if existing else [])


def test_writer_publishes_only_on_commit(tmp_path: Path) -> None:
    path = tmp_path / "out.ckpt"
    w = CkptWriter(path, fsync=False)
    w.write_array("x", "Int8", np.arange(4, dtype=np.int8))
    assert not path.exists()
    assert w.commit() == path
    assert [p.name for p in tmp_path.iterdir()] == ["out.ckpt"]
    with CkptReader(path) as r:
        assert r.array("x").tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------- cross-checks


def test_writer_output_matches_generated_protobuf_parser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt_encoding, "MS_SLICE_BYTES", 40)  # splits the 48- and 96-byte tensors
    path = tmp_path / "all.ckpt"
    expected: list[tuple[str, tuple[int, ...], str, bytes]] = []
    with CkptWriter(path) as w:
        for ms_type in ALL_TYPES:
            value = global_value(ms_type, (3, 4), ms_type)
            w.write_array(ms_type, ms_type, value)
            expected.append((ms_type, (3, 4), ms_type, value.tobytes()))
        w.write_array("scalar", "Float32", np.array(2.5, np.float32))
        expected.append(("scalar", (), "Float32", np.float32(2.5).tobytes()))
        w.write_string("s", "hello")
        expected.append(("s", (0,), "str", np.array("hello").tobytes()))
    got = pb_entries(path.read_bytes())
    merged: dict[str, tuple[str, tuple[int, ...], str, bytes]] = {}
    for tag, dims, ms_type, content in got:  # join the split Values
        old = merged.get(tag)
        merged[tag] = (tag, dims, ms_type, (old[3] if old else b"") + content)
    assert list(merged.values()) == expected
    extra = sum(math.ceil(12 * ms_dtype(t).storage.itemsize / 40) - 1 for t in ALL_TYPES)
    assert extra == 9 and len(got) == len(expected) + extra


# --------------------------------------------------------------------------- generated models


@pytest.mark.parametrize("strategy_format", ["protobuf", "json"])
def test_generated_model_shards_match_layouts(tmp_path: Path, strategy_format: generate.StrategyFormat) -> None:
    rng = np.random.default_rng(7)
    shapes = [(24, 12), (48,), (8, 6, 4), (16, 16), (12, 8)]
    types = ["Float32", "BFloat16", "Int32", "Float16", "Bool"]
    # 1-D tensors get single-axis maps here: the multi-axis 1-D case is tested in test_strategy.py
    tensors = [
        TensorDef(f"p{i}", shp, ty, random_layout(rng, shp, 8, allow_multi_axis=len(shp) > 1))
        for i, (shp, ty) in enumerate(zip(shapes, types, strict=True))
    ]
    # two axes on dimension 0 (the first listed one most significant) and one on dimension 1
    tensors.append(TensorDef("multi", (16, 6), "Float32", make_layout((2, 2, 2), [[2, 0], [1]])))
    tensors.append(TensorDef("unlisted", (5, 3), "UInt8", None))
    model = write_model(
        tmp_path / "m",
        tensors,
        device_num=8,
        strategy_format=strategy_format,
        strings={"note": "generated"},
        reference=True,
        crc=True,
        slice_bytes=200,
        prefix="ckpt_",
    )
    assert model.rank_files[3] == tmp_path / "m" / "rank_3" / "ckpt_3.ckpt"
    assert model.strategy_path is not None and model.strategy_path.suffix == (
        ".json" if strategy_format == "json" else ".ckpt"
    )
    smap = read_strategy(model.strategy_path)
    shapes = {t.name: t.shape for t in tensors}
    # JSON files carry the real shape and hold multi-axis maps expanded: fold them back to compare
    back = {k: {s: dataclasses.replace(fold_layout(lay, shapes[k]), tensor_shape=None) for s, lay in v.items()}
            for k, v in smap.layouts.items()}
    assert back == {t.name: {0: t.layout} for t in tensors if t.layout}
    names = [t.name for t in model.tensors] + ["note"]
    assert names[-3:] == ["learning_rate", "global_step", "note"]
    raw = oracle.read_layouts(model.strategy_path)  # the file's raw fields, cut without zckpt.core.layout
    assert set(raw) == {t.name for t in tensors if t.layout}
    for rank, path in enumerate(model.rank_files):
        with CkptReader(path) as r:
            assert r.has_crc
            assert r.names() == names
            assert r.string("note") == "generated"
            for t in model.tensors:
                got = r.array(t.name)
                expect = oracle.cut(model.global_value(t.name), raw, t.name, rank)
                assert same_bits(got, expect), (rank, t.name)
                if t.layout is not None:
                    assert got.shape == resolve(t.layout, t.shape).shard_shape
    assert model.reference_path is not None
    with CkptReader(model.reference_path) as r:
        assert len(r.entries["p0"].segments) == math.ceil(24 * 12 * 4 / 200)
        for t in model.tensors:
            assert same_bits(r.array(t.name), model.global_value(t.name))
        assert r.entries["learning_rate"].shape == () and r.entries["global_step"].shape == (1,)
        assert r.dtype("learning_rate").name == "Float32" and r.dtype("global_step").name == "Int32"


def test_write_model_refuses_inconsistent_input(tmp_path: Path) -> None:
    lay4 = random_layout(np.random.default_rng(1), (8, 8), 4)
    with pytest.raises(UsageError, match="4 devices"):
        write_model(tmp_path / "a", [TensorDef("w", (8, 8), "Float32", lay4)], device_num=8)
    with pytest.raises(UsageError, match="unique"):
        write_model(tmp_path / "b", [TensorDef("global_step", (1,), "Int32")], device_num=1)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_transformer_like_is_sized_and_shardable() -> None:
    target = 64 * 1024 * 1024
    tensors = transformer_like(target, device_num=8, opt_parallel=True)
    total = sum(t.nbytes for t in tensors)
    assert 0.5 * target < total <= target * 1.05
    two_d = [t for t in tensors if len(t.shape) == 2]
    assert len(two_d) >= 250 and len(tensors) >= 700
    assert {t.ms_type for t in tensors} == {"BFloat16", "Float32"}
    opt = 0
    for t in tensors:
        assert t.layout is not None and t.layout.device_num == 8
        sh = resolve(t.layout, t.shape, param=t.name)
        opt += sh.opt_size > 1
    assert opt > len(tensors) // 2
    assert len({t.name for t in tensors}) == len(tensors)


# --------------------------------------------------------------------------- fixtures


def _group_pb_values(data: bytes) -> dict[str, tuple[tuple[int, ...], str, bytes]]:
    out: dict[str, tuple[tuple[int, ...], str, bytes]] = {}
    for tag, dims, ms_type, content in pb_entries(data):
        old = out.get(tag)
        out[tag] = (dims, ms_type, (old[2] if old else b"") + content)
    return out


@pytest.mark.fixtures
@pytest.mark.parametrize("sid", SCENARIOS)
def test_fixture_checkpoints_parse_like_protobuf(fixtures_dir: Path, sid: str) -> None:
    root = fixtures_dir / sid
    if not root.is_dir():
        pytest.skip(f"scenario {sid} absent")
    files = sorted(p for p in root.rglob("*.ckpt") if not p.name.startswith("strategy"))
    assert files, f"no checkpoints in {root}"
    for path in files:
        data = path.read_bytes()
        ref = _group_pb_values(data[: -ckpt_encoding.CRC_TRAILER_LEN] if data[-17:-10] == CRC_MAGIC else data)
        with CkptReader(path) as r:
            assert r.names() == list(ref), path
            for name, (dims, ms_type, content) in ref.items():
                e = r.entries[name]
                assert (e.dims, e.ms_type) == (dims, ms_type), (path, name)
                if e.kind == "str":
                    assert r.string(name) == content.decode("utf-32-le").rstrip("\x00")
                    continue
                arr = r.array(name)
                assert arr.tobytes() == content, (path, name)
                assert arr.size == math.prod(e.shape)


@pytest.mark.fixtures
@pytest.mark.parametrize("sid", SCENARIOS)
def test_fixture_strategy_files_read(fixtures_dir: Path, sid: str) -> None:
    root = fixtures_dir / sid
    if not root.is_dir():
        pytest.skip(f"scenario {sid} absent")
    meta = json.loads((root / "meta.json").read_text())
    with CkptReader(root / "reference" / "global.ckpt") as ref:
        shapes = {n: e.shape for n, e in ref.entries.items()}
    files = sorted(root.rglob("strategy*.ckpt"))
    assert files, f"no strategy file in {root}"
    for path in files:
        smap = read_strategy(path)
        assert smap.layouts, path
        side = "dst" if "dst" in path.relative_to(root).parts else "src"
        if path.parent.name != "strategy":  # per-rank pipeline files hold one stage only
            assert smap.device_num() == meta[f"{side}_ranks"], path
        for name, per in smap.layouts.items():
            for lay in per.values():
                if name in shapes:
                    resolve(lay, shapes[name], param=name)


@pytest.mark.parametrize("crc", [False, True])
def test_writer_copies_file_ranges_between_array_blocks(tmp_path: Path, crc: bool) -> None:
    """Blocks that are ranges of other files (copied by the kernel, or through a buffer
    when a CRC trailer needs the bytes) give the same file as the bytes themselves."""
    values = np.arange(6 * 10, dtype=np.float32).reshape(6, 10)
    src = tmp_path / "chunk.bin"
    src.write_bytes(b"xx" + values[2:5].tobytes() + b"yy")
    mixed = [values[:2], FileRange(src, 2, 3 * 40), values[5:]]
    with CkptWriter(tmp_path / "a.ckpt", crc=crc) as w:
        w.write_blocks("w", "Float32", (6, 10), iter(mixed))
    with CkptWriter(tmp_path / "b.ckpt", crc=crc) as w:
        w.write_array("w", "Float32", values)
    assert (tmp_path / "a.ckpt").read_bytes() == (tmp_path / "b.ckpt").read_bytes()
    with CkptReader(tmp_path / "a.ckpt") as r:
        assert r.array("w").tobytes() == values.tobytes()


def test_writer_refuses_a_file_range_past_the_end(tmp_path: Path) -> None:
    src = tmp_path / "chunk.bin"
    src.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointFormatError, match="past the end"), CkptWriter(tmp_path / "a.ckpt") as w:
        w.write_blocks("w", "Float32", (8,), iter([FileRange(src, 0, 32)]))
    assert not list(tmp_path.glob("a.ckpt*"))


def test_many_small_file_ranges_open_each_source_once_and_copy_runs_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slice over thousands of small source pieces: the bytes are exactly the pieces in order,
    each source file is opened once, and pieces that continue each other are one copy."""
    rng = np.random.default_rng(3)
    sources = []
    for i in range(3):
        p = tmp_path / f"src{i}.bin"
        p.write_bytes(rng.integers(0, 256, 4096 * 4, dtype=np.uint8).tobytes())
        sources.append(p)
    pieces = [FileRange(sources[(k // 100) % 3], (k % 100) * 16 * 4, 16 * 4) for k in range(1200)]
    expected = b"".join(p.path.read_bytes()[p.offset:p.offset + p.length] for p in pieces)
    opened: list[str] = []
    copies: list[int] = []
    real_open, real_copy = ckpt_writer.os.open, CkptWriter._copy_range

    def counting_open(path: object, *a: object, **k: object) -> int:
        opened.append(str(path))
        return real_open(path, *a, **k)  # type: ignore[arg-type]

    def counting_copy(self: CkptWriter, block: FileRange) -> None:
        copies.append(block.length)
        real_copy(self, block)

    monkeypatch.setattr(ckpt_writer.os, "open", counting_open)
    monkeypatch.setattr(CkptWriter, "_copy_range", counting_copy)
    out = tmp_path / "out.ckpt"
    with CkptWriter(out, fsync=False) as w:
        w.write_blocks("t", "Float32", (1200, 16), pieces)
    new_file = (str(tmp_path), str(out))  # the new file's folder (unnamed) or temporary name
    assert sorted(p for p in opened if p not in new_file and not p.endswith(".tmp-zckpt")) == \
        sorted(str(p) for p in sources)
    assert copies == [100 * 16 * 4] * 12  # 12 runs of 100 consecutive pieces
    with CkptReader(out) as r:
        assert r.array("t").tobytes() == expected


@pytest.mark.parametrize("shift", [0, 1, 13])
def test_a_file_range_is_copied_by_the_kernel_only_where_its_pages_line_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shift: int
) -> None:
    """The kernel copies a range whose bytes fall at the same place in a page as the file's
    end (ext4 splices each page into two pages otherwise, dearer than a read and a write);
    any other range goes through the buffer. The bytes are the range's either way."""
    n = 3 * mmap.PAGESIZE + 100
    header = len(value_header("w", "UInt8", [n], n))  # where the payload starts in the new file
    offset = mmap.PAGESIZE + header % mmap.PAGESIZE + shift
    data = np.random.default_rng(shift).integers(0, 256, offset + n + 50, dtype=np.uint8).tobytes()
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    kernel: list[int] = []
    real = ckpt_writer.fileio.kernel_copy

    def spy(src_fd: int, dst_fd: int, at: int, length: int) -> int:
        kernel.append(length)
        return real(src_fd, dst_fd, at, length)

    monkeypatch.setattr(ckpt_writer.fileio, "kernel_copy", spy)
    with CkptWriter(tmp_path / "out.ckpt", fsync=False) as w:
        w.write_blocks("w", "UInt8", (n,), iter([FileRange(src, offset, n)]))
    assert kernel == ([n] if shift == 0 else [])
    with CkptReader(tmp_path / "out.ckpt") as r:
        assert r.array("w").tobytes() == data[offset : offset + n]


class _Bad(Exception):
    pass


@pytest.mark.parametrize(("offset", "length", "first", "stop"), [
    (100, 300, 1, 7),  # blocks 64-448 around the range: both edges read only to check
    (100, 300, 3, 7),  # its first blocks were checked for an earlier range: bytes 100-192 copied first
    (100, 300, 1, 4),  # its last blocks were: bytes 256-400 copied after the check
    (100, 300, 3, 4),  # both
    (128, 128, 2, 4),  # exactly two blocks
    (950, 50, 14, 16),  # the short last block
])
def test_a_verified_range_is_written_from_the_bytes_its_checks_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offset: int, length: int, first: int, stop: int
) -> None:
    """The writer serves the reads of a range's block checks and writes the range's part of
    them: the file holds exactly the range, every byte of the range and of the blocks is
    read once, and a damaged byte in a checked block stops the file."""
    size = 1000
    data = np.random.default_rng(offset + first).integers(0, 256, size, dtype=np.uint8).tobytes()
    src = tmp_path / "chunk.bin"
    src.write_bytes(data)
    sums = ChunkSums("crc32c", tuple(google_crc32c.value(data[i : i + 64]) for i in range(0, size, 64)), 64)

    def fail(want: ChunkSums, bad: Mismatch) -> Exception:
        return _Bad(str(bad))

    def write(out: Path) -> None:
        check = BlockCheck(src, ((sums, size, first, stop),), fail)
        with CkptWriter(out, fsync=False) as w:
            w.write_blocks("w", "UInt8", (length,), iter([FileRange(src, offset, length, None, (check,))]))

    read: list[tuple[int, int]] = []
    real_preadv = ckpt_writer.os.preadv

    def preadv(fd: int, buffers: list[memoryview], at: int) -> int:
        got = real_preadv(fd, buffers, at)
        read.append((at, got))
        return got

    monkeypatch.setattr(ckpt_writer.os, "preadv", preadv)
    monkeypatch.setattr(ckpt_writer.fileio, "kernel_copy", lambda *a: 0)  # every byte through the buffer
    write(tmp_path / "ok.ckpt")
    with CkptReader(tmp_path / "ok.ckpt") as r:
        assert r.array("w").tobytes() == data[offset : offset + length]
    touched = sorted(set(range(offset, offset + length)) | set(range(first * 64, min(size, stop * 64))))
    assert sorted(b for at, n in read for b in range(at, at + n)) == touched  # each byte read once
    for byte in (first * 64, min(size, stop * 64) - 1):
        damaged = bytearray(data)
        damaged[byte] ^= 0x20
        src.write_bytes(bytes(damaged))
        with pytest.raises(_Bad, match=f"block {byte // 64} of 16"):
            write(tmp_path / f"bad{byte}.ckpt")
        assert not list(tmp_path.glob(f"bad{byte}.ckpt*"))


@pytest.mark.parametrize("fsync", [True, False])
def test_a_growing_file_has_its_write_back_started_as_it_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               fsync: bool) -> None:
    """Every ``BEHIND_BYTES`` written (arrays, and ranges the kernel copies), the bytes since
    the last hand-over go to the write-back thread, back to back from the file's start; the
    file's bytes are those of a writer that hands nothing over. Without fsync nothing is."""
    from zckpt.io import fileio

    handed: list[tuple[str, int, int]] = []
    monkeypatch.setattr(fileio.WriteBehind, "add", lambda self, ranges: handed.extend(ranges))
    monkeypatch.setattr(ckpt_writer, "BEHIND_BYTES", 4096)
    src = tmp_path / "src.bin"
    src.write_bytes(np.arange(50_000, dtype=np.uint8).tobytes())
    data = np.arange(6000, dtype=np.float32).reshape(60, 100)
    out = {}
    for name, big in (("handed", 4096), ("plain", 1 << 62)):
        monkeypatch.setattr(ckpt_writer, "BEHIND_BYTES", big)
        with CkptWriter(tmp_path / f"{name}.ckpt", fsync=fsync) as w:
            w.write_array("a", "Float32", data)
            w.write_blocks("b", "UInt8", (50_000 - 4096,), [FileRange(src, 4096, 50_000 - 4096)])
        out[name] = (tmp_path / f"{name}.ckpt").read_bytes()
    assert out["handed"] == out["plain"]
    mine = [(at, n) for path, at, n in handed if path.endswith("handed.ckpt")]
    if not fsync:
        assert not handed
        return
    assert mine and mine[0][0] == 0 and all(n >= 4096 for _, n in mine)
    assert all(a + n == b for (a, n), (b, _) in zip(mine, mine[1:], strict=False))
    assert mine[-1][0] + mine[-1][1] > len(out["handed"]) - 4096


@pytest.mark.parametrize("plain", [True, False])
def test_shards_of_one_model_share_their_names(tmp_path: Path, plain: bool) -> None:
    """Names and type names are interned as indexes are read (both walks), so a plan over
    many shards holds, and ships to another process, each name once."""
    readers = []
    for r in range(2):
        path = tmp_path / f"r{r}.ckpt"
        with CkptWriter(path) as w:
            w.write_array("layer.weight", "Float16", np.full((2, 3), r, np.float16))
        if not plain:  # the Value's tensor before its tag: the field-by-field walk reads it
            data = path.read_bytes()
            tag = [f for f in wire.iter_fields(data, 0, len(data))][0]
            value = [f for f in wire.iter_fields(data, tag.value, tag.value + tag.length)]
            parts = [wire.encode_len_field(f.number, f.length) + data[f.value : f.value + f.length]
                     for f in reversed(value)]
            body = b"".join(parts)
            path.write_bytes(wire.encode_len_field(1, len(body)) + body)
        readers.append(CkptReader(path))
    try:
        a, b = (next(iter(r.entries.items())) for r in readers)
        assert a[0] == "layer.weight" and a[0] is b[0] and a[1].ms_type is b[1].ms_type
    finally:
        for r in readers:
            r.close()
