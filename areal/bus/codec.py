"""Codec: pydantic message <-> msgpack bytes, and packed arrays <-> numpy/torch.

Invariants: decoding never raises anything but `DecodeError` (whose text is the reason that goes
to the dead-letter subject); arrays are little-endian dtype + bytes on the wire.
"""

from __future__ import annotations

from typing import TypeVar

import msgpack
import numpy as np
from pydantic import ValidationError

from schemas import Message, PackedArray

M = TypeVar("M", bound=Message)


class DecodeError(ValueError):
    """A payload that is not a valid message of the expected type."""


def encode(msg: Message) -> bytes:
    return msgpack.packb(msg.model_dump(by_alias=True, mode="python"), use_bin_type=True)


def decode(data: bytes, cls: type[M]) -> M:
    try:
        obj = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise DecodeError(f"payload is not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise DecodeError(f"payload is a msgpack {type(obj).__name__}, expected a map")
    try:
        msg = cls.model_validate(obj)
    except ValidationError as e:
        errs = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors()[:5]
        )
        raise DecodeError(f"invalid {cls.kind} message: {errs}") from None
    try:
        msg.check_lengths()
    except ValueError as e:
        raise DecodeError(str(e)) from None
    return msg


_NP_DTYPES = {"uint8": "u1", "int32": "<i4", "int64": "<i8", "float32": "<f4", "float16": "<f2"}


def pack(values: np.ndarray | list, dtype: str) -> PackedArray:
    arr = np.ascontiguousarray(np.asarray(values), dtype=_NP_DTYPES[dtype])
    return PackedArray(dtype=dtype, data=arr.tobytes())


def unpack(arr: PackedArray) -> np.ndarray:
    if arr.dtype not in _NP_DTYPES:
        raise DecodeError(f"unsupported packed dtype {arr.dtype}")
    return np.frombuffer(arr.data, dtype=_NP_DTYPES[arr.dtype])
