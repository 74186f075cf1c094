"""Weights through the run's object store, streamed, on their own NATS connection and thread.

A new policy version is megabytes here and gigabytes for a real model. Moved over the worker's
one connection and event loop, it would queue sample publishes, acks and lease heartbeats
behind it on the socket and keep the loop busy parsing chunks. `WeightsChannel` runs a second
connection on an event loop in a daemon thread ("areal-weights"); the worker's loop only awaits
the result.

Streaming (a 1.5B model is 3 GiB in bf16): a blob is never whole in memory on either side.
- `put` takes a `WeightsBlob`, whose `chunks()` produce its bytes on demand (e.g. one tensor
  cast at a time, `areal.engines.weights_stream`); they are copied into 1 MiB object chunks
  (the library's default is 128 KiB) as the upload goes. The library's SHA-256 of what it
  stored is returned (no second pass over the bytes).
- `read_into` hands every chunk (batched direct gets of the chunk subject) to a `WeightsSink`
  as it arrives (e.g. a decoder writing straight into tensors); `get` is `read_into` a list,
  joined once (the library's `get` concatenates chunk by chunk: quadratic in the size).
- For announced weights a read stops at the announced size: an object of another size is
  refused before its first chunk, and the sink never sees a byte past the size.

Every transfer has a deadline that grows with its size, so a stuck transfer fails with a clear
error instead of hanging the worker; the caller retries (rollout workers poll for the latest).
A server whose store is full or failing makes `put` raise `ServerStorageError` (an `OSError`
with ENOSPC or EIO), which the trainer's storage guard pauses on, as on a full local disk.
An upload given up (its deadline, an error, the caller cancelled) purges the chunks it stored:
no object names them, so nothing else would ever delete them (up to a whole blob each).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import threading
from collections.abc import Coroutine
from datetime import datetime, timezone
from typing import Any, TypeVar

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import Header, ObjectInfo, ObjectMetaOptions
from nats.js.errors import APIError, NotFoundError
from nats.js.kv import MSG_ROLLUP_SUBJECT
from nats.nuid import NUID

from areal.bus.auth import NO_CREDENTIALS, Credentials, Denials
from areal.bus.blobs import CHUNK_BYTES, BytesBlob, BytesSink, WeightsBlob, WeightsSink
from areal.bus.connection import connect
from areal.bus.errors import WeightsRejected, server_storage_error

log = structlog.get_logger()
T = TypeVar("T")

THREAD_NAME = "areal-weights"
DIRECT_BATCH = 16  # chunks per direct-get request (16 MiB in flight at most)
REPLY_TIMEOUT_S = 30.0  # most seconds between two replies of a read
DIGEST_PREFIX = "SHA-256="  # the object store's digest: SHA-256=<urlsafe base64>
PURGE_TIMEOUT_S = 10.0  # most seconds the purge of an abandoned upload's chunks may take


def transfer_timeout_s(nbytes: int) -> float:
    """Deadline of one transfer: 30 s plus 10 s per 100 MiB (well under 10 MiB/s is stuck)."""
    return 30.0 + nbytes / (10 * 1024 * 1024)


class _BlobReader:
    """A blob as a file-like reader (`readinto`, run in an executor thread, as the blob may
    compute its pieces): fills each chunk buffer whole from the blob's pieces, whatever their size."""

    def __init__(self, blob: WeightsBlob) -> None:
        self._pieces = blob.chunks()
        self._rest = memoryview(b"")

    def readinto(self, buf: bytearray) -> int:
        out, n = memoryview(buf), 0
        while n < len(out):
            if not self._rest:
                piece = next(self._pieces, None)
                if piece is None:
                    break
                self._rest = memoryview(piece).cast("B")
                continue
            k = min(len(self._rest), len(out) - n)
            out[n : n + k] = self._rest[:k]
            self._rest, n = self._rest[k:], n + k
        return n


