"""The bytes of a ``.ckpt`` file as MindSpore lays them out, for whoever writes or sizes one.

A ``Value`` header (:func:`value_header`), how MindSpore slices a large tensor into several
Values (:func:`value_rows`) and the CRC trailer. The writer
(:mod:`zckpt.formats.ckpt_writer`) encodes with them, and so do the generators and the
dry-run estimates that write or size files without it (:mod:`zckpt.jobs.generate` on
purpose: reader tests must not read only what zckpt's writer writes). Parsing is
:mod:`zckpt.formats.ckpt_index`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import numpy as np

from zckpt.core.dtypes import STRING_TYPE, ms_dtype
from zckpt.formats import wire

CRC_MAGIC = b"crc_num"
CRC_TRAILER_LEN = len(CRC_MAGIC) + 10
MS_SLICE_BYTES = 512 * 1024 * 1024
"""MindSpore writes a tensor larger than this as several Values (np.array_split on axis 0)."""


def value_header(name: str, ms_type: str, dims: Iterable[int], content_len: int) -> bytes:
    """Bytes of a top-level ``Checkpoint.value`` field up to (not including) its content."""
    tag = name.encode("utf-8")
    tensor_prefix = _tensor_prefix(tuple(int(d) for d in dims), ms_type, content_len)
    tensor_len = len(tensor_prefix) + content_len
    value_prefix = wire.encode_len_field(1, len(tag)) + tag + wire.encode_len_field(2, tensor_len)
    value_len = len(value_prefix) + tensor_len
    return wire.encode_len_field(1, value_len) + value_prefix + tensor_prefix


def string_value(name: str, value: str) -> bytes:
    """A whole ``append_dict`` string entry, as MindSpore writes it (dims [0], type "str")."""
    payload = np.array(value).tobytes()
    return value_header(name, STRING_TYPE, [0], len(payload)) + payload


def map_value(name: str, body: bytes) -> bytes:
    """A whole MapParameter entry around its encoded ``MapTensorProto`` body."""
    return map_header(name, len(body)) + body


def map_header(name: str, body_len: int) -> bytes:
    """A MapParameter entry's bytes before its body of ``body_len`` bytes."""
    tag = name.encode("utf-8")
    value_len = len(wire.encode_len_field(1, len(tag))) + len(tag) + len(wire.encode_len_field(3, body_len)) + body_len
    return wire.encode_len_field(1, value_len) + wire.encode_len_field(1, len(tag)) + tag + \
        wire.encode_len_field(3, body_len)


@functools.lru_cache(maxsize=1 << 16)
def tensor_values(name: str, ms_type: str, shape: tuple[int, ...]) -> tuple[tuple[bytes, int], ...]:
    """A tensor's ``Value`` fields as MindSpore lays them out: each one's header and the
    length of the data that follows it (:func:`value_rows`). Kept per name, type and shape:
    a scale-up to 512 files frames each tensor 512 times in a few shapes."""
    itemsize = ms_dtype(ms_type).storage.itemsize
    row_bytes = (math.prod(shape[1:]) if shape else 1) * itemsize
    return tuple((value_header(name, ms_type, list(shape), rows * row_bytes), rows * row_bytes)
                 for rows in value_rows(shape, itemsize))


def value_rows(shape: tuple[int, ...], itemsize: int) -> list[int]:
    """Rows of axis 0 in each ``Value`` of a tensor: one Value, or above MindSpore's slice
    size as many as MindSpore makes (``np.array_split`` of axis 0)."""
    total = math.prod(shape) * itemsize
    if total > MS_SLICE_BYTES and shape and shape[0] > 1:
        parts = min(shape[0], math.ceil(total / 1024 / (MS_SLICE_BYTES / 1024)))
        base, extra = divmod(shape[0], parts)
        return [base + (1 if i < extra else 0) for i in range(parts)]
    return [shape[0] if shape else 1]


@functools.lru_cache(maxsize=4096)
def _tensor_prefix(dims: tuple[int, ...], ms_type: str, content_len: int) -> bytes:
    """A ``TensorProto``'s fields before its content: the same for every tensor of one shape
    and type (100 000 small tensors share a few dozen), so encoded once each."""
    dims_bytes = b"".join(wire.encode_key(1, wire.WIRE_VARINT) + wire.encode_varint(d) for d in dims)
    type_bytes = ms_type.encode("ascii")
    return dims_bytes + wire.encode_len_field(2, len(type_bytes)) + type_bytes + wire.encode_len_field(3, content_len)
