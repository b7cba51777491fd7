"""The checked-in protobuf modules agree with ``proto/``, and with zckpt's own wire reader.

``zckpt/third_party/mindspore_proto/*_pb2.py`` embed a serialized ``FileDescriptorProto``; compiling
``proto/*.proto`` afresh must give the same descriptor, otherwise someone edited one side
without running ``python -m zckpt.third_party.mindspore_proto.regen``. The second half checks that bytes
produced by the generated classes are read by :class:`CkptReader` exactly as protobuf
itself reads them, including encodings MindSpore does not emit but protobuf allows.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from google.protobuf import descriptor_pb2, text_format

from zckpt.formats import wire
from zckpt.formats.ckpt import CkptReader
from zckpt.third_party.mindspore_proto import ms_checkpoint_pb2, ms_node_strategy_pb2, regen

PROTO_DIR = Path(__file__).resolve().parents[1] / "proto"
MODULES: dict[str, ModuleType] = {
    "ms_checkpoint.proto": ms_checkpoint_pb2,
    "ms_node_strategy.proto": ms_node_strategy_pb2,
}


# --------------------------------------------------------------------------- descriptors


def _strip_json_names(msg: descriptor_pb2.DescriptorProto) -> None:
    for f in msg.field:
        f.ClearField("json_name")
    for f in msg.extension:
        f.ClearField("json_name")
    for nested in msg.nested_type:
        _strip_json_names(nested)


def normalized(fdp: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """Drop what protoc adds to descriptor sets but never embeds in Python modules (json_name)."""
    out = descriptor_pb2.FileDescriptorProto()
    out.CopyFrom(fdp)
    for m in out.message_type:
        _strip_json_names(m)
    for f in out.extension:
        f.ClearField("json_name")
    return out


def compile_protos(proto_dir: Path, out: Path) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    protoc = pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools is not installed")
    files = sorted(p.name for p in proto_dir.glob("*.proto"))
    args = ["protoc", f"-I{proto_dir}", f"--descriptor_set_out={out}", *[str(proto_dir / f) for f in files]]
    assert protoc.main(args) == 0, f"protoc failed on {proto_dir}"
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return {f.name: f for f in fds.file}


def differences(
    compiled: dict[str, descriptor_pb2.FileDescriptorProto], modules: dict[str, ModuleType]
) -> dict[str, str]:
    """File name -> readable description of how the compiled and embedded descriptors differ."""
    diffs: dict[str, str] = {}
    for name in sorted(set(compiled) | set(modules)):
        if name not in compiled:
            diffs[name] = "generated module has no .proto source"
            continue
        if name not in modules:
            diffs[name] = ".proto has no generated module"
            continue
        embedded = descriptor_pb2.FileDescriptorProto.FromString(modules[name].DESCRIPTOR.serialized_pb)
        fresh = normalized(compiled[name])
        if fresh != normalized(embedded):
            diffs[name] = (
                "compiled:\n"
                + text_format.MessageToString(fresh)
                + "\nembedded:\n"
                + text_format.MessageToString(embedded)
            )
    return diffs


def test_generated_modules_match_proto_sources(tmp_path: Path) -> None:
    compiled = compile_protos(PROTO_DIR, tmp_path / "set.pb")
    assert set(compiled) == set(MODULES)
    assert differences(compiled, MODULES) == {}, "run `python -m zckpt.third_party.mindspore_proto.regen`"


def test_descriptor_comparison_detects_an_edited_proto(tmp_path: Path) -> None:
    edited = tmp_path / "proto"
    shutil.copytree(PROTO_DIR, edited)
    src = edited / "ms_checkpoint.proto"
    text = src.read_text()
    assert "required bytes tensor_content = 3;" in text
    src.write_text(text.replace("required bytes tensor_content = 3;", "required bytes tensor_content = 4;"))
    diffs = differences(compile_protos(edited, tmp_path / "set.pb"), MODULES)
    assert set(diffs) == {"ms_checkpoint.proto"}
    assert "number: 4" in diffs["ms_checkpoint.proto"]


def test_descriptor_comparison_detects_a_missing_module(tmp_path: Path) -> None:
    compiled = compile_protos(PROTO_DIR, tmp_path / "set.pb")
    diffs = differences(compiled, {"ms_checkpoint.proto": ms_checkpoint_pb2})
    assert set(diffs) == {"ms_node_strategy.proto"}


def test_regen_tool_covers_every_proto() -> None:
    assert regen.proto_dir() == PROTO_DIR
    assert sorted(regen.PROTO_FILES) == sorted(p.name for p in PROTO_DIR.glob("*.proto"))
    for name, module in MODULES.items():
        assert module.DESCRIPTOR.name == name


# --------------------------------------------------------------------------- wire compatibility


def add_tensor(msg: ms_checkpoint_pb2.Checkpoint, tag: str, dims: list[int], ms_type: str, content: bytes) -> None:
    v = msg.value.add()
    v.tag = tag
    v.tensor.dims.extend(dims)
    v.tensor.tensor_type = ms_type
    v.tensor.tensor_content = content


def test_checkpoint_built_with_generated_classes_reads_identically(tmp_path: Path) -> None:
    w = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    bf = np.array([0x3F80, 0xBF80, 0x7FC1, 0x0001], dtype=np.uint16)
    big = np.arange(10, dtype=np.int32).reshape(5, 2)
    msg = ms_checkpoint_pb2.Checkpoint()
    add_tensor(msg, "w", [2, 3], "Float32", w.tobytes())
    add_tensor(msg, "bf", [4], "BFloat16", bf.tobytes())
    add_tensor(msg, "lr", [], "Float64", np.float64(0.125).tobytes())
    add_tensor(msg, "big", [5, 2], "Int32", big[:3].tobytes())  # MindSpore's split: same tag,
    add_tensor(msg, "big", [5, 2], "Int32", big[3:].tobytes())  # full dims, part of the content
    add_tensor(msg, "epoch", [0], "str", np.array("three").tobytes())
    mv = msg.value.add()
    mv.tag = "table"
    for arr in (np.arange(3, dtype=np.int64), np.ones((3, 2), np.float32), np.zeros(3, np.int32)):
        t = mv.maptensor.tensor.add()
        t.dims.extend(arr.shape)
        t.tensor_type = str(arr.dtype)
        t.tensor_content = arr.tobytes()
    data = msg.SerializeToString()
    # MindSpore writes one Checkpoint message per Value; concatenated they are this message.
    per_value = b"".join(ms_checkpoint_pb2.Checkpoint(value=[v]).SerializeToString() for v in msg.value)
    assert per_value == data
    path = tmp_path / "pb.ckpt"
    path.write_bytes(data)
    with CkptReader(path) as r:
        assert r.names() == ["w", "bf", "lr", "big", "epoch", "table"]
        assert [r.entries[n].kind for n in r.names()] == ["tensor"] * 4 + ["str", "map"]
        assert r.array("w").tobytes() == w.tobytes() and r.array("w").shape == (2, 3)
        assert r.array("bf").dtype == np.uint16 and r.array("bf").tolist() == bf.tolist()
        assert r.array("lr").shape == () and float(r.array("lr")) == 0.125
        assert len(r.entries["big"].segments) == 2
        assert np.array_equal(r.array("big"), big)
        assert r.string("epoch") == "three"
        assert r.map_bytes("table") == mv.maptensor.SerializeToString()


def _key(number: int, wire_type: int) -> bytes:
    return wire.encode_key(number, wire_type)


def _len_field(number: int, payload: bytes) -> bytes:
    return wire.encode_len_field(number, len(payload)) + payload


def test_reader_accepts_every_encoding_protobuf_accepts(tmp_path: Path) -> None:
    """Reordered fields, packed dims and unknown fields: legal protobuf, never written by MindSpore."""
    content = np.arange(6, dtype=np.int16).tobytes()
    unknown = (
        _key(9, wire.WIRE_VARINT)
        + wire.encode_varint(300)
        + _key(10, wire.WIRE_I32)
        + b"\x01\x02\x03\x04"
        + _key(11, wire.WIRE_I64)
        + b"\x00" * 8
        + _len_field(12, b"ignored")
    )
    packed_dims = _len_field(1, wire.encode_varint(2) + wire.encode_varint(3))
    tensor = _len_field(3, content) + unknown + _len_field(2, b"Int16") + packed_dims
    value = _len_field(2, tensor) + unknown + _len_field(1, b"odd")
    data = _len_field(1, value)

    parsed = ms_checkpoint_pb2.Checkpoint()
    parsed.ParseFromString(data)
    canonical = ms_checkpoint_pb2.Checkpoint()
    add_tensor(canonical, "odd", [2, 3], "Int16", content)
    parsed.DiscardUnknownFields()
    assert parsed == canonical

    path = tmp_path / "odd.ckpt"
    path.write_bytes(data)
    with CkptReader(path) as r:
        e = r.entries["odd"]
        assert (e.dims, e.ms_type) == ((2, 3), "Int16")
        assert r.array("odd").tolist() == [[0, 1, 2], [3, 4, 5]]


def test_negative_and_large_dims_decode_like_protobuf(tmp_path: Path) -> None:
    """int64 dims are two's complement varints: protobuf and zckpt must agree on the value."""
    msg = ms_checkpoint_pb2.Checkpoint()
    add_tensor(msg, "neg", [-1], "Float32", b"")
    data = msg.SerializeToString()
    back = ms_checkpoint_pb2.Checkpoint.FromString(data)
    assert list(back.value[0].tensor.dims) == [-1]
    path = tmp_path / "neg.ckpt"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"negative dimension in dims \[-1\]"):
        CkptReader(path)