def hex_of_object_digest(digest: str | None) -> str:
    """The hex SHA-256 of an object store digest (`SHA-256=<urlsafe base64>`)."""
    if not digest or not digest.startswith(DIGEST_PREFIX):
        raise ValueError(f"object digest {digest!r} is not {DIGEST_PREFIX}<base64>")
    return base64.urlsafe_b64decode(digest[len(DIGEST_PREFIX) :]).hex()


class WeightsChannel:
    """Object-store puts, gets and deletes of one bucket, run on a private connection + loop."""

    def __init__(
        self, url: str, client_name: str, bucket: str, credentials: Credentials = NO_CREDENTIALS
    ) -> None:
        self.url, self.client_name, self.bucket = url, client_name, bucket
        self.credentials = credentials
        self._denials = Denials()  # a put this account may not make times out: say why
        self._loop: asyncio.AbstractEventLoop | None = None  # set once started
        self._thread: threading.Thread | None = None
        self._nc: Client | None = None
        self._js = None
        self._obs = None
        self._nuids = NUID()  # of the uploads' chunk subjects (used on the channel's loop only)
        self._ops: set[asyncio.Task] = set()  # the callers' operations under way on that loop

    async def start(self) -> None:
        """Connect on a new thread's loop. A start that fails or is cancelled (a caller giving
        up during an outage: the connect retries forever) stops that thread, which closes what
        it opened, so nothing is left behind for a later start to duplicate."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._run, args=(loop,), name=THREAD_NAME, daemon=True)
        thread.start()
        try:
            await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(self._op(self._open()), loop)
            )
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)  # the connect, if still trying, is cancelled
            raise
        self._loop, self._thread = loop, thread

    async def _open(self) -> None:
        self._nc = await connect(
            self.url, self.client_name, credentials=self.credentials, denials=self._denials
        )
        self._js = self._nc.jetstream()
        self._obs = await self._js.object_store(self.bucket)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(self._shutdown())
            finally:
                loop.close()

    async def _shutdown(self) -> None:
        """The loop was stopped: the operations still under way are cancelled (an upload then
        purges its chunks; one cancelled already is purging them) and given `PURGE_TIMEOUT_S`
        to end, then the connection is closed."""
        await asyncio.sleep(0)  # an operation handed over just before the stop starts (joins _ops)
        for task in self._ops:
            if not task.cancelling():
                task.cancel()
        if self._ops:
            await asyncio.wait(self._ops, timeout=PURGE_TIMEOUT_S)
        if self._nc is not None:
            await self._nc.close()

    async def _op(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro`, known to `_shutdown` while it runs (on the channel's loop)."""
        task = asyncio.current_task()
        self._ops.add(task)
        try:
            return await coro
        finally:
            self._ops.discard(task)

    async def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("weights channel is not started")
        return await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self._op(coro), self._loop)
        )

    # ------------------------------------------------------------ the caller's side
    async def put(self, name: str, data: bytes | WeightsBlob) -> str:
        """Store `data` as object `name`; returns the SHA-256 (hex) of what was stored."""
        blob = BytesBlob(data) if isinstance(data, bytes | bytearray | memoryview) else data
        return await self._call(self._put(name, blob))

    async def get(self, name: str, nbytes: int | None = None) -> bytes:
        """The object `name`; with `nbytes` (announced weights) it must hold exactly that many
        bytes (`WeightsRejected` otherwise: checked before the first chunk and while reading)."""
        sink = BytesSink()
        await self.read_into(name, nbytes, sink)
        return sink.value()

    async def read_into(self, name: str, nbytes: int | None, sink: WeightsSink) -> int:
        """Stream the object `name` into `sink`, chunk by chunk; returns its size. `nbytes`
        as for `get` (the sink never receives more than that)."""
        return await self._call(self._read(name, nbytes, sink))

    async def delete(self, name: str) -> None:
        await self._call(self._obs.delete(name))

    async def close(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            await asyncio.to_thread(self._thread.join, PURGE_TIMEOUT_S + 5.0)
            self._loop = None

    # ------------------------------------------------------------ on the channel's loop
    async def _put(self, name: str, blob: WeightsBlob) -> str:
        timeout_s = transfer_timeout_s(blob.nbytes)
        try:
            info = await asyncio.wait_for(self._store(name, blob), timeout_s)
        except APIError as e:  # a full store answers 10047 or 10051 ("no space left on device")
            what = f"storing weights {name} ({blob.nbytes} bytes) in bucket {self.bucket}"
            full = server_storage_error(e.err_code, e.description, what)
            if full is None:
                raise
            raise full from e
        except asyncio.TimeoutError:
            if self._denials.any():  # the server refused a chunk or the metadata: no outage
                raise self._denials.error(self._denials.last()) from None
            raise TimeoutError(
                f"storing weights {name} ({blob.nbytes} bytes) in bucket {self.bucket} took over "
                f"{timeout_s:.0f} s (is JetStream up and its disk not full?)"
            ) from None
        if info.size != blob.nbytes:
            raise RuntimeError(
                f"weights {name}: the blob produced {info.size} bytes, it said {blob.nbytes}"
            )
        return hex_of_object_digest(info.digest)

    def _chunk_subject(self, nuid: str) -> str:
        return f"$O.{self.bucket}.C.{nuid}"

    async def _store(self, name: str, blob: WeightsBlob) -> ObjectInfo:
        """nats-py's `ObjectStore.put` (the same messages), except that an upload given up (an
        error, its deadline, a caller that gave up) purges its chunks: the library does so only
        for an error, and keeps the chunk subject to itself. Chunks go to
        `$O.<bucket>.C.<new nuid>`, then the metadata (rolled up) to
        `$O.<bucket>.M.<name in base64>`; the chunks of the object replaced are purged last."""
        try:
            old = await self._obs.get_info(name)
        except NotFoundError:  # none, or deleted
            old = None
        nuid = self._nuids.next().decode()
        subject, reader, buf = self._chunk_subject(nuid), _BlobReader(blob), bytearray(CHUNK_BYTES)
        digest, size, n_chunks = hashlib.sha256(), 0, 0
        loop = asyncio.get_running_loop()
        # the publish in flight; shielded, so a chunk sent when the upload is given up is
        # stored (acked) before the purge, not after it
        sent: asyncio.Future | None = None
        try:
            while n := await loop.run_in_executor(None, reader.readinto, buf):
                payload = buf[:n]  # a copy: the buffer is refilled for the next chunk
                digest.update(payload)
                sent = asyncio.ensure_future(self._js.publish(subject, payload))
                await asyncio.shield(sent)
                size, n_chunks = size + n, n_chunks + 1
            info = ObjectInfo(
                name=name,
                bucket=self.bucket,
                nuid=nuid,
                size=size,
                chunks=n_chunks,
                digest=DIGEST_PREFIX + base64.urlsafe_b64encode(digest.digest()).decode(),
                mtime=datetime.now(timezone.utc).isoformat(),
                options=ObjectMetaOptions(max_chunk_size=CHUNK_BYTES),
            )
            meta_subject = f"$O.{self.bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
            sent = asyncio.ensure_future(
                self._js.publish(
                    meta_subject,
                    json.dumps(info.as_dict()).encode(),
                    headers={Header.ROLLUP: MSG_ROLLUP_SUBJECT},
                )
            )
            await asyncio.shield(sent)
        except BaseException:  # an error, the deadline, or cancelled: purge, then raise
            await self._drop_chunks(name, nuid, sent)
            raise
        if old is not None and old.nuid and old.nuid != nuid:
            await self._js.purge_stream(f"OBJ_{self.bucket}", subject=self._chunk_subject(old.nuid))
        return info

    async def _drop_chunks(self, name: str, nuid: str, sent: asyncio.Future | None) -> None:
        """Purge the chunks an upload given up stored on `nuid`, once its publish in flight
        (`sent`) is settled, unless its metadata made it (given up while the last ack was on the
        way: the object is whole, and a retry replaces it). Best effort, at most
        `PURGE_TIMEOUT_S`; a failure is logged (the chunks then stay)."""

        async def drop() -> None:
            if sent is not None:
                await asyncio.wait({sent})  # stored or failed: no chunk lands after the purge
            try:
                if (await self._obs.get_info(name)).nuid == nuid:
                    return
            except NotFoundError:
                pass
            await self._js.purge_stream(f"OBJ_{self.bucket}", subject=self._chunk_subject(nuid))

        try:
            await asyncio.wait_for(drop(), PURGE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - best effort: the upload's own outcome counts
            log.warning(
                "weights_chunks_not_purged",
                bucket=self.bucket,
                name=name,
                subject=self._chunk_subject(nuid),
                error=f"{type(e).__name__}: {e}",
            )

    async def _read(self, name: str, nbytes: int | None, sink: WeightsSink) -> int:
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
            return 0
        try:
            await asyncio.wait_for(
                self._read_chunks(info.nuid, info.chunks, nbytes, sink),
                transfer_timeout_s(nbytes),
            )
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"reading weights {name} ({info.size} bytes, {info.chunks} chunks) from bucket "
                f"{self.bucket} took over {transfer_timeout_s(info.size):.0f} s, or the server "
                f"sent nothing for {REPLY_TIMEOUT_S:.0f} s"
            ) from None
        return nbytes

    async def _read_chunks(self, nuid: str, n_chunks: int, nbytes: int, sink: WeightsSink) -> None:
        """The object's chunks into `sink`, in order, by batched direct gets of its chunk
        subject (`DIRECT_BATCH` chunks per request: ~5x an ordered consumer's 40 MiB/s, whose
        flow control bounds it; a server without batches answers one chunk per request).
        Stops at `n_chunks` and refuses more than `nbytes` (before the sink sees the chunk that
        would pass it)."""
        subject = f"$O.{self.bucket}.C.{nuid}"
        api = f"$JS.API.DIRECT.GET.OBJ_{self.bucket}"
        replies: asyncio.Queue = asyncio.Queue()  # at most one batch in flight

        async def on_reply(msg: Msg) -> None:
            replies.put_nowait(msg)

        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(inbox, cb=on_reply)
        seen = total = 0
        next_seq = 1
        try:
            while seen < n_chunks:
                want = min(DIRECT_BATCH, n_chunks - seen)
                req = {"seq": next_seq, "next_by_subj": subject, "batch": want}
                await self._nc.publish(api, json.dumps(req).encode(), reply=inbox)
                while True:
                    msg = await asyncio.wait_for(replies.get(), REPLY_TIMEOUT_S)
                    headers = msg.headers or {}
                    if headers.get("Status"):
                        self._end_of_batch(headers, nuid, seen, n_chunks)
                        break
                    total += len(msg.data)
                    if total > nbytes:
                        raise WeightsRejected(
                            f"object chunks {nuid} in bucket {self.bucket} hold more than the "
                            f"{nbytes} bytes announced"
                        )
                    sink.write(memoryview(msg.data))
                    seen += 1
                    next_seq = int(headers["Nats-Sequence"]) + 1
                    if "Nats-Num-Pending" not in headers:  # no batches here: one per request
                        break
        finally:
            await sub.unsubscribe()

    def _end_of_batch(self, headers: dict, nuid: str, seen: int, n_chunks: int) -> None:
        """A status reply: the end of a batch (204), or chunks that are gone (404)."""
        status, why = headers.get("Status"), headers.get("Description", "")
        if status == "204":
            return
        if status == "404":
            raise FileNotFoundError(
                f"object chunks {nuid} in bucket {self.bucket}: {seen} of {n_chunks} found "
                "(the object was replaced or deleted while read)"
            )
        raise RuntimeError(f"reading object chunks {nuid} in bucket {self.bucket}: {status} {why}")
