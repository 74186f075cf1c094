"""Weights through the run's object store, on their own NATS connection in their own thread.

A new policy version is megabytes here and gigabytes for a real model. Moved over the worker's
one connection and event loop, it would queue sample publishes, acks and lease heartbeats
behind it on the socket and keep the loop busy parsing chunks. `WeightsChannel` runs a second
connection on an event loop in a daemon thread ("areal-weights"); the worker's loop only awaits
the result.

Transfer: `put` writes 1 MiB chunks (the library's default is 128 KiB); `get` reads the chunk
subject through an ordered consumer into a list joined once at the end (the library's `get`
concatenates bytes chunk by chunk, which is quadratic in the object's size), and for announced
weights stops at the announced size: an object of another size is refused before its first
chunk, and chunks past the size are never joined. Every transfer has
a deadline that grows with its size, so a stuck transfer fails with a clear error instead of
hanging the worker; the caller retries (rollout workers poll for the latest version).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.js.api import ObjectMeta, ObjectMetaOptions
from nats.js.errors import NotFoundError

from areal.bus.auth import NO_CREDENTIALS, Credentials, Denials
from areal.bus.connection import connect
from areal.bus.errors import WeightsRejected

T = TypeVar("T")

CHUNK_BYTES = 1024 * 1024
THREAD_NAME = "areal-weights"


def transfer_timeout_s(nbytes: int) -> float:
    """Deadline of one transfer: 30 s plus 10 s per 100 MiB (well under 10 MiB/s is stuck)."""
    return 30.0 + nbytes / (10 * 1024 * 1024)


class WeightsChannel:
    """Object-store puts, gets and deletes of one bucket, run on a private connection + loop."""

    def __init__(
        self, url: str, client_name: str, bucket: str, credentials: Credentials = NO_CREDENTIALS
    ) -> None:
        self.url, self.client_name, self.bucket = url, client_name, bucket
        self.credentials = credentials
        self._denials = Denials()  # a put this account may not make times out: say why
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._nc: Client | None = None
        self._obs = None

    async def start(self) -> None:
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=THREAD_NAME, daemon=True
        )
        self._thread.start()
        await asyncio.wrap_future(ready)

    def _run(self, ready: concurrent.futures.Future) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self._nc = loop.run_until_complete(
                connect(
                    self.url, self.client_name, credentials=self.credentials, denials=self._denials
                )
            )
            self._obs = loop.run_until_complete(self._nc.jetstream().object_store(self.bucket))
        except BaseException as e:  # noqa: BLE001 - handed to the starting coroutine
            loop.close()
            ready.set_exception(e)
            return
        self._loop = loop
        ready.set_result(None)
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(self._nc.close())
            finally:
                loop.close()

    async def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("weights channel is not started")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    # ------------------------------------------------------------ the caller's side
    async def put(self, name: str, data: bytes) -> None:
        await self._call(self._put(name, data))

    async def get(self, name: str, nbytes: int | None = None) -> bytes:
        """The object `name`; with `nbytes` (announced weights) it must hold exactly that many
        bytes (`WeightsRejected` otherwise: checked before the first chunk and while reading)."""
        return await self._call(self._get(name, nbytes))

    async def delete(self, name: str) -> None:
        await self._call(self._obs.delete(name))

    async def close(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            await asyncio.to_thread(self._thread.join, 10.0)
            self._loop = None

    # ------------------------------------------------------------ on the channel's loop
    async def _put(self, name: str, data: bytes) -> None:
        meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=CHUNK_BYTES))
        try:
            await asyncio.wait_for(
                self._obs.put(name, data, meta=meta), transfer_timeout_s(len(data))
            )
        except asyncio.TimeoutError:
            if self._denials.any():  # the server refused a chunk or the metadata: no outage
                raise self._denials.error(self._denials.last()) from None
            raise TimeoutError(
                f"storing weights {name} ({len(data)} bytes) in bucket {self.bucket} took over "
                f"{transfer_timeout_s(len(data)):.0f} s (is JetStream up and its disk not full?)"
            ) from None

    async def _get(self, name: str, nbytes: int | None) -> bytes:
        try:
            info = await self._obs.get_info(name)
        except NotFoundError:
            raise FileNotFoundError(f"no object {name} in bucket {self.bucket}") from None
        if nbytes is None:
            nbytes = info.size or 0
        elif (info.size or 0) != nbytes:
            raise WeightsRejected(
                f"object {name} in bucket {self.bucket} holds {info.size or 0} bytes, "
                f"{nbytes} were announced"
            )
        if not nbytes:
            return b""
        try:
            return await asyncio.wait_for(
                self._read_chunks(info.nuid, info.chunks, nbytes), transfer_timeout_s(nbytes)
            )
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"reading weights {name} ({info.size} bytes, {info.chunks} chunks) from bucket "
                f"{self.bucket} took over {transfer_timeout_s(info.size):.0f} s"
            ) from None

    async def _read_chunks(self, nuid: str, n_chunks: int, nbytes: int) -> bytes:
        """The object's chunks, joined; stops at `n_chunks` and refuses more than `nbytes`."""
        sub = await self._nc.jetstream().subscribe(
            f"$O.{self.bucket}.C.{nuid}", ordered_consumer=True
        )
        parts: list[bytes] = []
        total = 0
        try:
            async for msg in sub.messages:
                parts.append(msg.data)
                total += len(msg.data)
                if total > nbytes:
                    raise WeightsRejected(
                        f"object chunks {nuid} in bucket {self.bucket} hold more than the "
                        f"{nbytes} bytes announced"
                    )
                if len(parts) == n_chunks:
                    break
        finally:
            await sub.unsubscribe()
        return b"".join(parts)
