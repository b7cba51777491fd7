"""Structure-aware mutation of MindSpore files for the format fuzzers (tests only).

Random bytes rarely get past the first length prefix of a protobuf file, so most of the
reader would go untested. Instead, a valid file is parsed into a tree of fields (the
message schemas of ``proto/`` say which length-delimited fields are sub-messages), the
tree is mutated where the reader makes decisions (varints, lengths, dims, type strings,
tags, field order, wire types) and re-encoded with correct framing around the damage;
byte-level damage (truncation, bit flips, CRC trailers) is applied on top.

Every random choice goes through a :class:`Chooser`, so the same mutators run under
Hypothesis (``TapeChooser``: choices come from a drawn byte tape, failures shrink) and
under a plain seeded ``random.Random`` (``RandomChooser``: the memory-capped subprocess
and corpus generation).

:func:`exercise_ckpt` opens a file and calls every :class:`CkptReader` accessor; whatever
the reader accepts must be self-consistent (the views hold exactly the indexed payload
bytes), and whatever it refuses must be refused with a :class:`ZckptError`.
"""

from __future__ import annotations

import json
import math
import os
import random
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from zckpt.core.errors import ZckptError
from zckpt.formats import wire
from zckpt.formats.ckpt import CkptReader
from zckpt.formats.ckpt_encoding import CRC_MAGIC, value_header
from zckpt.formats.strategy import (
    StrategyMap,
    encode_strategy,
    encode_strategy_json,
    make_layout,
    read_strategies,
    read_strategy,
)
from zckpt.third_party.mindspore_proto import ms_checkpoint_pb2 as ckpt_pb

T = TypeVar("T")

COUNTS: Counter[str] = Counter()
"""Inputs tried per fuzz target, and how many were refused (``<target>:refused``)."""


# --------------------------------------------------------------------------- choices


class Chooser(Protocol):
    def integer(self, lo: int, hi: int) -> int: ...

    def pick(self, items: Sequence[T]) -> T: ...

    def raw(self, max_len: int) -> bytes: ...


