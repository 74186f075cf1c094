"""The Bus: the one object services use to talk to NATS JetStream for one run.

Invariants:
- every JetStream publish carries `Nats-Msg-Id` = the message's deterministic id, and is retried
  with the same id when the ack times out (the server de-duplicates);
- a consumed message is held by a `Lease` that heartbeats `in_progress` until the handler settles
  it (ack only once its effect is durable: published downstream or folded into a checkpoint);
- a message that cannot be decoded, or whose handler keeps failing up to `max_deliver`, goes to
  `areal.<run>.dlq.<stage>` with the reason and is then removed; the worker keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from nats.js.errors import BadRequestError, KeyNotFoundError

from areal.bus.codec import DecodeError, decode, encode
from areal.bus.connection import connect
from areal.bus.embedded import MAX_PAYLOAD_BYTES
from areal.bus.jetstream import PublishAcks, PullInbox
from areal.bus.streams import BusOptions, declare_run
from areal.bus.weights import WeightsChannel
from schemas import DeadLetter, Event, Message, MetricRecord, WeightAnnouncement
from schemas import subjects as S
from schemas.subjects import RunNames

log = structlog.get_logger()
M = TypeVar("M", bound=Message)


PULL_BATCH_CAP = 256  # most messages one pull request asks for
PULL_MAX_BYTES = 2 * MAX_PAYLOAD_BYTES  # most bytes one pull request delivers (>= a message)


class MessageTooLarge(ValueError):
    pass


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class Lease:
    """A consumed message until it is settled (ack / nak / term)."""

    def __init__(self, bus: Bus, msg: Msg, stage: str, owner: PullInbox | None = None) -> None:
        self.bus, self.msg, self.stage = bus, msg, stage
        self.owner = owner  # the consume loop that holds this lease (room for more when settled)
        self.settled = False
        self.received_at = time.monotonic()

    @property
    def num_delivered(self) -> int:
        return self.msg.metadata.num_delivered

    def _settle(self) -> None:
        self.settled = True
        self.bus._leases.discard(self)
        if self.owner is not None:
            self.owner.release(self)

    async def ack(self) -> None:
        if not self.settled:
            self._settle()
            await self.msg.ack()

    async def nak(self, delay_s: float | None = None) -> None:
        if not self.settled:
            self._settle()
            await self.msg.nak(delay=delay_s)

    async def dead_letter(self, reason: str) -> None:
        if not self.settled:
            await self.bus.dead_letter(self.stage, self.msg, reason)
            await self.ack()


Handler = Callable[[M, Lease], Awaitable[None]]


class Bus:
    def __init__(
        self,
        nc: Client,
        run_id: str,
        role: str,
        worker_id: str,
        opts: BusOptions | None = None,
        url: str | None = None,
    ) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.url = url or nc.connected_url.geturl()
        self.names = RunNames(run_id)
        self.role, self.worker_id = role, worker_id
        self.opts = opts or BusOptions()
        self._leases: set[Lease] = set()
        self._tasks: set[asyncio.Task] = set()
        self._heartbeat_task: asyncio.Task | None = None
        self._acks = PublishAcks(nc)
        self._kv = None
        self._weights: WeightsChannel | None = None  # started on first use
        self._weights_lock = asyncio.Lock()
        self.dlq_count = 0

    @classmethod
    async def connect(
        cls,
        url: str,
        run_id: str,
        role: str,
        worker_id: str,
        opts: BusOptions | None = None,
        declare: bool = True,
    ) -> Bus:
        nc = await connect(url, f"areal-{run_id}-{worker_id}")
        bus = cls(nc, run_id, role, worker_id, opts, url=url)
        await bus._acks.start()
        if declare:
            await bus.declare()
        bus._heartbeat_task = asyncio.create_task(bus._heartbeat_loop())
        return bus

    async def declare(self) -> None:
        try:
            await declare_run(self.js, self.names, self.opts)
        except BadRequestError as e:
            raise RuntimeError(
                f"run {self.names.run_id}: JetStream refused the stream/consumer layout ({e}); "
                "a run id is reused with different settings: choose a new run id"
            ) from e
        self._kv = await self.js.key_value(self.names.state_bucket)

    # ---------------------------------------------------------------- publishing
    async def publish(
        self, stream: str, msg: Message, *rest: str, msg_id: str | None = None
    ) -> None:
        """JetStream publish with de-duplication id; retries on ack timeout with the same id."""
        data = encode(msg)
        await self.publish_raw(self.names.subject(stream, *rest), data, msg_id or msg.msg_id())

    async def publish_raw(self, subject: str, data: bytes, msg_id: str | None = None) -> None:
        if len(data) > self.nc.max_payload:
            raise MessageTooLarge(
                f"message of {len(data)} bytes on {subject} exceeds the server's max_payload "
                f"{self.nc.max_payload}: raise max_payload in the server config (8 MiB is the "
                "default here) or shorten max_new_tokens"
            )
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        delay = 0.2
        for attempt in range(12):
            try:
                await self._acks.publish(subject, data, headers, self.opts.publish_timeout_s)
                return
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
                log.warning(
                    "publish_retry", subject=subject, attempt=attempt, error=type(e).__name__
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise TimeoutError(f"publish to {subject} failed after retries (is JetStream up?)")

    async def metric(self, type_: str, values: dict[str, Any]) -> None:
        rec = MetricRecord(role=self.role, worker_id=self.worker_id, type=type_, values=values)
        await self.publish(S.METRICS, rec, self.role, type_)

    async def event(self, type_: str, **detail: Any) -> None:
        ev = Event(type=type_, role=self.role, worker_id=self.worker_id, detail=detail)
        await self.publish(S.EVENTS, ev, type_)

    async def dead_letter(self, stage: str, msg: Msg, reason: str) -> None:
        dl = DeadLetter(
            stage=stage,
            reason=reason,
            subject=msg.subject,
            payload=msg.data,
            headers=dict(msg.headers or {}),
            worker_id=self.worker_id,
        )
        self.dlq_count += 1
        log.warning("dead_lettered", stage=stage, reason=reason[:300], subject=msg.subject)
        await self.publish(S.DLQ, dl, stage)

    # ---------------------------------------------------------------- consuming
    async def consume(
        self,
        stream: str,
        cls: type[M],
        handler: Handler,
        *,
        max_inflight: int,
        stop: asyncio.Event,
        expires_s: float = 5.0,
        inline: bool = False,
    ) -> None:
        """Pull from the stage's durable consumer and run `handler(message, lease)` for each.

        At most `max_inflight` leases of this consumer are unsettled at once: pull requests stay
        open on the server for only as many messages as there is room for
        (`areal.bus.jetstream`). A handler that raises gets its message nak'ed (redelivered with
        a delay) until `max_deliver`, then dead-lettered with the error. `inline=True` awaits
        each handler in the loop instead of starting a task per message: for handlers that only
        file the message away (the trainer's), it saves a task per message. On return, messages
        delivered but not handled yet are nak'ed so another worker takes them at once.
        """
        pull = PullInbox(
            self.nc,
            self.names.stream(stream),
            S.CONSUMER_OF[stream],
            batch_cap=PULL_BATCH_CAP,
            max_bytes=PULL_MAX_BYTES,
            expires_s=expires_s,
        )
        await pull.start()
        try:
            while not stop.is_set():
                try:
                    await pull.top_up(max_inflight)
                except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
                    await asyncio.sleep(0.5)
                    continue
                await pull.wait(0.5)
                for raw in pull.take():
                    lease = Lease(self, raw, stream, owner=pull)
                    try:
                        obj = decode(raw.data, cls)
                    except DecodeError as e:
                        await lease.dead_letter(str(e))
                        continue
                    self._leases.add(lease)
                    pull.held.add(lease)
                    if inline:
                        await self._run_handler(handler, obj, lease)
                    else:
                        self._spawn(self._run_handler(handler, obj, lease))
        finally:
            for raw in await pull.close():
                with contextlib.suppress(Exception):
                    await raw.nak()

    async def _run_handler(self, handler: Handler, obj: Message, lease: Lease) -> None:
        try:
            await handler(obj, lease)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failing handler must not kill the worker
            reason = f"handler failed: {type(e).__name__}: {e}"
            log.exception("handler_failed", stage=lease.stage, delivered=lease.num_delivered)
            if lease.num_delivered >= self.opts.max_deliver:
                await lease.dead_letter(reason)
            else:
                await lease.nak(delay_s=1.0)

    @property
    def held_leases(self) -> int:
        """Consumed messages of this connection not yet settled (kept alive by heartbeats)."""
        return len(self._leases)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _heartbeat_loop(self) -> None:
        """Keep every unsettled lease alive (`in_progress`) so long work is not redelivered."""
        period = max(0.5, self.opts.ack_wait_s / 3)
        while True:
            await asyncio.sleep(period)
            for lease in list(self._leases):
                if not lease.settled:
                    with contextlib.suppress(Exception):
                        await lease.msg.in_progress()

    # ---------------------------------------------------------------- run state (KV)
    async def kv_get(self, key: str) -> dict | None:
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return None
        return json.loads(entry.value) if entry.value else None

    async def kv_put(self, key: str, value: dict) -> None:
        await self._kv.put(key, json.dumps(value).encode())

    async def kv_watch(self, key: str):
        return await self._kv.watch(key)

    # ---------------------------------------------------------------- weights
    async def put_weights(
        self, version: int, data: bytes, dtype: str, step: int, file_dir: str | None = None
    ) -> WeightAnnouncement:
        """Store weights, then announce them (in that order).

        By default in the run's object store; with `file_dir` (a filesystem every rollout worker
        sees, e.g. for very large models) as `<file_dir>/v<version>.safetensors`, written
        atomically. Only the newest `weights_keep` versions are kept either way.
        """
        name = f"v{version}"
        sha = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        if file_dir is None:
            await (await self._weights_channel()).put(name, data)
            uri = f"nats-obj://{self.names.weights_bucket}/{name}"
        else:
            path = Path(file_dir).resolve() / f"{name}.safetensors"
            await asyncio.to_thread(_write_atomic, path, data)
            uri = f"file://{path}"
        ann = WeightAnnouncement(
            version=version, uri=uri, sha256=sha, bytes=len(data), dtype=dtype, step=step
        )
        await self.publish(S.WEIGHTS, ann)
        old = version - self.opts.weights_keep
        if old >= 0:
            with contextlib.suppress(Exception):
                if file_dir is None:
                    await (await self._weights_channel()).delete(f"v{old}")
                else:
                    (Path(file_dir) / f"v{old}.safetensors").unlink(missing_ok=True)
        return ann

    async def get_weights(self, ann: WeightAnnouncement) -> bytes:
        """Fetch the announced weights and verify their digest."""
        if ann.uri.startswith("file://"):
            path = ann.uri[len("file://") :]
            data = await asyncio.to_thread(Path(path).read_bytes)
        elif ann.uri.startswith("nats-obj://"):
            bucket, name = ann.uri[len("nats-obj://") :].split("/", 1)
            if bucket == self.names.weights_bucket:
                data = await (await self._weights_channel()).get(name)
            else:  # another run's weights (e.g. to start from them): the library's reader
                data = (await (await self.js.object_store(bucket)).get(name)).data
        else:
            raise ValueError(f"unsupported weights uri {ann.uri!r}")
        sha = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        if sha != ann.sha256 or len(data) != ann.nbytes:
            raise ValueError(
                f"weights v{ann.version} failed verification: sha256 {sha[:12]} != "
                f"{ann.sha256[:12]} or {len(data)} != {ann.nbytes} bytes"
            )
        return data

    async def _weights_channel(self) -> WeightsChannel:
        """The run's object-store weights on their own connection and thread (`weights.py`)."""
        async with self._weights_lock:
            if self._weights is None:
                channel = WeightsChannel(
                    self.url,
                    f"areal-{self.names.run_id}-{self.worker_id}-weights",
                    self.names.weights_bucket,
                )
                await channel.start()
                self._weights = channel
        return self._weights

    async def subscribe_weights(self, cb: Callable[[WeightAnnouncement], Awaitable[None]]) -> Any:
        """Deliver the latest announcement now and every later one (ordered consumer)."""

        async def on_msg(msg: Msg) -> None:
            try:
                ann = decode(msg.data, WeightAnnouncement)
            except DecodeError as e:
                log.warning("bad_weight_announcement", reason=str(e))
                return
            await cb(ann)

        return await self.js.subscribe(
            self.names.subject(S.WEIGHTS),
            cb=on_msg,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST,
        )

    async def latest_weights(self) -> WeightAnnouncement | None:
        try:
            msg = await self.js.get_last_msg(
                self.names.stream(S.WEIGHTS), self.names.subject(S.WEIGHTS)
            )
        except Exception:
            return None
        return decode(msg.data, WeightAnnouncement)

    # ---------------------------------------------------------------- lifecycle
    async def close(self, nak_unsettled: bool = True) -> None:
        """Stop heartbeats; hand unsettled work back at once (nak) so others pick it up."""
        for task in list(self._tasks):
            task.cancel()
        if self._heartbeat_task:
            self._heartbeat_task.cancel()
        if nak_unsettled:
            for lease in list(self._leases):
                with contextlib.suppress(Exception):
                    await lease.nak()
        if self._weights is not None:
            with contextlib.suppress(Exception):
                await self._weights.close()
        with contextlib.suppress(Exception):
            await self.nc.drain()
