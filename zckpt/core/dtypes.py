"""MindSpore ``tensor_type`` strings and the numpy dtypes that hold their bytes.

Inside zckpt BFloat16 is carried as ``uint16`` (its exact bit pattern) with the MindSpore
name alongside, so bytes are never widened or rounded; arrays handed to users are viewed
as ``ml_dtypes.bfloat16`` (:func:`public_array`), the numpy type MindSpore also accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from zckpt.core.errors import CheckpointFormatError


@dataclass(frozen=True)
class MsDtype:
    """A MindSpore element type: its checkpoint name and the numpy dtype of its storage."""

    name: str
    storage: np.dtype


_TABLE: dict[str, str] = {
    "Bool": "|b1",
    "Int8": "|i1",
    "Int16": "<i2",
    "Int32": "<i4",
    "Int64": "<i8",
    "UInt8": "|u1",
    "UInt16": "<u2",
    "UInt32": "<u4",
    "UInt64": "<u8",
    "Float16": "<f2",
    "Float32": "<f4",
    "Float64": "<f8",
    "BFloat16": "<u2",
}

STRING_TYPE = "str"
"""MindSpore's type tag for string entries (``append_dict`` values); content is UTF-32-LE."""

MS_DTYPES: dict[str, MsDtype] = {k: MsDtype(k, np.dtype(v)) for k, v in _TABLE.items()}


BF16 = np.dtype(ml_dtypes.bfloat16)


def public_array(array: np.ndarray, ms_type: str) -> np.ndarray:
    """An entry's values as users get them: bf16 bits viewed as ``ml_dtypes.bfloat16`` (no copy)."""
    if ms_type == "BFloat16" and array.dtype != BF16:
        return array.view(BF16)
    return array


def ms_dtype(name: str, *, path: str | None = None, param: str | None = None) -> MsDtype:
    """Look up a MindSpore tensor type, refusing unknown names with a format error."""
    try:
        return MS_DTYPES[name]
    except KeyError:
        known = ", ".join(sorted(MS_DTYPES))
        raise CheckpointFormatError(
            f"unknown tensor_type {name!r} (known: {known}, {STRING_TYPE})", path=path, param=param
        ) from None


def ms_name_for_numpy(dtype: np.dtype) -> str:
    """The MindSpore name of a numpy dtype (uint16 maps to UInt16, never BFloat16)."""
    dt = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    for name, ms in MS_DTYPES.items():
        if name != "BFloat16" and ms.storage == dt:
            return name
    raise CheckpointFormatError(f"numpy dtype {dtype} has no MindSpore equivalent")
