"""The Bus: the one object services use to talk to NATS JetStream for one run.

Invariants:
- every JetStream publish carries `Nats-Msg-Id` = the message's deterministic id (keyed with the
  run's `ids_secret` when the bus holds the run's keys: `keyed_id`), and is retried with the
  same id when the ack times out (the server de-duplicates);
- a publish or run-state read/write rides through a server outage (restart, reconnect, leader
  election): it is retried with backoff for up to `nats.outage_tolerance_s`, then raises
  `BusUnavailable` with the reason (never a bare timeout mistaken for something else);
- a consumed message is held by a `Lease` that heartbeats `in_progress` until the handler settles
  it (ack only once its effect is durable: published downstream or folded into a checkpoint);
- a message that cannot be decoded, whose handler keeps failing up to `max_deliver`, or that
  is delivered more than `max_deliver` times (the workers holding it stopped or died), goes to
  `areal.<run>.dlq.<stage>` with the reason and is then removed, through the stage's `refuse`
  (which tells the trainer, so the task is retired, not lost); the worker keeps running. The
  server never stops delivering a message by itself (its consumers have no `max_deliver`): one
  it gave up on would sit in the work queue unseen, its task never ending;
- the bus is sealed: its nats connection and JetStream context are private; callers get typed
  methods (publish/consume, run state, weights, events, stream depth) and never a nats object;
- a failure is raised, never turned into a normal answer (`latest_weights` is None only when
  nothing trusted was announced; `kv_get` is None only when the key has no value);
- with the run's keys, weights are signed by the trainer and trusted only when the signature
  verifies, checked before any byte is fetched (`areal.bus.run_weights`);
- the bus connects with its role's credentials (`areal.bus.auth`); what the server refuses the
  account (`areal.bus.nats_config`) raises `PermissionDenied` naming the subject, at once for
  a publish and at the request's timeout for a run-state write or a declaration: never
  retried as an outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import BadRequestError, ServiceUnavailableError
from pydantic import BaseModel

from areal.bus.auth import NO_CREDENTIALS, Credentials, Denials, credentials_for
from areal.bus.blobs import WeightsBlob, WeightsSink
from areal.bus.codec import DecodeError, decode, encode
from areal.bus.connection import Patience, Reconnects, connect
from areal.bus.embedded import MAX_PAYLOAD_BYTES
from areal.bus.errors import BusUnavailable, MessageTooLarge
from areal.bus.events import (
    BusSubscription,
    EventSubscription,
    OnMetric,
    subscribe_decoded,
    subscribe_events,
)
from areal.bus.follow import StreamFollower
from areal.bus.jetstream import PublishAcks, PullInbox
from areal.bus.kv import KVWatch, RunStateKV
from areal.bus.lease import Lease
from areal.bus.run_weights import RunWeights
from areal.bus.streams import declare_run, run_declared
from areal.config import NatsSettings
from areal.security.keys import RunKeys
from schemas import DeadLetter, Event, Message, MetricRecord, WeightAnnouncement
from schemas import subjects as S
from schemas.messages import SIGNED_EVENTS
from schemas.subjects import RunNames

log = structlog.get_logger()
M = TypeVar("M", bound=Message)
T_ = TypeVar("T_")
Sk = TypeVar("Sk", bound=WeightsSink)
# Errors of a server that is restarting, unreachable or electing a leader: retried. (A closed
# connection is not among them: workers reconnect forever, so it was closed on purpose.) Seen
# in a 3-node cluster after a SIGKILL of a stream's leader, for ~5 s until the election ends
# (tests/e2e/test_cluster.py): our publish gets no responders, nats-py's `js.publish` (KV
# puts, object-store chunks) `NoStreamResponseError`, other JetStream API calls and
# object-store puts/gets time out. And nats-py raises `ServiceUnavailableError` (JetStream's 503)
# for a JetStream API request that finds no responders (stream info, message get: the KV reads,
# the latest weights): once seen ending a controller in that test's CI run.
TRANSIENT_ERRORS = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    asyncio.TimeoutError,
)
T = TypeVar("T", bound=BaseModel)

__all__ = ["Bus", "BusSubscription", "EventSubscription", "KVWatch", "Lease", "MessageTooLarge"]


RETRY_MAX_DELAY_S = 1.0  # most seconds between two tries of an op riding through an outage
SHORT_WAIT_PART = 5  # a request's first tries wait publish_timeout_s / 5 for an answer...
SHORT_WAITS = 5  # ...this many of them (about one full wait in all), then the whole timeout


def ack_waits(timeout_s: float) -> Iterator[float]:
    """How long each try of one publish (or run-state request) waits for its answer:
    `timeout_s / SHORT_WAIT_PART` for the first `SHORT_WAITS` tries, then `timeout_s`
    (2, 2, 2, 2, 2, 10, 10, ... s with the default 10 s).

    A request that reaches a stream while its cluster elects a new leader (the old one died) is
    dropped without an answer, however long it waits, and an election lasts 4-15 s: a run's
    step record and the trainer's state write each waited the whole 10 s (nats-py's 5 s for a
    KV read) and were sent again only then, seconds after the stream could take them; longer
    waits after each timeout held them just as long (a third try waited 8 s of a 13 s stall).
    Short waits retry within 2 s of the election's end. A server that is only slow gets the
    whole timeout after the short tries. Every try carries the same `Nats-Msg-Id`, so one whose
    answer was only late is stored once."""
    for _ in range(SHORT_WAITS):
        yield timeout_s / SHORT_WAIT_PART
    while True:
        yield timeout_s


JS_NO_PEERS = 10005  # JetStream's "no suitable peers for placement": fewer servers than replicas
DLQ_PAYLOAD_MAX = 64 * 1024  # bytes of a dead message kept in its dead letter
DLQ_REASON_MAX = 4096  # characters of the reason kept
PULL_BATCH_CAP = 256  # most messages one pull request asks for
PULL_MAX_BYTES = 2 * MAX_PAYLOAD_BYTES  # most bytes one pull request delivers (>= a message)


@dataclass(frozen=True)
class ConnectionStats:
    """Bytes and messages through the bus's own connection (weights move on another one)."""

    in_bytes: int
    out_bytes: int
    in_msgs: int
    out_msgs: int
    reconnects: int


