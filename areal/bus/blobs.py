"""What weights stream as, in and out of the bus (no nats import: cheap to import anywhere).

A `WeightsBlob` produces a version's bytes on demand and a `WeightsSink` takes them as they
arrive, so neither the publisher nor a fetcher needs the whole blob in memory
(`areal.engines.weights_stream` has the safetensors ones; `BytesBlob` / `BytesSink` hold bytes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

__all__ = ["CHUNK_BYTES", "BytesBlob", "BytesSink", "WeightsBlob", "WeightsSink"]

CHUNK_BYTES = 1024 * 1024  # object-store chunk, file read and blob piece size


class WeightsBlob(Protocol):
    """The bytes of one weights version, produced on demand: `chunks()` may be called again
    (a retried upload) and yields exactly `nbytes` bytes in all, in pieces of any size. A
    piece may be overwritten once the next is asked for: use (copy) it before that."""

    @property
    def nbytes(self) -> int: ...

    def chunks(self) -> Iterator[bytes | memoryview]: ...


class WeightsSink(Protocol):
    """Where fetched bytes go, in order, as they arrive (called on the channel's thread)."""

    def write(self, chunk: memoryview) -> None: ...


class BytesBlob:
    """A blob already in memory (small weights, tests): its bytes in `CHUNK_BYTES` views."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")

    @property
    def nbytes(self) -> int:
        return len(self._view)

    def chunks(self) -> Iterator[memoryview]:
        for i in range(0, len(self._view), CHUNK_BYTES):
            yield self._view[i : i + CHUNK_BYTES]


class BytesSink:
    """Collects what it is given; `value()` joins it once."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, chunk: memoryview) -> None:
        self._parts.append(bytes(chunk))

    def value(self) -> bytes:
        return b"".join(self._parts)
