"""Packed arrays: token ids, log-probs and versions travel as little-endian bytes + dtype.

Never as lists of Python floats (DESIGN section 3). This module uses the standard library
only; numpy/torch conversion lives in `areal.bus.codec`.
"""

from __future__ import annotations

import array
import sys
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

DType = Literal["uint8", "int32", "int64", "float32", "float16", "bfloat16"]
ITEMSIZE: dict[str, int] = {
    "uint8": 1,
    "int32": 4,
    "int64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
}
_TYPECODE = {"uint8": "B", "int32": "i", "int64": "q", "float32": "f"}


class PackedArray(BaseModel):
    """A 1-D array as dtype + little-endian bytes."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    dtype: DType
    data: bytes

    @model_validator(mode="after")
    def _check_len(self) -> PackedArray:
        if len(self.data) % ITEMSIZE[self.dtype]:
            raise ValueError(
                f"packed array of dtype {self.dtype} has {len(self.data)} bytes, "
                f"not a multiple of {ITEMSIZE[self.dtype]}"
            )
        return self

    def __len__(self) -> int:
        return len(self.data) // ITEMSIZE[self.dtype]

    @classmethod
    def from_list(cls, values: list[int] | list[float], dtype: DType) -> PackedArray:
        if dtype not in _TYPECODE:
            raise ValueError(f"from_list supports {sorted(_TYPECODE)}, not {dtype}")
        arr = array.array(_TYPECODE[dtype], values)
        if sys.byteorder != "little":
            arr.byteswap()
        return cls(dtype=dtype, data=arr.tobytes())

    def to_list(self) -> list:
        if self.dtype not in _TYPECODE:
            raise ValueError(f"to_list supports {sorted(_TYPECODE)}, not {self.dtype}")
        arr = array.array(_TYPECODE[self.dtype])
        arr.frombytes(self.data)
        if sys.byteorder != "little":
            arr.byteswap()
        return arr.tolist()