Handler = Callable[[M, Lease], Awaitable[None]]
# dead-letters a message of the stage with the reason, and tells the trainer when it names a task
Refuse = Callable[[M, Lease, str], Awaitable[None]]


class Bus:
    """One worker's connection to one run (sealed: see the module invariants)."""

    def __init__(
        self,
        nc: Client,
        run_id: str,
        role: str,
        worker_id: str,
        nats: NatsSettings | None = None,
        url: str | None = None,
        *,
        keys: RunKeys | None = None,
        sign_weights: bool = True,
        weights_dir: str | None = None,
        credentials: Credentials = NO_CREDENTIALS,
        denials: Denials | None = None,
        reconnects: Reconnects | None = None,
    ) -> None:
        self._nc, self._js = nc, nc.jetstream()
        self._denials = denials or Denials()  # what the server refused this connection
        self.keys = keys  # the run's keys (`areal.security.keys`): ids_secret, weights keys
        self._sign = sign_weights  # sign and verify weights and `SIGNED_EVENTS` with them
        self.url = url or nc.connected_url.geturl()
        self.names = RunNames(run_id)
        self.role, self.worker_id = role, worker_id
        self.settings = nats or NatsSettings()
        self._leases: set[Lease] = set()
        self._tasks: set[asyncio.Task] = set()
        self._heartbeat_task: asyncio.Task | None = None
        self._acks = PublishAcks(nc)
        self._denials.listen(
            lambda op, subject: self._acks.deny(subject, lambda s: self._denials.error(s, op))
        )
        self._followers: set[StreamFollower] = set()  # told to read again after a reconnect
        # resolved at the next reconnect: what `_through_outage` ops in flight give up on
        self._next_reconnect: asyncio.Future[None] | None = None
        if reconnects is not None:
            reconnects.listen(self._on_reconnect)
        self._states: dict[float, RunStateKV] = {}  # the run-state bucket per answer wait
        self._weights = RunWeights(
            self._js,
            self.names,
            nc=self._nc,
            url=self.url,
            client_name=f"areal-{self.names.run_id}-{worker_id}-weights",
            weights_keep=self.settings.weights_keep,
            announce=lambda ann: self.publish(S.WEIGHTS, ann),
            keys=keys if sign_weights else None,
            file_root=weights_dir,
            credentials=credentials,
        )

    @classmethod
    async def connect(
        cls,
        url: str,
        run_id: str,
        role: str,
        worker_id: str,
        nats: NatsSettings | None = None,
        declare: bool = True,
        *,
        keys: RunKeys | None = None,
        sign_weights: bool = True,
        weights_dir: str | None = None,
        credentials: Credentials | None = None,
        first_connect_s: float | None = None,
    ) -> Bus:
        """Connect and (with `declare`) declare the run's streams; raises `RunConflictError`
        when a stream with the run's name belongs to something else (nothing is modified).
        The first connection waits up to `first_connect_s` (None, as workers: forever), then
        raises `ConnectionError` naming the URL; once connected, the bus reconnects forever.

        Credentials: `credentials`, else those `nats` names for `role` (`credentials_for`:
        `nats.credentials_file`, or `<nats.credentials_dir>/<role>.json`); a server that
        refuses them raises `AuthenticationFailed`. On a server with per-role accounts only the
        launcher may `declare` (`nats_config.DECLARERS`); the workers connect with
        `declare=False` and `wait_declared`.

        Weights: with `keys` (and `sign_weights`) the bus signs what it announces (with the
        trainer's signing key) and trusts only announcements that verify; without keys, or
        with `sign_weights=False`, nothing is signed or verified. `file://` weights are read
        only from under `weights_dir` (None: none)."""
        names = RunNames(run_id)  # an invalid run id fails before connecting
        if credentials is None:
            credentials = credentials_for(nats or NatsSettings(), role)
        denials, reconnects = Denials(), Reconnects()
        nc = await connect(
            url,
            f"areal-{names.run_id}-{worker_id}",
            patience=Patience(first_connect_s=first_connect_s),
            credentials=credentials,
            denials=denials,
            reconnects=reconnects,
        )
        bus = cls(
            nc,
            run_id,
            role,
            worker_id,
            nats,
            url=url,
            keys=keys,
            sign_weights=sign_weights,
            weights_dir=weights_dir,
            credentials=credentials,
            denials=denials,
            reconnects=reconnects,
        )
        try:
            await bus._acks.start()
            if declare:
                await bus.declare()
        except BaseException:
            await nc.close()
            raise
        bus._heartbeat_task = asyncio.create_task(bus._heartbeat_loop())
        return bus

    async def declare(self) -> None:
        """Create or update the run's streams, consumers and buckets (`declare_run`, which is
        idempotent). An outage (no answer, a leader election) is waited out for up to
        `nats.outage_tolerance_s`, and so is a cluster with fewer JetStream servers up than
        `nats.replicas` (still forming, or a node down: no peers to place the copies on)."""
        loop = asyncio.get_running_loop()
        deadline, attempt = loop.time() + self.settings.outage_tolerance_s, 0
        while True:
            try:
                await declare_run(self._js, self.names, self.settings)
                return
            except TRANSIENT_ERRORS as e:  # no answer, or a 503: an election
                if self._denials.any():  # a refused call gets no answer: say which, not "timeout"
                    raise self._denials.error(self._denials.last()) from None
                why = f"the NATS server did not answer ({type(e).__name__}): is it up?"
            except BadRequestError as e:
                if e.err_code != JS_NO_PEERS:
                    raise RuntimeError(
                        f"run {self.names.run_id}: JetStream refused the stream/consumer layout "
                        f"({e}); a run id is reused with different settings: choose a new run id"
                    ) from e
                why = (
                    f"JetStream found no servers to place nats.replicas={self.settings.replicas} "
                    "copies on: are that many servers of the cluster up and routed? (or lower "
                    "nats.replicas)"
                )
            if loop.time() + RETRY_MAX_DELAY_S > deadline:
                raise BusUnavailable(
                    f"run {self.names.run_id}: declaring its streams for "
                    f"{self.settings.outage_tolerance_s:.0f} s: {why}"
                ) from None
            attempt += 1
            if attempt == 1 or attempt % 10 == 0:
                log.warning("declare_waiting", reason=why, attempt=attempt)
            await asyncio.sleep(RETRY_MAX_DELAY_S)

    async def wait_declared(self, stop: asyncio.Event, report_s: float = 30.0) -> bool:
        """Wait until the run's streams and buckets exist (declared by its launcher, or on a
        server without accounts by its controller or trainer: `declare`); True once they do, False when `stop` was set first. Logs
        `waiting_for_run` at once and every `report_s` seconds, so a wait is never silent."""
        loop = asyncio.get_running_loop()
        t0, next_report = loop.time(), loop.time()
        while not stop.is_set():
            if await self._through_outage(
                lambda: run_declared(self._js, self.names),
                "looking up the run's streams",
                f"$JS.API.STREAM.INFO.OBJ_{self.names.weights_bucket}",
            ):
                return True
            if loop.time() >= next_report:
                next_report = loop.time() + report_s
                log.info(
                    "waiting_for_run",
                    reason="its streams do not exist yet: the run's launcher declares them "
                    "(`areal run`, or `areal declare` where no launcher runs)",
                    run_id=self.names.run_id,
                    waited_s=round(loop.time() - t0),
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        return False

    @property
    def max_payload(self) -> int:
        """Largest message the server accepts (bytes)."""
        return self._nc.max_payload

    def connection_stats(self) -> ConnectionStats:
        st = self._nc.stats
        return ConnectionStats(
            st["in_bytes"], st["out_bytes"], st["in_msgs"], st["out_msgs"], st["reconnects"]
        )

    @property
    def reconnects(self) -> int:
        """Times this connection was re-established since it was opened."""
        return self._nc.stats["reconnects"]

    async def stream_depth(self, stream: str) -> int:
        """Messages currently stored in the run's stream `stream` (e.g. `S.DLQ`); rides through a
        server outage (`_through_outage`)."""
        name = self.names.stream(stream)
        info = await self._through_outage(lambda: self._js.stream_info(name), f"reading {name}")
        return info.state.messages

    async def subscribe_events(
        self, kind: str, cb: Callable[[Event], Awaitable[None]]
    ) -> EventSubscription:
        """Live events `areal.<run>.events.<kind>` (core subscription; malformed ones skipped)."""
        return await subscribe_events(self._nc, self.names.events_subject(kind), cb)

    async def subscribe_metrics(
        self, role: str, type_: str, cb: OnMetric, *, replay: bool = False
    ) -> BusSubscription | StreamFollower:
        """Live metrics `areal.<run>.metrics.<role>.<type>` (e.g. the trainer's `step` records);
        `replay`: first every such record the metrics stream still holds, then each new one,
        once and in order (a `StreamFollower`: direct gets, no consumer)."""
        subject = f"{self.names.metrics_subject(role)}.{type_}"
        stream = self.names.stream(S.METRICS) if replay else None
        sub = await subscribe_decoded(self._nc, subject, MetricRecord, cb, stream)
        if isinstance(sub, StreamFollower):
            self._followers.add(sub)
        return sub

    # ---------------------------------------------------------------- publishing
    async def publish(
        self, stream: str, msg: Message, *rest: str, msg_id: str | None = None
    ) -> None:
        """JetStream publish with de-duplication id; retries on ack timeout with the same id."""
        data = encode(msg)
        await self.publish_raw(
            self.names.subject(stream, *rest), data, self.keyed_id(msg_id or msg.msg_id())
        )

    def keyed_id(self, msg_id: str) -> str:
        """`msg_id` made unguessable with the run's `ids_secret` (when this bus holds keys):
        deterministic for the run, so a republish is still de-duplicated, but no one without
        the secret can publish first under the id of a real message to come and have the
        server drop the real one as a duplicate. The natural id stays readable in front."""
        if self.keys is None:
            return msg_id
        tag = hmac.new(self.keys.ids_secret, msg_id.encode(), hashlib.sha256).hexdigest()[:16]
        return f"{msg_id}#{tag}"

    async def publish_raw(self, subject: str, data: bytes, msg_id: str | None = None) -> None:
        if len(data) > self._nc.max_payload:
            raise MessageTooLarge(
                f"message of {len(data)} bytes on {subject} exceeds the server's max_payload "
                f"{self._nc.max_payload}: raise max_payload in the server config (8 MiB is the "
                "default here) or shorten max_new_tokens"
            )
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        waits = ack_waits(self.settings.publish_timeout_s)
        # the same Nats-Msg-Id on every try: a publish stored before its ack was lost is
        # de-duplicated by the server
        # no reconnect race here: `PublishAcks` fails its own waits at a reconnect, and this
        # is the hot path (one publish per sample)
        await self._through_outage(
            lambda: self._acks.publish(subject, data, headers, next(waits)),
            f"publish to {subject}",
            retry_at_reconnect=False,
        )

    async def _through_outage(
        self,
        op: Callable[[], Awaitable[T_]],
        what: str,
        subject: str | None = None,
        *,
        retry_at_reconnect: bool = True,
    ) -> T_:
        """`op()`, retried with backoff while the server is unreachable (a restart, a
        reconnect, a leader election), for up to `nats.outage_tolerance_s`; then a
        `BusUnavailable` naming `what`. `op` must be safe to repeat. A timeout after the
        server refused this account `subject` (what `op` publishes to) is no outage: it
        raises `PermissionDenied` at once. With `retry_at_reconnect` an `op` still waiting when
        the connection reconnects is given up and tried again at once (`_unless_reconnected`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.outage_tolerance_s
        delay, attempt = 0.2, 0
        while True:
            try:
                result = await (self._unless_reconnected(op) if retry_at_reconnect else op())
            except TRANSIENT_ERRORS as e:
                if subject is not None and self._denials.denied(subject):
                    raise self._denials.error(subject) from None
                attempt += 1
                if loop.time() + delay > deadline:
                    raise BusUnavailable(
                        f"{what}: the NATS server did not answer for "
                        f"{self.settings.outage_tolerance_s:.0f} s ({type(e).__name__}); is it "
                        "up? (nats.outage_tolerance_s sets how long workers wait)"
                    ) from None
                if attempt == 1 or attempt % 10 == 0:
                    log.warning("bus_retry", what=what, attempt=attempt, error=type(e).__name__)
                await asyncio.sleep(delay)
                # at most 1 s between tries: an election (~5 s in a cluster) or a restart
                # ends, and the op goes through within a second of it
                delay = min(delay * 2, RETRY_MAX_DELAY_S)
                continue
            if attempt:
                log.info("bus_recovered", what=what, attempts=attempt)
            return result

    async def _unless_reconnected(self, op: Callable[[], Awaitable[T_]]) -> T_:
        """`op()`, given up (a TimeoutError, so `_through_outage` tries it again) when the
        connection reconnects while it waits: a request that went to a server that died is
        never answered, and nats-py would hold it for its whole timeout (5 s for a KV write)."""
        if self._next_reconnect is None or self._next_reconnect.done():
            self._next_reconnect = asyncio.get_running_loop().create_future()
        reconnected = self._next_reconnect
        task = asyncio.ensure_future(op())
        try:
            await asyncio.wait({task, reconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise asyncio.TimeoutError("the connection reconnected while waiting for an answer")

    async def metric(self, type_: str, values: dict[str, Any]) -> None:
        rec = MetricRecord(role=self.role, worker_id=self.worker_id, type=type_, values=values)
        await self.publish(S.METRICS, rec, self.role, type_)

    async def event(self, type_: str, **detail: Any) -> None:
        """Publish a run event; one that stops workers (`SIGNED_EVENTS`) is signed with the
        run's key when this bus holds the signing key (the trainer's)."""
        ev = Event(type=type_, role=self.role, worker_id=self.worker_id, detail=detail)
        if type_ in SIGNED_EVENTS and self._sign and self.keys and self.keys.signing_key:
            ev.signature = self.keys.sign(ev.signed_bytes(self.names.run_id))
        await self.publish(S.EVENTS, ev, type_)

    def event_rejection(self, ev: Event) -> str | None:
        """Why `ev` (a kind in `SIGNED_EVENTS`) is not to be acted on: unsigned, or not signed
        by this run's trainer key; None to trust it. A bus without the run's keys, or with
        signing off (`security.sign_weights=false`), trusts every one (nothing to check with)."""
        if ev.type not in SIGNED_EVENTS or not self._sign or self.keys is None:
            return None
        if not ev.signature:
            return f"{ev.type} from {ev.worker_id or '?'} is not signed with the run's key"
        if not self.keys.verify(ev.signed_bytes(self.names.run_id), ev.signature):
            return f"{ev.type} from {ev.worker_id or '?'} has a signature the run's key refuses"
        return None

    async def dead_letter(self, stage: str, msg: Msg, reason: str) -> None:
        """Publish `msg` to `dlq.<stage>` with `reason`, bounded in size: the reason, subject
        and headers are cut to a few KiB and the payload to `DLQ_PAYLOAD_MAX` (or a quarter of
        the server's max_payload), with its full length kept, so a dead letter always fits
        where its message did."""
        cap = min(DLQ_PAYLOAD_MAX, self._nc.max_payload // 4)
        data = msg.data or b""
        headers = {k[:128]: str(v)[:512] for k, v in list((msg.headers or {}).items())[:16]}
        dl = DeadLetter(
            stage=stage,
            reason=reason[:DLQ_REASON_MAX],
            subject=msg.subject[:512],
            payload=data[:cap],
            payload_bytes=len(data),
            headers=headers,
            worker_id=self.worker_id,
        )
        log.warning("dead_lettered", stage=stage, reason=reason[:300], subject=msg.subject[:200])
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
        refuse: Refuse[M] | None = None,
    ) -> None:
        """Pull from the stage's durable consumer and run `handler(message, lease)` for each.

        At most `max_inflight` leases of this consumer are unsettled at once: pull requests stay
        open on the server for only as many messages as there is room for
        (`areal.bus.jetstream`). A handler that raises gets its message nak'ed (redelivered with
        a delay) until `max_deliver`, then given up on with the error; so is a message delivered
        more than `max_deliver` times, whatever handed it back (failures, workers that stopped
        or died holding it), before its handler runs. Giving up is `refuse(message, lease,
        reason)`: the stage dead-letters it and, when it names a task of the run, tells the
        trainer (a rejection marker), so the task is retired rather than lost; without `refuse`
        it is dead-lettered only. `inline=True` awaits each handler in the loop instead of
        starting a task per message: for handlers that only file the message away (the
        trainer's), it saves a task per message. On return, messages delivered but not handled
        yet are nak'ed so another worker takes them at once.
        """
        pull = PullInbox(
            self._nc,
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
                    if lease.num_delivered > self.settings.max_deliver:
                        reason = (
                            f"delivered {lease.num_delivered} times without being settled "
                            f"(nats.max_deliver={self.settings.max_deliver}): its handlers "
                            "failed, or the workers holding it stopped or died"
                        )
                        work = self._give_up(obj, lease, reason, refuse)
                    else:
                        work = self._run_handler(handler, obj, lease, refuse)
                    if inline:
                        await work
                    else:
                        self._spawn(work)
        finally:
            for raw in await pull.close():
                # best effort: if the connection is gone, the server redelivers after ack_wait
                with contextlib.suppress(nats.errors.Error):
                    await raw.nak()

    async def _run_handler(
        self, handler: Handler, obj: Message, lease: Lease, refuse: Refuse | None
    ) -> None:
        try:
            await handler(obj, lease)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failing handler must not kill the worker: nak, then give up
            reason = f"handler failed: {type(e).__name__}: {e}"
            log.exception("handler_failed", stage=lease.stage, delivered=lease.num_delivered)
            if lease.num_delivered >= self.settings.max_deliver:
                await self._give_up(obj, lease, reason, refuse)
            else:
                await self._hand_back(lease)

    async def _give_up(
        self, obj: Message, lease: Lease, reason: str, refuse: Refuse | None
    ) -> None:
        """Dead-letter a message that used up its deliveries (through the stage's `refuse`). If
        that fails too (e.g. the server is away past `outage_tolerance_s`), the message is
        handed back, to be given up on at its next delivery."""
        try:
            if refuse is not None:
                await refuse(obj, lease, reason)
            else:
                await lease.dead_letter(reason)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the worker goes on; the message comes back
            log.exception("give_up_failed", stage=lease.stage, delivered=lease.num_delivered)
            await self._hand_back(lease)

    @staticmethod
    async def _hand_back(lease: Lease) -> None:
        # best effort: a nak that does not reach the server is a redelivery after ack_wait
        with contextlib.suppress(nats.errors.Error):
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
        period = max(0.5, self.settings.ack_wait_s / 3)
        while True:
            await asyncio.sleep(period)
            for lease in list(self._leases):
                if not lease.settled:
                    # best effort: a missed beat (reconnecting, settled meanwhile) is retried a
                    # period later, well within ack_wait; the loop must outlive any one failure
                    with contextlib.suppress(Exception):
                        await lease.msg.in_progress()

    # ---------------------------------------------------------------- run state (KV)
    async def _run_state(self, wait_s: float) -> RunStateKV:
        """The run-state bucket, its requests waiting `wait_s` for an answer (one handle per
        wait, bound on first use)."""
        state = self._states.get(wait_s)
        if state is None:
            bucket = self.names.state_bucket
            kv = await self._nc.jetstream(timeout=wait_s).key_value(bucket)
            state = self._states[wait_s] = RunStateKV(kv, bucket, self._nc)
        return state

    async def _kv_op(
        self, op: Callable[[RunStateKV], Awaitable[T_]], what: str, key: str | None = None
    ) -> T_:
        """`op` on the run-state bucket, riding through an outage (`_through_outage`; `key`:
        the key it writes, for a permission denial). Each try waits for its answer as a publish
        waits for its ack (`ack_waits`): a request that reaches the bucket while its cluster
        elects a leader is never answered, and nats-py's fixed 5 s timeout held the trainer's
        state write and read 5 s each, twice in a row, after a node died."""
        waits = ack_waits(self.settings.publish_timeout_s)
        subject = None if key is None else f"$KV.{self.names.state_bucket}.{key}"

        async def attempt() -> T_:
            return await op(await self._run_state(next(waits)))

        return await self._through_outage(attempt, what, subject)

    async def kv_get(self, key: str, model: type[T]) -> T | None:
        """The run state under `key` as `model`; None only when the key has no value. A value
        that does not validate raises `StateDecodeError` naming the key and the bucket.
        Rides through a server outage (`_kv_op`)."""
        return await self._kv_op(lambda s: s.get(key, model), f"reading {key!r}")

    async def kv_put(self, key: str, value: BaseModel) -> None:
        await self._kv_op(lambda s: s.put(key, value), f"writing {key!r}", key)

    async def kv_claim(self, key: str, value: BaseModel) -> bool:
        """Create `key` with `value` if it does not exist yet: True for exactly one caller
        (e.g. the one rollout replica that runs an evaluation round). A create whose answer
        was lost in an outage is retried, and then reads as taken: the claim may go to no one,
        never to two."""
        return await self._kv_op(lambda s: s.create(key, value), f"claiming {key!r}", key)

    async def kv_get_rev(self, key: str, model: type[T]) -> tuple[T, int] | None:
        """`kv_get` with the value's revision (for `kv_update` / `kv_delete`)."""
        return await self._kv_op(lambda s: s.get_rev(key, model), f"reading {key!r}")

    async def kv_create_rev(self, key: str, value: BaseModel) -> int | None:
        """Create `key`: its revision, None when it has a value. A create whose answer was
        lost in an outage is retried and then reads as taken (the caller re-reads to tell)."""
        return await self._kv_op(lambda s: s.create_rev(key, value), f"creating {key!r}", key)

    async def kv_update(self, key: str, value: BaseModel, last: int) -> int | None:
        """Compare-and-set: write `key` only if its revision is still `last`; the new
        revision, or None when it moved (an update whose answer was lost reads as moved)."""
        return await self._kv_op(lambda s: s.update(key, value, last), f"updating {key!r}", key)

    async def kv_delete(self, key: str, last: int) -> bool:
        """Delete `key` only if its revision is still `last`."""
        return await self._kv_op(lambda s: s.delete(key, last), f"deleting {key!r}", key)

    async def kv_watch(self, key: str) -> KVWatch:
        """Changes of `key` from now on (`KVWatch.wait`); create it before reading the key.
        Rides through a server outage (`_kv_op`), and outlives its consumer on the server
        (reopened after a reconnect: `KVWatch`)."""
        return await self._kv_op(lambda s: s.watch(key), f"watching {key!r}")

    # ---------------------------------------------------------------- weights (`run_weights`)
    async def put_weights(
        self,
        version: int,
        data: bytes | WeightsBlob,
        dtype: str,
        step: int,
        file_dir: str | None = None,
    ) -> WeightAnnouncement:
        """Store weights, then announce them (`RunWeights.put`; a `WeightsBlob` is streamed,
        never whole in memory); rides through a server outage (a stored object is overwritten
        by the retry, which streams the blob again; the announcement is de-duplicated)."""
        # no reconnect race: the bytes move on the weights' own connection, which a reconnect
        # of this one does not touch (a stuck upload meets its deadline), and the announcement
        # is a publish, whose ack waits already fail at a reconnect; giving up the upload
        # would only stream the whole blob again
        return await self._through_outage(
            lambda: self._weights.put(version, data, dtype, step, file_dir),
            f"storing weights v{version}",
            retry_at_reconnect=False,
        )

    def weights_rejection(self, ann: WeightAnnouncement) -> str | None:
        """Why `ann` is not to be trusted (unsigned, bad signature; logged), None to trust it."""
        return self._weights.rejection(ann)

    async def get_weights(self, ann: WeightAnnouncement) -> bytes:
        """Fetch the announced weights (`RunWeights.get`): signature checked before any byte
        is read, at most the announced size read, digest verified; `WeightsRejected` if not.
        Rides through a server outage (`_through_outage`: a read, safe to repeat)."""
        return await self._through_outage(
            lambda: self._weights.get(ann), f"fetching weights v{ann.version}"
        )

    async def fetch_weights(self, ann: WeightAnnouncement, open_sink: Callable[[int], Sk]) -> Sk:
        """Stream the announced weights into a fresh `open_sink(ann.nbytes)` and return it
        (`RunWeights.fetch`: e.g. a decoder that writes straight into tensors, so the blob is
        never whole in memory). Trust as for `get_weights`; a retry through a server outage
        opens a new sink (the partial one is dropped)."""
        return await self._through_outage(
            lambda: self._weights.fetch(ann, open_sink), f"fetching weights v{ann.version}"
        )

    async def subscribe_weights(
        self, cb: Callable[[WeightAnnouncement], Awaitable[None]]
    ) -> StreamFollower:
        """Deliver the latest trusted announcement now and every later trusted one, each once
        and in order (`RunWeights.subscribe`); untrusted ones are logged (`weights_rejected`)
        and never delivered. A reconnect delays an announcement, never loses it."""
        sub = await self._through_outage(
            lambda: self._weights.subscribe(cb), "subscribing to weight announcements"
        )
        self._followers.add(sub)
        return sub

    def _on_reconnect(self) -> None:
        """The connection is back (maybe on another server): publishes waiting for an ack and
        requests waiting for an answer (`_through_outage`) are retried at once, and followers
        read again now (what was stored meanwhile rang no doorbell here)."""
        self._acks.reconnected()
        if self._next_reconnect is not None and not self._next_reconnect.done():
            self._next_reconnect.set_result(None)
        for sub in list(self._followers):
            if sub.closed:
                self._followers.discard(sub)
            else:
                sub.renew_soon()

    async def latest_weights(self) -> WeightAnnouncement | None:
        """The trusted announcement of the highest version the weights stream holds; None ONLY
        when it holds none (nothing announced yet, or nothing the trainer signed). Any other
        failure raises: a restoring trainer must not take it for "no weights". Rides through a
        server outage (`_through_outage`)."""
        return await self._through_outage(self._weights.latest, "reading the latest weights")

    # ---------------------------------------------------------------- lifecycle
    async def close(self, nak_unsettled: bool = True) -> None:
        """Stop heartbeats; hand unsettled work back at once (nak) so others pick it up."""
        for task in list(self._tasks):
            task.cancel()
        if self._heartbeat_task:
            self._heartbeat_task.cancel()
        # Closing is best effort throughout: a lease not nak'ed is redelivered after ack_wait,
        # and a connection that cannot drain (already closed, server gone) is closed anyway.
        if nak_unsettled:
            for lease in list(self._leases):
                with contextlib.suppress(Exception):
                    await lease.nak()
        with contextlib.suppress(Exception):
            await self._weights.close()
        with contextlib.suppress(Exception):
            await self._nc.drain()
