"""The Zarr v3 extension data type ``bfloat16`` for zarr-python, backed by ``ml_dtypes``.

zarr-python (3.1 at least) has no ``bfloat16`` of its own: an array whose ``zarr.json``
says ``"data_type": "bfloat16"`` fails to open with "No Zarr data type found". TensorStore,
zarrs and other readers implement the registered extension
(zarr-extensions ``data-types/bfloat16``: no configuration, 2 bytes, little- or big-endian
under the ``bytes`` codec, fill value written as for the core IEEE 754 types). This module
adds it to zarr-python's data-type registry, mapping it to ``ml_dtypes.bfloat16`` (the numpy
dtype JAX and TensorStore use), so ``a[...]`` returns bfloat16 numbers with their exact bits.

It imports nothing from zckpt on purpose: a program that reads a zckpt store with
zarr-python alone can copy this one file (or run it) and call :func:`register`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self, TypeGuard

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.common import DataTypeValidationError, HasEndianness, HasItemSize
from zarr.core.dtype.wrapper import ZDType

NAME = "bfloat16"
BF16 = np.dtype(ml_dtypes.bfloat16)
_SPECIAL: dict[str, int] = {"NaN": 0x7FC0, "Infinity": 0x7F80, "-Infinity": 0xFF80}


def bits_from_json(value: Any) -> int:
    """The 16 bits of a Zarr v3 fill value: a JSON number, ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"`` or ``"0x"`` with four hex digits (the only way to name a particular NaN)."""
    if isinstance(value, str):
        if value in _SPECIAL:
            return _SPECIAL[value]
        if value.startswith("0x") and len(value) == 6:
            return int(value, 16)
        raise ValueError(f"bfloat16 fill value {value!r} is not a number, 'NaN', '+/-Infinity' or '0xHHHH'")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"bfloat16 fill value {value!r} is not a number")
    return int(np.array(value, dtype=BF16).view("<u2"))


def bits_to_json(bits: int) -> float | str:
    """A fill value's JSON: a number when it is one exactly, else the spec's special strings."""
    value = float(np.array(bits, dtype="<u2").view(BF16))
    if math.isnan(value):
        return "NaN" if bits == _SPECIAL["NaN"] else f"0x{bits:04x}"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


@dataclass(frozen=True, kw_only=True)
class BFloat16(ZDType[Any, Any], HasEndianness, HasItemSize):
    """Zarr's ``bfloat16``: numpy ``ml_dtypes.bfloat16`` values, 2 bytes each."""

    dtype_cls: ClassVar[type[Any]] = type(BF16)
    _zarr_v3_name: ClassVar[str] = NAME

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> Self:
        if cls._check_native_dtype(dtype):
            return cls(endianness="big" if dtype.byteorder == ">" else "little")
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {BF16}")

    def to_native_dtype(self) -> Any:
        return BF16.newbyteorder(">" if self.endianness == "big" else "<")

    @classmethod
    def _check_json_v3(cls, data: object) -> TypeGuard[str]:
        return data == NAME or (isinstance(data, dict) and data.get("name") == NAME
                                and not data.get("configuration"))

    @classmethod
    def _from_json_v2(cls, data: object) -> Self:
        raise DataTypeValidationError("bfloat16 is a Zarr v3 extension data type; Zarr v2 has no name for it")

    @classmethod
    def _from_json_v3(cls, data: object) -> Self:
        if cls._check_json_v3(data):
            return cls()
        raise DataTypeValidationError(f"Invalid JSON representation of bfloat16: {data!r}")

    def to_json(self, zarr_format: Literal[2, 3]) -> Any:
        if zarr_format == 3:
            return NAME
        raise ValueError("bfloat16 is a Zarr v3 extension data type; it cannot be written as Zarr v2")

    def _check_scalar(self, data: object) -> bool:
        return isinstance(data, (int, float, np.integer, np.floating, BF16.type)) and not isinstance(data, bool)

    def cast_scalar(self, data: object) -> Any:
        if not self._check_scalar(data):
            raise TypeError(f"Cannot convert {data!r} ({type(data).__name__}) to a bfloat16 scalar")
        return BF16.type(data)

    def default_scalar(self) -> Any:
        return BF16.type(0)

    def from_json_scalar(self, data: Any, *, zarr_format: Literal[2, 3]) -> Any:
        try:
            bits = bits_from_json(data)
        except ValueError as err:
            raise TypeError(str(err)) from None
        return np.array(bits, dtype="<u2").view(BF16)[()]

    def to_json_scalar(self, data: object, *, zarr_format: Literal[2, 3]) -> float | str:
        return bits_to_json(int(np.array(self.cast_scalar(data), dtype=BF16).view("<u2")))

    @property
    def item_size(self) -> int:
        return 2


def register() -> None:
    """Add :class:`BFloat16` to zarr-python's data-type registry (idempotent)."""
    data_type_registry.register(NAME, BFloat16)
