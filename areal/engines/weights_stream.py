"""Weights on the wire as a stream: safetensors bytes produced and decoded chunk by chunk.

A 1.5B model is 3 GiB in bf16. The trainer must not build that blob in memory beside its
weights, and a rollout worker must not hold it beside the tensors decoded from it.

- `SafetensorsBlob(state_dict, wire_dtype)` (a `WeightsBlob`): the safetensors bytes of a
  state dict, made on demand by `chunks()`: the header, then each tensor's bytes, cast to the
  wire dtype and copied to the CPU a block (`CAST_ELEMENTS`) at a time, so besides the state
  dict at most one block exists. Its size is known from the header before the first byte.
- `blob_of_safetensors(data, wire_dtype)`: the same for an engine that exports bytes
  (`TrainEngine.export_safetensors`): cast per tensor from zero-copy views of `data` (or `data`
  itself when nothing needs a cast). `export_blob(engine, wire_dtype)` picks the better of the
  two: an engine with `export_state_dict()` (`StateDictExport`) never builds a blob at all.
  `host_copy(blob)` is the opposite trade: the whole blob in one host buffer, so its upload
  can run while the trainer changes the weights (small models: `TrainerOptions`).
- `SafetensorsSink(nbytes)` (a `WeightsSink`): the decoder. Each chunk is copied straight into
  the tensor it belongs to, so only the tensors are ever in memory; `state_dict()` hands them
  over as a `FrozenStateDict` (its finiteness is then scanned once: `weights_check`).

Invariants:
- the bytes are standard safetensors (`safetensors.torch.load` reads them): an 8-byte
  little-endian header size, a JSON header padded with spaces to a multiple of 8, then the
  tensors back to back in offset order, largest element size first (so each is aligned);
- the sink trusts nothing it reads: the header must fit in the announced size and name only
  known dtypes, shapes of non-negative ints whose byte size matches their offsets, and offsets
  that tile the data section exactly (no hole, no overlap); anything else is `MalformedWeights`
  before a tensor is allocated, and it allocates no more than the announced size;
- only floating tensors are cast (`wire_dtype`); integer and bool tensors travel as they are.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from areal.bus.blobs import CHUNK_BYTES, BytesBlob, WeightsBlob
from areal.engines.weights_check import FrozenStateDict

__all__ = [
    "WIRE_DTYPES",
    "MalformedWeights",
    "SafetensorsBlob",
    "SafetensorsSink",
    "StateDictExport",
    "blob_of_safetensors",
    "export_blob",
    "wire_dtype_of",
]

WIRE_DTYPES = ("auto", "bfloat16", "float16", "float32")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
CAST_ELEMENTS = 1 << 22  # elements cast at once (8 MiB of bf16 beside the state dict)
_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_SIZE = struct.Struct("<Q")


class MalformedWeights(ValueError):
    """A weights blob that is not the safetensors its header claims (nothing was loaded)."""


@runtime_checkable
class StateDictExport(Protocol):
    """A training engine that hands out its full weights as CPU-or-device tensors, to be
    streamed without ever building a blob (`export_blob`)."""

    def export_state_dict(self) -> Mapping[str, torch.Tensor]: ...


class _ExportsBytes(Protocol):
    def export_safetensors(self) -> bytes: ...


def wire_dtype_of(wire: str, held: str) -> str:
    """The dtype floating weights travel in: `wire` (`weights.wire_dtype`), or for "auto" the
    one the trainer holds (`model.dtype`), which is also what the rollout engines load into."""
    if wire not in WIRE_DTYPES:
        raise ValueError(f"weights.wire_dtype {wire!r}: choose one of {', '.join(WIRE_DTYPES)}")
    resolved = held if wire == "auto" else wire
    if resolved not in _FLOATS:
        raise ValueError(f"weights dtype {resolved!r}: choose one of {', '.join(_FLOATS)}")
    return resolved


# ------------------------------------------------------------------ layout
@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # offsets in the data section (after the 8-byte size and the header)
    end: int


def _layout(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[bytes, list[_Entry]]:
    """(size + padded header, entries in data order) for tensors of these dtypes and shapes."""
    order = sorted(specs, key=lambda k: (-specs[k][0].itemsize, k))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    entries, pos = [], 0
    for name in order:
        dtype, shape = specs[name]
        if dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name}: dtype {dtype} cannot travel as safetensors")
        end = pos + math.prod(shape) * dtype.itemsize
        entries.append(_Entry(name, dtype, shape, pos, end))
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [pos, end]}
        pos = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return _SIZE.pack(len(raw)) + raw, entries


def _header_size(first8: bytes | memoryview, nbytes: int) -> int:
    (n,) = _SIZE.unpack(first8)
    if n < 2 or n > MAX_HEADER_BYTES or 8 + n > nbytes:
        raise MalformedWeights(
            f"weights header of {n} bytes does not fit a {nbytes}-byte blob (at most "
            f"{MAX_HEADER_BYTES}): not a safetensors blob"
        )
    return n


def _shape(name: str, raw: object) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(type(d) is int and d >= 0 for d in raw):
        raise MalformedWeights(f"tensor {name!r}: shape {str(raw)[:80]} is not a list of sizes")
    return tuple(raw)


def _parse_header(raw: bytes | memoryview, data_bytes: int) -> list[_Entry]:
    """The validated entries of a safetensors header, in data order (module invariants)."""
    try:
        header = json.loads(bytes(raw))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MalformedWeights(f"weights header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise MalformedWeights("weights header is not a JSON object")
    entries = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(meta, dict):
            raise MalformedWeights(f"tensor {name!r}: its header entry is not an object")
        dtype = _ST_DTYPES.get(meta.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise MalformedWeights(
                f"tensor {name!r}: dtype {str(meta.get('dtype'))[:20]!r} is not one of "
                f"{', '.join(_ST_DTYPES)}"
            )
        shape = _shape(name, meta.get("shape"))
        offsets = meta.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
            or offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize
        ):
            raise MalformedWeights(
                f"tensor {name!r}: offsets {str(offsets)[:60]} do not hold shape {list(shape)} "
                f"of {dtype} inside the {data_bytes}-byte data section"
            )
        entries.append(_Entry(name, dtype, shape, offsets[0], offsets[1]))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            raise MalformedWeights(
                f"tensor {e.name!r} starts at {e.begin}, not {pos}: a hole or overlap"
            )
        pos = e.end
    if pos != data_bytes:
        raise MalformedWeights(f"the tensors hold {pos} bytes, the data section {data_bytes}")
    return entries


def _pieces(raw: memoryview) -> Iterator[memoryview]:
    for i in range(0, len(raw), CHUNK_BYTES):
        yield raw[i : i + CHUNK_BYTES]


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor `t` (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# ------------------------------------------------------------------ out
class SafetensorsBlob:
    """The safetensors bytes of `state_dict`, floating tensors cast to `wire_dtype` (None: as
    they are), produced one tensor at a time (`WeightsBlob`). Holds `state_dict` (references,
    no copy) until dropped; `chunks()` may run again (a retried upload)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], wire_dtype: str | None) -> None:
        wire = _FLOATS[wire_dtype] if wire_dtype is not None else None
        self._state = state_dict
        self._dtypes = {
            k: wire if wire is not None and t.is_floating_point() else t.dtype
            for k, t in state_dict.items()
        }
        self._prefix, self._entries = _layout(
            {k: (self._dtypes[k], tuple(t.shape)) for k, t in state_dict.items()}
        )

    @property
    def nbytes(self) -> int:
        return len(self._prefix) + (self._entries[-1].end if self._entries else 0)

    def chunks(self) -> Iterator[memoryview]:
        """The blob's bytes; a piece is valid until the next one is asked for (a cast goes
        through one reused staging block, so casting allocates nothing per block)."""
        yield memoryview(self._prefix)
        staging: dict[torch.dtype, torch.Tensor] = {}
        for e in self._entries:
            t, dtype = self._state[e.name].detach(), self._dtypes[e.name]
            if t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous():
                yield from _pieces(_raw_bytes(t))  # its own bytes, no copy
                continue
            # cast (and copy off a device) a block at a time into the staging block
            if dtype not in staging:
                staging[dtype] = torch.empty(CAST_ELEMENTS, dtype=dtype)
            buf, flat = staging[dtype], t.reshape(-1)
            for i in range(0, flat.numel(), CAST_ELEMENTS):
                k = min(CAST_ELEMENTS, flat.numel() - i)
                buf[:k].copy_(flat[i : i + k])
                yield from _pieces(_raw_bytes(buf[:k]))