class RandomChooser:
    """Choices from a seeded ``random.Random`` (reproducible from the seed alone)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def pick(self, items: Sequence[T]) -> T:
        return items[self.rng.randrange(len(items))]

    def raw(self, max_len: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, max_len))


class TapeChooser:
    """Choices read from a tape of bytes (4 per choice), then from a Random seeded by it.

    Under Hypothesis the tape is one drawn ``binary`` (:func:`tape_strategy`): drawing
    every choice separately (``data.draw``) or as a list of integers costs ~5 ms per input
    in Hypothesis' bookkeeping, a 128-byte string ~1 ms, and the 10 000-input run has to
    fit in a CI minute. Shrinking the tape towards zero bytes still shrinks every choice
    towards the first option, so failures minimise.
    """

    def __init__(self, tape: bytes) -> None:
        self.tape = tape
        self.pos = 0
        self.rng = random.Random(tape)

    def _next(self) -> int:
        if self.pos + 4 <= len(self.tape):
            self.pos += 4
            return int.from_bytes(self.tape[self.pos - 4 : self.pos], "little")
        return self.rng.getrandbits(32)

    def integer(self, lo: int, hi: int) -> int:
        return lo + self._next() % (hi - lo + 1)

    def pick(self, items: Sequence[T]) -> T:
        return items[self.integer(0, len(items) - 1)]

    def raw(self, max_len: int) -> bytes:
        n = self.integer(0, max_len)
        return random.Random(self._next()).randbytes(n)


def tape_strategy(length: int = 128) -> Any:
    """Hypothesis strategy of a choice tape for :class:`TapeChooser`."""
    from hypothesis import strategies as st

    return st.binary(min_size=length, max_size=length)


# --------------------------------------------------------------------------- field trees


@dataclass
class Node:
    """One protobuf field. ``value`` is an int (varint/fixed), raw bytes (a leaf) or the
    child fields of a sub-message; the overrides let a mutation lie about the framing."""

    number: int
    wire_type: int
    value: int | bytes | list[Node]
    msg: str | None = None
    key_raw: bytes | None = None
    len_raw: bytes | None = None
    pad: int = 0


CKPT_SCHEMA: dict[str, dict[int, str]] = {
    "Checkpoint": {1: "Value"},
    "Value": {2: "TensorProto", 3: "MapTensorProto"},
    "TensorProto": {},
    "MapTensorProto": {1: "TensorProto"},
}
STRATEGY_SCHEMA: dict[str, dict[int, str]] = {
    "ParallelStrategyMap": {2: "ParallelStrategyItem", 3: "ParallelLayoutItem"},
    "ParallelStrategyItem": {2: "ParallelStrategys"},
    "ParallelStrategys": {2: "Dims"},
    "ParallelLayoutItem": {2: "ParallelLayouts"},
    "ParallelLayouts": {1: "Dims", 2: "Dims", 3: "Dims", 4: "Dims"},
    "Dims": {},
}


def parse(data: bytes, schema: dict[str, dict[int, str]], msg: str) -> list[Node]:
    """Fields of a valid message, sub-messages parsed recursively per ``schema``."""
    buf = memoryview(data)
    out: list[Node] = []
    for f in wire.iter_fields(buf, 0, len(data)):
        if f.wire_type != wire.WIRE_LEN:
            out.append(Node(f.number, f.wire_type, f.value))
            continue
        raw = bytes(buf[f.value : f.value + f.length])
        child = schema[msg].get(f.number)
        if child is not None:
            try:
                out.append(Node(f.number, f.wire_type, parse(raw, schema, child), msg=child))
                continue
            except wire.WireError:
                pass
        out.append(Node(f.number, f.wire_type, raw))
    return out


def varint(value: int, pad: int = 0) -> bytes:
    """Varint of ``value`` (negative as 10-byte two's complement), with ``pad`` redundant
    continuation bytes (valid up to 10 bytes in all, overlong beyond)."""
    b = bytearray(wire.encode_varint(value))
    for _ in range(pad):
        b[-1] |= 0x80
        b.append(0)
    return bytes(b)


def encode(nodes: Sequence[Node]) -> bytes:
    out = bytearray()
    for n in nodes:
        out += n.key_raw if n.key_raw is not None else varint((n.number << 3) | n.wire_type)
        v = n.value
        if n.wire_type == wire.WIRE_LEN:
            payload = encode(v) if isinstance(v, list) else v if isinstance(v, bytes) else varint(int(v))
            out += n.len_raw if n.len_raw is not None else varint(len(payload), n.pad)
            out += payload
        elif n.wire_type == wire.WIRE_I64:
            out += ((v if isinstance(v, int) else 0) % 2**64).to_bytes(8, "little")
        elif n.wire_type == wire.WIRE_I32:
            out += ((v if isinstance(v, int) else 0) % 2**32).to_bytes(4, "little")
        else:
            out += varint(v if isinstance(v, int) else 0, n.pad)
    return bytes(out)


@dataclass
class Site:
    """Where a node sits: its sibling list, index, and the message type of that list."""

    siblings: list[Node]
    index: int
    parent_msg: str

    @property
    def node(self) -> Node:
        return self.siblings[self.index]


def sites(nodes: list[Node], msg: str) -> list[Site]:
    out: list[Site] = []
    for i, n in enumerate(nodes):
        out.append(Site(nodes, i, msg))
        if isinstance(n.value, list) and n.msg is not None:
            out.extend(sites(n.value, n.msg))
    return out


def messages(nodes: list[Node], msg: str, wanted: str) -> list[list[Node]]:
    """Child lists of every sub-message of type ``wanted`` (the root too when it matches)."""
    out = [nodes] if msg == wanted else []
    for n in nodes:
        if isinstance(n.value, list) and n.msg is not None:
            out.extend(messages(n.value, n.msg, wanted))
    return out


# --------------------------------------------------------------------------- interesting values

INTERESTING_INTS = [
    0, 1, 2, 3, 7, 8, 127, 128, 255, 256, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**62,
    2**63 - 1, 2**63, 2**64 - 1, -1, -2, -(2**31), -(2**63),
]
INTERESTING_DIMS: list[list[int]] = [
    [], [0], [1], [3], [2, 2], [1, 2, 3], [-1], [-1, -1], [2, -2],
    [2**62, 2**62], [2**31, 2**31, 2**31], [2**63 - 1], [2**63 - 1, 0], [0, 2**63 - 1],
    [2**32, 2**32, 0], [2**61, 0], [0, 2**61], [2**30, 2**31, 0], [2**30, 2**31 - 1, 0],
    [1] * 32, [1] * 33, [0] * 40, [1] * 200, [2**64 - 1],
]
INTERESTING_TYPES: list[bytes] = [
    b"Float8", b"", b"float32", b"Float32\x00", b"\xff\xfe", b"str", b"Float64", b"Bool", b"BFloat16",
    b"Int4", b"Float32" * 50, b"\xc3\xa9", b"map", b"UInt64", b"Int8", b"Complex64",
]
INTERESTING_TAGS: list[bytes] = [
    b"\xff", b"\xc3", b"", b"a\x00b", "\u00e9\u4e2d".encode(), b"x" * 5000, b"\xed\xa0\x80", b"../../etc/passwd",
    b"w", b"b", b"s",
]


# --------------------------------------------------------------------------- valid seed files


def _tensor_proto(dims: list[int], ms_type: str, content: bytes, *, packed: bool = False) -> bytes:
    if packed:
        body = b"".join(wire.encode_varint(d) for d in dims)
        out = wire.encode_len_field(1, len(body)) + body if dims else b""
    else:
        out = b"".join(wire.encode_key(1, wire.WIRE_VARINT) + wire.encode_varint(d) for d in dims)
    t = ms_type.encode()
    return out + wire.encode_len_field(2, len(t)) + t + wire.encode_len_field(3, len(content)) + content


def _value(tag: str, field_no: int, body: bytes) -> bytes:
    t = tag.encode()
    v = wire.encode_len_field(1, len(t)) + t + wire.encode_len_field(field_no, len(body)) + body
    return wire.encode_len_field(1, len(v)) + v


def _map_body() -> bytes:
    m = ckpt_pb.MapTensorProto()
    for dims, typ, content in (([2], "Int64", b"\1" * 16), ([2, 2], "Float32", b"\2" * 16)):
        t = m.tensor.add()
        t.dims.extend(dims)
        t.tensor_type = typ
        t.tensor_content = content
    return m.SerializeToString()


def seed_files(*, maps: bool = True) -> dict[str, bytes]:
    """Small valid ``.ckpt`` files covering every shape of entry the reader knows (without
    ``maps``: all but MapParameters, and no CRC trailers)."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((3, 4), dtype=np.float32)
    big = np.arange(12, dtype=np.int32).reshape(6, 2)
    cut = rng.standard_normal((3, 3))
    parts = [
        value_header("w", "Float32", [3, 4], w.nbytes) + w.tobytes(),
        value_header("b", "BFloat16", [5], 10) + np.arange(5, dtype=np.uint16).tobytes(),
        value_header("s", "Int64", [], 8) + (42).to_bytes(8, "little"),
        value_header("z", "Float32", [0], 4) + b"\0\0\x80?",
        value_header("e", "Float16", [0, 3], 0),
        _value("packed", 2, _tensor_proto([2, 2], "UInt8", b"\1\2\3\4", packed=True)),
        value_header("flag", "Bool", [2], 2) + b"\1\0",
    ]
    for piece in np.array_split(big, 3):  # MindSpore's multi-Value split by rows
        parts.append(value_header("big", "Int32", [6, 2], piece.nbytes) + piece.tobytes())
    raw = cut.tobytes()
    for lo, hi in ((0, 32), (32, 72)):  # split by bytes, cutting a row
        parts.append(value_header("cut", "Float64", [3, 3], hi - lo) + raw[lo:hi])
    text = np.array("lr=0.1 \u00e9").tobytes()
    parts.append(value_header("note", "str", [0], len(text)) + text)
    full = b"".join(parts) + _value("emb_table", 3, _map_body())
    small = value_header("x", "Float32", [2], 8) + b"\0\0\x80?\0\0\0@"
    if not maps:
        return {"full": b"".join(parts), "small": small}
    return {
        "full": full,
        "full_crc": with_crc(full),
        "small": small,
        "small_crc": with_crc(small),
    }


def with_crc(content: bytes, crc: int | None = None) -> bytes:
    value = zlib.crc32(content) if crc is None else crc
    return content + CRC_MAGIC + value.to_bytes(10, "big")


def strip_crc(data: bytes) -> tuple[bytes, bool]:
    n = len(CRC_MAGIC) + 10
    if len(data) >= n and data[-n:-10] == CRC_MAGIC:
        return data[:-n], True
    return data, False


# --------------------------------------------------------------------------- mutations


SIZE_OPS = ("varint", "length", "overlong", "dims", "content")
"""Mutations of the fields a reader sizes things from: the dangerous ones for memory."""


def _mutate_tree(c: Chooser, root: list[Node], schema: dict[str, dict[int, str]], root_msg: str,
                 all_tags: Sequence[bytes], only: Sequence[str] = ()) -> str:
    """Apply one structural mutation in place; returns its name (for statistics)."""
    ops = ["varint", "length", "overlong", "dup", "swap", "delete", "wiretype", "fieldnum", "bytes", "unknown"]
    if root_msg == "Checkpoint":
        ops += ["dims", "dims", "dtype", "dtype", "tag", "tag", "content"]
    else:
        ops += ["dims", "dims"]
    op = c.pick(list(only) or ops)
    every = sites(root, root_msg)
    if not every:
        root.append(Node(c.integer(1, 20), c.pick([0, 1, 2, 5]), c.raw(8)))
        return "append"
    site = c.pick(every)
    node = site.node
    if op == "varint":
        cands = [s for s in every if s.node.wire_type == wire.WIRE_VARINT]
        if cands:
            c.pick(cands).node.value = c.pick(INTERESTING_INTS) if c.integer(0, 3) else c.integer(0, 2**64 - 1)
    elif op == "length":
        cands = [s for s in every if s.node.wire_type == wire.WIRE_LEN]
        if cands:
            n = c.pick(cands).node
            real = len(encode(n.value)) if isinstance(n.value, list) else len(n.value)  # type: ignore[arg-type]
            n.len_raw = varint(c.pick([*INTERESTING_INTS, real + 1, max(real - 1, 0), real * 2, real + 2**32]))
    elif op == "overlong":
        k = c.integer(1, 12)
        if c.integer(0, 1):
            node.key_raw = varint((node.number << 3) | node.wire_type, k)
        else:
            node.pad = k
    elif op == "dup":
        site.siblings.insert(c.integer(0, len(site.siblings)), _clone(node))
    elif op == "swap" and len(site.siblings) > 1:
        j = c.integer(0, len(site.siblings) - 1)
        site.siblings[site.index], site.siblings[j] = site.siblings[j], site.siblings[site.index]
    elif op == "delete":
        del site.siblings[site.index]
    elif op == "wiretype":
        node.key_raw = varint((node.number << 3) | c.integer(0, 7))
    elif op == "fieldnum":
        node.number = c.pick([0, 1, 2, 3, 4, 5, 15, 16, 2**29 - 1, 2**32, 2**61])
    elif op == "bytes":
        cands = [s for s in every if isinstance(s.node.value, (bytes, list)) and s.node.wire_type == wire.WIRE_LEN]
        if cands:
            n = c.pick(cands).node
            n.value = c.pick([*INTERESTING_TYPES, *INTERESTING_TAGS]) if c.integer(0, 1) else c.raw(40)
            n.msg = None
    elif op == "unknown":
        wt = c.pick([0, 1, 2, 3, 4, 5, 6, 7])
        value: int | bytes = c.raw(12) if wt == wire.WIRE_LEN else c.pick(INTERESTING_INTS) & (2**64 - 1)
        site.siblings.insert(site.index, Node(c.pick([4, 5, 9, 100, 2**20]), wt, value))
    elif op == "dims":
        target = "TensorProto" if root_msg == "Checkpoint" else "Dims"
        msgs = messages(root, root_msg, target)
        if msgs:
            _set_dims(c, c.pick(msgs), c.pick(INTERESTING_DIMS) if c.integer(0, 3) else _near_dims(c, c.pick(msgs)))
    elif op == "dtype":
        tensors = messages(root, root_msg, "TensorProto")
        if tensors:
            set_leaf(c.pick(tensors), 2, c.pick(INTERESTING_TYPES))
    elif op == "tag":
        values = messages(root, root_msg, "Value")
        if values:
            set_leaf(c.pick(values), 1, c.pick([*INTERESTING_TAGS, *all_tags]))
    elif op == "content":
        tensors = messages(root, root_msg, "TensorProto")
        if tensors:
            t = c.pick(tensors)
            old = next((n.value for n in t if n.number == 3 and isinstance(n.value, bytes)), b"")
            set_leaf(t, 3, c.pick([b"", old[:-1], old + b"\0", old[: len(old) // 2], old * 2, c.raw(16)]))
    return op


def _clone(node: Node) -> Node:
    v = [_clone(x) for x in node.value] if isinstance(node.value, list) else node.value
    return replace(node, value=v)


def _near_dims(c: Chooser, fields: list[Node]) -> list[int]:
    """The message's own dims, one of them nudged: dims that disagree with the payload."""
    dims = [int(n.value) for n in fields if n.number == 1 and isinstance(n.value, int)]
    if not dims:
        return [c.integer(0, 9)]
    i = c.integer(0, len(dims) - 1)
    dims[i] = c.pick([dims[i] + 1, dims[i] - 1, dims[i] * 2, 0, -dims[i]])
    return dims


def _set_dims(c: Chooser, fields: list[Node], dims: list[int]) -> None:
    """Replace the dims (packed or not); dims with no elements often get an empty payload
    too, so that the dims themselves (not the payload size) must be refused."""
    keep = [n for n in fields if n.number != 1]
    if math.prod(dims) == 0 and c.integer(0, 1):
        set_leaf(keep, 3, b"")
    if c.integer(0, 2) == 0:  # packed
        new = [Node(1, wire.WIRE_LEN, b"".join(varint(d) for d in dims))]
    else:
        new = [Node(1, wire.WIRE_VARINT, d & (2**64 - 1)) for d in dims]
    fields[:] = new + keep


def set_leaf(fields: list[Node], number: int, value: bytes) -> None:
    for n in fields:
        if n.number == number and n.wire_type == wire.WIRE_LEN:
            n.value = value
            n.msg = None
            return
    fields.append(Node(number, wire.WIRE_LEN, value))


def _mutate_bytes(c: Chooser, data: bytes) -> tuple[bytes, str]:
    op = c.pick(["truncate", "flip", "flip", "insert", "delete", "overwrite", "crc"])
    n = len(data)
    if op == "truncate":
        return data[: c.integer(0, n)], op
    b = bytearray(data)
    if op == "flip" and n:
        for _ in range(c.integer(1, 4)):
            i = c.integer(0, n - 1)
            b[i] ^= 1 << c.integer(0, 7)
        return bytes(b), op
    if op == "insert":
        i = c.integer(0, n)
        return bytes(b[:i]) + c.raw(8) + bytes(b[i:]), op
    if op == "delete" and n:
        i = c.integer(0, n - 1)
        return bytes(b[:i] + b[i + c.integer(1, 16) :]), op
    if op == "overwrite" and n:
        i = c.integer(0, n - 1)
        val = varint(c.pick(INTERESTING_INTS))
        b[i : i + len(val)] = val
        return bytes(b[:n]), op
    content, _ = strip_crc(data)
    kind = c.pick(["good", "bad", "short", "magic_only", "huge", "double"])
    if kind == "good":
        return with_crc(content), "crc_good"
    if kind == "bad":
        return with_crc(content, (zlib.crc32(content) + c.integer(1, 2**32 - 1)) % 2**32), "crc_bad"
    if kind == "short":
        return with_crc(content)[: -c.integer(1, 9)], "crc_short"
    if kind == "magic_only":
        return content + CRC_MAGIC, "crc_magic_only"
    if kind == "huge":
        return content + CRC_MAGIC + (2**80 - 1).to_bytes(10, "big"), "crc_huge"
    return with_crc(with_crc(content)), "crc_double"


def mutate_ckpt(c: Chooser, seeds: dict[str, bytes], only: Sequence[str] = ()) -> tuple[bytes, list[str]]:
    """One malformed ``.ckpt`` (sometimes an accidental valid one): tree then byte damage.

    ``only`` restricts the tree mutations (and drops the byte-level ones), e.g. to
    :data:`SIZE_OPS`."""
    mode = c.integer(2, 14) if only else c.integer(0, 19)
    if mode == 0:
        return c.raw(64), ["random"]
    if mode == 1:
        return b"", ["empty"]
    base = seeds[c.pick(sorted(seeds))]
    content, crc = strip_crc(base)
    applied: list[str] = []
    if mode < 15:
        tree = parse(content, CKPT_SCHEMA, "Checkpoint")
        tags = [n.value for v in messages(tree, "Checkpoint", "Value") for n in v
                if n.number == 1 and isinstance(n.value, bytes)]
        for _ in range(c.integer(1, 3)):
            applied.append(_mutate_tree(c, tree, CKPT_SCHEMA, "Checkpoint", tags, only))
        content = encode(tree)
    data = with_crc(content) if crc else content
    for _ in range(0 if only else c.integer(0 if mode < 15 else 1, 2)):
        data, op = _mutate_bytes(c, data)
        applied.append(op)
    return data, applied


# --------------------------------------------------------------------------- strategies


def seed_strategy() -> StrategyMap:
    layouts = {
        "w": {0: make_layout((2, 2), [[1], [0]], opt_shard_size=0)},
        "b": {0: make_layout((2, 2, 1), [[1, 0]], opt_shard_size=-1)},
        "e": {0: make_layout((4,), [[], []], opt_shard_size=2, opt_shard_step=1, param_split_shape=(), )},
        "u": {0: make_layout((2, 2), [[0], [], [1]], param_split_shape=(3, 5), indices_offset=(0, 3))},
    }
    return StrategyMap(layouts=layouts, operator_strategies={"MatMul-op0": (0, ((2, 1), (1, 2)))})


def seed_strategy_bytes() -> dict[str, bytes]:
    smap = seed_strategy()
    pipe = StrategyMap(layouts={"w": {0: make_layout((4,), [[0], []]), 1: make_layout((4,), [[], [0]])}})
    return {
        "plain": encode_strategy(smap),
        "pipeline": encode_strategy(pipe, merged=True, current_stage=1),
    }


def mutate_strategy_pb(c: Chooser, seeds: dict[str, bytes]) -> tuple[bytes, list[str]]:
    mode = c.integer(0, 9)
    if mode == 0:
        return c.raw(64), ["random"]
    data = seeds[c.pick(sorted(seeds))]
    applied: list[str] = []
    if mode < 8:
        tree = parse(data, STRATEGY_SCHEMA, "ParallelStrategyMap")
        for _ in range(c.integer(1, 3)):
            applied.append(_mutate_tree(c, tree, STRATEGY_SCHEMA, "ParallelStrategyMap", [b"w", b"0-w"]))
        data = encode(tree)
    for _ in range(c.integer(0 if mode < 8 else 1, 2)):
        data, op = _mutate_bytes(c, data)
        applied.append(op)
    return data, applied


JSON_SPECIALS: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**63, -(2**64), 1.5, 2.0, float("inf"), float("-inf"), float("nan"),
    "", "1", "x", [], [[]], [None], {}, {"dim": 1}, [1, 2], [[0], [-1]], ["a"], [2**40], [2.0, 2.0],
]


def mutate_json_doc(c: Chooser, doc: Any, depth: int = 0) -> Any:
    """``doc`` with one value somewhere replaced (or a key deleted) by something hostile."""
    if isinstance(doc, dict) and doc and c.integer(0, 4):
        keys = sorted(doc)
        k = c.pick(keys)
        out = dict(doc)
        action = c.integer(0, 5)
        if action == 0:
            del out[k]
        elif action == 1:
            out[k + c.pick(["", "\u00e9", "\x00", "-"])] = out.pop(k)
        else:
            out[k] = mutate_json_doc(c, doc[k], depth + 1)
        return out
    if isinstance(doc, list) and doc and c.integer(0, 3):
        i = c.integer(0, len(doc) - 1)
        out_l = list(doc)
        if c.integer(0, 4) == 0:
            out_l.append(c.pick(JSON_SPECIALS))
        else:
            out_l[i] = mutate_json_doc(c, doc[i], depth + 1)
        return out_l
    return c.pick(JSON_SPECIALS)


def json_text(doc: Any) -> str:
    return json.dumps(doc, allow_nan=True)


RAW_JSON_TEXTS = [
    "", "{", "[]", "null", "1", '"x"', "{}", "[" * 50_000 + "]" * 50_000, '{"parallel_layout_item": ' * 5000,
    '{"parallel_layout_item": {"w": {"dev_matrix": [' + "9" * 5000 + '], "tensor_map": [0]}}}',
    '{"parallel_strategy_item": [1, 2]}', '{"parallel_layout_item": [1]}',
    '{"parallel_layout_item": {"w": {"dev_matrix": [Infinity], "tensor_map": [0]}}}',
    '{"parallel_layout_item": {"w": {"dev_matrix": [2], "tensor_map": [0], "field": NaN}}}',
    '{"parallel_layout_item": {"99999999999999999999-w": {"dev_matrix": [2], "tensor_map": [0]}}}',
    '{"parallel_layout_item": {"w": {"dev_matrix": [4294967295, 4294967295], "tensor_map": [0, 1]}}}',
    '{"parallel_layout_item": {"w": {"dev_matrix": [2], "tensor_map": [0], "tensor_shape": "abc"}}}',
    '\ufeff{"parallel_layout_item": {}}',
]


# --------------------------------------------------------------------------- exercising readers


def expect_refusal(fn: Callable[..., object], *args: object) -> None:
    """``fn`` must fail with a ZckptError (anything else propagates and fails the test)."""
    try:
        fn(*args)
    except ZckptError:
        return
    raise AssertionError(f"{getattr(fn, '__name__', fn)}{args} was accepted")


def tolerate(fn: Callable[..., T], *args: object) -> T | None:
    """``fn``'s result, or ``None`` when it refuses with a ZckptError (others propagate)."""
    try:
        return fn(*args)
    except ZckptError:
        return None


class Scratch:
    """One file rewritten in place for every input: ``pwrite`` then ``ftruncate`` to the new
    length on a kept descriptor cost ~70 us, where creating the file (or truncating a
    recently mapped one to 0 first) costs ~0.5-1 ms on slow sandboxes and would dominate
    a 10 000-input run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def write(self, data: bytes) -> Path:
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))
        return self.path

    def close(self) -> None:
        os.close(self._fd)


def exercise_ckpt(path: Path, data: bytes, seed: int = 0, *, verify_crc: bool = True) -> str:
    """Open ``path`` (holding ``data``) and call every accessor on every entry; returns
    ``"refused"`` or ``"accepted"``.

    Accepted entries are checked for self-consistency against the raw file bytes, so a
    reader that accepts damage must at least serve exactly the bytes it indexed.
    """
    rng = random.Random(seed)
    try:
        reader = CkptReader(path, verify_crc=verify_crc)
    except ZckptError:
        return "refused"
    with reader as r:
        assert r.content_end <= len(data)
        for name, e in r.entries.items():
            assert r.entry(name) is e and name in r
            for s in e.segments:
                assert s.offset >= 0 and s.offset + s.length <= r.content_end, (name, s)
            raw = b"".join(data[s.offset : s.offset + s.length] for s in e.segments)
            assert e.nbytes == len(raw)
            assert r.map_bytes(name) == raw
            tolerate(r.string, name)
            if e.kind != "tensor":
                expect_refusal(r.array, name)
                expect_refusal(r.dtype, name)
                expect_refusal(r.rows, name, 0, 1)
                expect_refusal(lambda n: list(r.row_blocks(n, 64)), name)
                assert r.row_bytes_range(name, 0, 1) is None
                continue
            _check_tensor(r, name, raw, data, rng)
        for missing in ("\0no such entry", "", "w\0"):
            if missing not in r.entries:
                for acc in (r.array, r.string, r.map_bytes, r.dtype):
                    expect_refusal(acc, missing)
                expect_refusal(r.rows, missing, 0, 1)
                expect_refusal(r.row_bytes_range, missing, 0, 1)
                expect_refusal(lambda n: list(r.row_blocks(n, 64)), missing)
        if r.has_crc:
            tolerate(r.verify_crc)
    return "accepted"


def _check_tensor(r: CkptReader, name: str, raw: bytes, data: bytes, rng: random.Random) -> None:
    e = r.entries[name]
    dt = r.dtype(name).storage
    arr = r.array(name)
    assert arr.shape == e.shape and arr.dtype == dt and arr.tobytes() == raw, name
    if not e.shape:
        assert r.rows(name, 0, 0).tobytes() == raw  # a 0-d tensor has no rows: the whole value
        assert [b.tobytes() for _, b in r.row_blocks(name, 1)] == [raw]
        assert r.row_bytes_range(name, 0, 1) is None
        return
    n = e.shape[0]
    row_bytes = math.prod(e.shape[1:]) * dt.itemsize
    cuts = sorted({0, n, min(n, rng.randint(0, 3)), max(0, n - rng.randint(0, 3)), rng.randint(0, n)})
    for r0 in cuts:
        for r1 in cuts:
            if r0 > r1:
                expect_refusal(r.rows, name, r0, r1)
                continue
            got = r.rows(name, r0, r1)
            assert got.shape == (r1 - r0, *e.shape[1:]) and got.dtype == dt
            assert got.tobytes() == raw[r0 * row_bytes : r1 * row_bytes], (name, r0, r1)
            span = r.row_bytes_range(name, r0, r1)
            if span is not None:
                off, length = span
                assert length == (r1 - r0) * row_bytes
                assert data[off : off + length] == got.tobytes()
    for bad in ((-1, 0), (0, n + 1), (n + 1, n + 2)):
        expect_refusal(r.rows, name, *bad)
        assert r.row_bytes_range(name, *bad) is None
    max_bytes = rng.choice([-1, 0, 1, dt.itemsize, 7, 64, max(1, row_bytes), 10**9])
    blocks = list(r.row_blocks(name, max_bytes))
    assert b"".join(b.tobytes() for _, b in blocks) == raw
    starts = [s for s, _ in blocks]
    assert starts == sorted(starts) and starts[0] == 0


def exercise_strategy(paths: Sequence[Path], roundtrip: tuple[Scratch, Scratch] | None = None) -> str:
    """Read one or several strategy files; accepted maps must survive both encoders and
    read back identical (so nothing accepted is out of range for MindSpore's fields).

    ``roundtrip``: a ``.ckpt`` and a ``.json`` scratch file for the re-encoded map
    (default: new files next to ``paths[0]``)."""
    try:
        smap = read_strategy(paths[0]) if len(paths) == 1 else read_strategies(paths)
    except ZckptError:
        return "refused"
    for name, per in smap.layouts.items():
        assert isinstance(name, str)
        for stage, lay in per.items():
            assert isinstance(stage, int) and stage >= 0
            assert lay.dev_matrix and all(d >= 1 for d in lay.dev_matrix)
            axes = [a for t in lay.tensor_map for a in t]
            assert len(axes) == len(set(axes)) and all(0 <= a < len(lay.dev_matrix) for a in axes)
    tolerate(smap.stage_device_num)
    tolerate(smap.device_num)
    if roundtrip is None:
        roundtrip = (Scratch(paths[0].parent / "roundtrip.ckpt"), Scratch(paths[0].parent / "roundtrip.json"))
    back_pb = roundtrip[0].write(encode_strategy(smap, merged=True))  # merged: prefixes keep every stage
    back_js = roundtrip[1].write(encode_strategy_json(smap, merged=True).encode())
    want = {k: dict(v) for k, v in smap.layouts.items()}
    assert {k: dict(v) for k, v in read_strategy(back_js).layouts.items()} == want
    no_shape = {k: {s: replace(lay, tensor_shape=None) for s, lay in v.items()} for k, v in want.items()}
    assert {k: dict(v) for k, v in read_strategy(back_pb).layouts.items()} == no_shape  # no such pb field
    return "accepted"



def record(target: str, outcome: str) -> None:
    """Count one input tried against ``target`` and its outcome."""
    COUNTS[target] += 1
    COUNTS[f"{target}:{outcome}"] += 1
