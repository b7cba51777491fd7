"""Bounds-checked protobuf wire primitives over a memory buffer.

zckpt reads checkpoint files by walking the wire format itself so that tensor payloads
can be handed out as views of the mapped file instead of being copied into Python
``bytes`` by a generated parser. Every length is checked against the enclosing message
before it is used; nothing is allocated from a size field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

WIRE_VARINT = 0
WIRE_I64 = 1
WIRE_LEN = 2
WIRE_I32 = 5


class WireError(Exception):
    """Malformed wire data at ``offset``; the ckpt layer turns it into a CheckpointFormatError."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(f"{message} at byte {offset}")
        self.offset = offset


class Field(NamedTuple):
    """One decoded field: for length-delimited fields ``value`` is the payload offset (a
    tuple: a checkpoint header is tens of thousands of fields at hundreds of ranks, and a
    tuple is built several times faster than a frozen dataclass)."""

    number: int
    wire_type: int
    value: int
    length: int = 0


def read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """Decode a varint at ``pos``; returns (value, next position)."""
    result = 0
    shift = 0
    start = pos
    while True:
        if pos >= end:
            raise WireError("truncated varint", start)
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes", start)


def iter_fields(buf: memoryview, start: int, end: int) -> Iterator[Field]:
    """Walk the fields of the message occupying ``buf[start:end]``."""
    pos = start
    while pos < end:
        key_at = pos
        key = buf[pos]  # keys and small values are one byte: decoded here without a call
        if key < 0x80:
            pos += 1
        else:
            key, pos = read_varint(buf, pos, end)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0", key_at)
        if wire_type == WIRE_VARINT:
            value, pos = read_varint(buf, pos, end)
            yield Field(number, wire_type, value)
        elif wire_type == WIRE_LEN:
            if pos < end and buf[pos] < 0x80:
                length = buf[pos]
                pos += 1
            else:
                length, pos = read_varint(buf, pos, end)
            if length > end - pos:
                raise WireError(f"length {length} runs past the end of its message ({end - pos} bytes left)", key_at)
            yield Field(number, wire_type, pos, length)
            pos += length
        elif wire_type == WIRE_I64:
            if end - pos < 8:
                raise WireError("truncated fixed64", key_at)
            yield Field(number, wire_type, int.from_bytes(buf[pos : pos + 8], "little"))
            pos += 8
        elif wire_type == WIRE_I32:
            if end - pos < 4:
                raise WireError("truncated fixed32", key_at)
            yield Field(number, wire_type, int.from_bytes(buf[pos : pos + 4], "little"))
            pos += 4
        else:
            raise WireError(f"unsupported wire type {wire_type}", key_at)


def as_int64(value: int) -> int:
    """Reinterpret a decoded varint as a two's-complement int64."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def encode_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_key(number: int, wire_type: int) -> bytes:
    return encode_varint((number << 3) | wire_type)


def encode_len_field(number: int, payload_len: int) -> bytes:
    """Key and length prefix of a length-delimited field whose payload follows."""
    return encode_key(number, WIRE_LEN) + encode_varint(payload_len)