def _views(data: bytes, base: int, entries: list[_Entry]) -> dict[str, torch.Tensor]:
    """Zero-copy, read-only tensors over `data` (nothing writes to them: they are only cast)."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the buffer is not writable"
        for e in entries:
            if e.end == e.begin:
                out[e.name] = torch.empty(e.shape, dtype=e.dtype)
                continue
            flat = torch.frombuffer(
                data, dtype=torch.uint8, offset=base + e.begin, count=e.end - e.begin
            )
            out[e.name] = flat.view(e.dtype).reshape(e.shape)
    return out


def blob_of_safetensors(data: bytes, wire_dtype: str) -> WeightsBlob:
    """An engine's exported safetensors bytes as a blob with floating tensors in `wire_dtype`:
    `data` itself when every one already is, else cast tensor by tensor from views of it."""
    if not data:
        return BytesBlob(data)
    n = _header_size(data[:8], len(data))
    entries = _parse_header(memoryview(data)[8 : 8 + n], len(data) - 8 - n)
    wire = _FLOATS[wire_dtype]
    if all(not e.dtype.is_floating_point or e.dtype == wire for e in entries):
        return BytesBlob(data)
    return SafetensorsBlob(_views(data, 8 + n, entries), wire_dtype)


def export_blob(engine: StateDictExport | _ExportsBytes, wire_dtype: str) -> WeightsBlob:
    """The engine's weights as a blob in `wire_dtype`: streamed from `export_state_dict()`
    when the engine has it (no blob is ever built), else from `export_safetensors()`."""
    if isinstance(engine, StateDictExport):
        return SafetensorsBlob(engine.export_state_dict(), wire_dtype)
    return blob_of_safetensors(engine.export_safetensors(), wire_dtype)


def host_copy(blob: WeightsBlob) -> BytesBlob:
    """`blob`'s bytes, all of them, in one buffer of its own (read once, now): what it streamed
    from (live tensors) may change afterwards without changing the copy."""
    buf = bytearray(blob.nbytes)
    pos = 0
    for chunk in blob.chunks():
        mv = memoryview(chunk).cast("B")
        n = len(mv)
        if pos + n > len(buf):
            raise ValueError(f"blob yielded more than its {blob.nbytes} bytes")
        buf[pos : pos + n] = mv
        pos += n
    if pos != len(buf):
        raise ValueError(f"blob yielded {pos} bytes, not its {blob.nbytes}")
    return BytesBlob(buf)


# ------------------------------------------------------------------ in
class SafetensorsSink:
    """Decodes a safetensors blob of exactly `nbytes` bytes as it arrives (`WeightsSink`)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._head = bytearray()  # the 8-byte size, then the header, until parsed
        self._header_bytes: int | None = None
        self._entries: list[_Entry] | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._dst: list[memoryview] = []
        self._k = 0  # the entry being filled
        self._pos = 0  # bytes of the data section received

    def write(self, chunk: memoryview) -> None:
        mv = memoryview(chunk).cast("B")
        if self._entries is None:
            mv = self._take_header(mv)
        while mv:
            mv = self._fill(mv)

    def _take_header(self, mv: memoryview) -> memoryview:
        need = 8 if self._header_bytes is None else 8 + self._header_bytes
        take = min(need - len(self._head), len(mv))
        self._head += mv[:take]
        mv = mv[take:]
        if len(self._head) < need:
            return mv
        if self._header_bytes is None:
            self._header_bytes = _header_size(self._head, self.nbytes)
            return self._take_header(mv)
        data_bytes = self.nbytes - 8 - self._header_bytes
        self._entries = _parse_header(memoryview(self._head)[8:], data_bytes)
        self._head = bytearray()
        for e in self._entries:  # allocated, not touched: memory grows as the bytes arrive
            t = torch.empty(e.shape, dtype=e.dtype)
            self._tensors[e.name] = t
            self._dst.append(_raw_bytes(t))
        return mv

    def _fill(self, mv: memoryview) -> memoryview:
        entries = self._entries
        assert entries is not None
        while self._k < len(entries) and entries[self._k].end == self._pos:
            self._k += 1  # done (or empty)
        if self._k == len(entries):
            raise MalformedWeights("the weights blob holds more bytes than its header describes")
        e = entries[self._k]
        take = min(e.end - self._pos, len(mv))
        off = self._pos - e.begin
        self._dst[self._k][off : off + take] = mv[:take]
        self._pos += take
        return mv[take:]

    def state_dict(self) -> FrozenStateDict:
        """The decoded tensors; `MalformedWeights` unless the whole blob arrived."""
        if self._entries is None:
            raise MalformedWeights(
                f"the weights blob ended inside its header ({self.nbytes} bytes)"
            )
        data_bytes = self.nbytes - 8 - (self._header_bytes or 0)
        if self._pos != data_bytes:
            raise MalformedWeights(
                f"the weights blob ended early: {self._pos} of {data_bytes} data bytes"
            )
        return FrozenStateDict(self._tensors)
