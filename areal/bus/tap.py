"""Read-only bus access for observers (`areal tap`, `areal top`, the metrics exporter).

Invariants (DESIGN section 3, "Tapping"):
- nothing here consumes, acknowledges or delays a pipeline message: work-queue streams are
  watched with a plain core subscription on the subject (JetStream refuses a second consumer on
  a work queue) or peeked by sequence (`STREAM.MSG.GET` does not remove anything);
- history on limits streams is read by sequence with direct gets (`areal.bus.follow`), woken by
  a core subscription and read again at once when the connection comes back (a restarted
  server, a failover), so a follow neither stalls, misses nor repeats a record;
- an observer never declares streams or buckets: attaching to a run that does not exist is an
  error that names the fix, not a new empty run;
- an observer never waits in silence: it connects with `OBSERVER_PATIENCE` (a dead address is a
  `ConnectionError` within `first_connect_s`, refused credentials an `AuthenticationFailed`
  naming the monitor credentials to pass), and `TapClient.lost` is set, with the reason, once
  its server has been gone for `reconnect_s`;
- all it needs is the read-only monitor account of `areal.bus.nats_config` (it never publishes
  to a run subject, never acks, never creates anything on the server).
The monitor package sees only `TapMessage` / `QueueStats`, never a `nats` object.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import KeyDeletedError, KeyNotFoundError, NotFoundError

from areal.bus.auth import NO_CREDENTIALS, Credentials
from areal.bus.connection import Patience, Reconnects, connect
from areal.bus.follow import StoredMsg, StreamFollower, follow_stream, last_seq
from schemas import subjects as S
from schemas.subjects import RunNames, run_of_stream

# Observers may buffer a burst of big samples; a slow tap drops its own messages, never the
# pipeline's (core NATS drops for the slow subscriber only).
_PENDING_BYTES = 512 * 1024 * 1024

# Observers give up on a server that does not answer (first connection) or stays away (after a
# disconnect) within these bounds, with an error naming the URL, instead of retrying forever.
OBSERVER_PATIENCE = Patience(first_connect_s=5.0, reconnect_s=10.0)
OBSERVER_HINT = (
    "check --nats-url / AREAL_NATS__URL: is the run still running? A run's embedded server "
    "lives only as long as the run, on a new port each time (its `nats.url` in the run dir's "
    "config.json); use a server you started yourself to look at a run after it ends"
)
OBSERVER_AUTH_HINT = (
    "pass the monitor's credentials: --credentials FILE (or AREAL_NATS__CREDENTIALS_FILE): for a "
    "run started by `areal run`, its run dir or <out>/keys/nats/monitor.json; for a server of "
    "your own, the monitor.json `areal nats-config` wrote"
)
Note = Callable[[str], None]


@dataclass(frozen=True)
class TapMessage:
    subject: str
    data: bytes
    msg_id: str | None
    received_at: float  # time.time() when the observer got it
    stream_seq: int | None = None  # None for core (live) deliveries
    stored_at: float | None = None  # server timestamp, for replayed / peeked messages
    replayed: bool = False


@dataclass(frozen=True)
class QueueStats:
    stream: str
    messages: int
    bytes: int
    ack_pending: int | None = None  # consumer: delivered, not yet acknowledged
    pending: int | None = None  # consumer: not yet delivered
    redelivered: int | None = None
    subjects: dict[str, int] = field(default_factory=dict)  # per-subject counts (dlq stages)
    consumers: int = 0  # consumers of the stream (a tap never adds one)


OnMessage = Callable[[TapMessage], Awaitable[None]]


def stream_of(subject_suffix: str) -> str:
    """`metrics.trainer.step` -> `metrics`; raises for an unknown stream."""
    stream = subject_suffix.split(".", 1)[0]
    if stream not in S.ALL_STREAMS:
        raise ValueError(f"unknown stream {stream!r}: choose one of {', '.join(S.ALL_STREAMS)}")
    return stream


def _ts(value: Any) -> float | None:
    return value.timestamp() if isinstance(value, dt.datetime) else None


class TapClient:
    """A connection that only observes one run."""

    def __init__(
        self,
        nc: Client,
        run_id: str,
        lost: LostServer | None = None,
        reconnects: Reconnects | None = None,
    ) -> None:
        self._nc, self._js = nc, nc.jetstream()
        self.names = RunNames(run_id)
        self._subs: list[Any] = []
        self._followers: list[StreamFollower] = []  # history follows
        self.lost = lost or LostServer()
        if reconnects is not None:
            reconnects.listen(self._on_reconnect)

    @classmethod
    async def connect(
        cls,
        url: str,
        run_id: str,
        name: str = "areal-tap",
        *,
        patience: Patience = OBSERVER_PATIENCE,
        note: Note | None = None,
        credentials: Credentials = NO_CREDENTIALS,
    ) -> TapClient:
        """Connect within `patience` (else `ConnectionError` naming the URL;
        `AuthenticationFailed`, naming the credentials to pass, when the server refuses
        them); `note` hears, once, that the server has not answered yet."""
        RunNames(run_id)  # validate before connecting
        lost, reconnects = LostServer(), Reconnects()
        nc = await _observer_connect(
            url, f"{name}-{run_id}", patience, note, lost.set, credentials, reconnects
        )
        return cls(nc, run_id, lost, reconnects)

    def subject(self, subject_suffix: str) -> str:
        """`trajectories` -> `areal.<run>.trajectories`; `metrics` -> `areal.<run>.metrics.>`."""
        stream = stream_of(subject_suffix)
        if subject_suffix == stream and stream not in S.WORK_QUEUE_STREAMS and stream != S.WEIGHTS:
            return self.names.subject(stream, ">")
        return f"areal.{self.names.run_id}.{subject_suffix}"

    async def check_run(self) -> None:
        """Raise a clear error when the run's streams do not exist on this server."""
        try:
            await self._js.stream_info(self.names.stream(S.METRICS))
        except NotFoundError:
            runs = await list_runs(self._nc)
            raise LookupError(
                f"run {self.names.run_id!r} has no streams on this NATS server; "
                f"runs here: {', '.join(runs) or 'none'} (pass --run ID)"
            ) from None

    # ------------------------------------------------------------------ following
    async def follow(
        self,
        subject_suffix: str,
        cb: OnMessage,
        *,
        history: int = 0,
        since_s: float | None = None,
    ) -> None:
        """Deliver messages on `areal.<run>.<subject_suffix>` to `cb`, live from now on.

        `history` > 0 first replays the last N stored messages (-1: all of them); `since_s`
        replays those stored in the last `since_s` seconds. On work-queue streams history is a
        peek at the messages still waiting in the queue (never a consumer).
        """
        stream = stream_of(subject_suffix)
        subject = self.subject(subject_suffix)
        replay = history != 0 or since_s is not None
        if stream in S.WORK_QUEUE_STREAMS or not replay:
            await self._follow_core(subject, cb)  # subscribe first: the peek may overlap, not gap
            if replay:
                await self._peek_queue(stream, subject, cb, history)
            return
        await self._follow_ordered(stream, subject, cb, history, since_s)

    async def _follow_core(self, subject: str, cb: OnMessage) -> None:
        async def on_msg(msg: Msg) -> None:
            headers = msg.headers or {}
            await cb(TapMessage(msg.subject, msg.data, headers.get("Nats-Msg-Id"), time.time()))

        sub = await self._nc.subscribe(subject, cb=on_msg, pending_bytes_limit=_PENDING_BYTES)
        self._subs.append(sub)

    async def _peek_queue(self, stream: str, subject: str, cb: OnMessage, history: int) -> None:
        info = await self._js.stream_info(self.names.stream(stream))
        seq, end, found = info.state.first_seq, info.state.last_seq, []
        while seq <= end and len(found) < 10_000:
            try:
                raw = await self._js.get_msg(
                    self.names.stream(stream), seq, subject=subject, next=True
                )
            except NotFoundError:
                break
            found.append(raw)
            seq = raw.seq + 1
        for raw in found[-history:] if history > 0 else found:
            headers = raw.headers or {}
            await cb(
                TapMessage(
                    raw.subject,
                    raw.data or b"",
                    headers.get("Nats-Msg-Id"),
                    time.time(),
                    raw.seq,
                    _ts(raw.time),
                    replayed=True,
                )
            )

    async def _follow_ordered(
        self, stream: str, subject: str, cb: OnMessage, history: int, since_s: float | None
    ) -> None:
        """History, then live, through a `StreamFollower` (direct gets: the monitor account may
        create no consumer)."""
        stream_name = self.names.stream(stream)
        whole_stream = subject == self.subject(stream)
        start_seq, start_time = 1, None
        skip_until = 0  # filtered last-N: skip while N or more matching messages follow
        if since_s is not None:
            start_time = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=since_s)
        elif history > 0 and whole_stream:
            last = (await self._js.stream_info(stream_name)).state.last_seq
            start_seq = max(1, last - history + 1)
        elif history > 0:
            skip_until = history

        async def on_msg(msg: StoredMsg) -> None:
            nonlocal skip_until
            if skip_until:
                if msg.pending >= skip_until:
                    return
                skip_until = 0  # past the skipped part
            await cb(
                TapMessage(
                    msg.subject,
                    msg.data,
                    msg.msg_id,
                    time.time(),
                    msg.seq,
                    msg.stored_at,
                    replayed=msg.pending > 0,
                )
            )

        sub = await follow_stream(
            self._nc, stream_name, subject, on_msg, start_seq=start_seq, start_time=start_time
        )
        self._subs.append(sub)
        self._followers.append(sub)

    def _on_reconnect(self) -> None:
        """The connection is back, maybe on a restarted server or another node of a cluster:
        the followers read again now (what was stored meanwhile rang no doorbell here)."""
        for sub in self._followers:
            sub.renew_soon()

    # ------------------------------------------------------------------ snapshots
    async def stream_stats(self) -> dict[str, QueueStats]:
        """Depth of every stream of the run, with the stage consumer's counters."""
        out: dict[str, QueueStats] = {}
        for stream in S.ALL_STREAMS:
            name = self.names.stream(stream)
            try:
                info = await self._js.stream_info(
                    name, subjects_filter=">" if stream == S.DLQ else None
                )
            except (NotFoundError, nats.errors.TimeoutError):
                continue
            ack_pending = pending = redelivered = None
            if stream in S.CONSUMER_OF:
                with contextlib.suppress(NotFoundError, nats.errors.TimeoutError):
                    ci = await self._js.consumer_info(name, S.CONSUMER_OF[stream])
                    ack_pending, pending = ci.num_ack_pending, ci.num_pending
                    redelivered = ci.num_redelivered
            out[stream] = QueueStats(
                stream,
                info.state.messages,
                info.state.bytes,
                ack_pending,
                pending,
                redelivered,
                dict(info.state.subjects or {}),
                info.state.consumer_count,
            )
        return out

    async def kv_state(self) -> dict[str, dict]:
        """The run-state bucket (`controller`, `trainer` keys) as JSON objects; a key without a
        value is left out, and {} when the run has no bucket yet. Other failures raise."""
        try:
            kv = await self._js.key_value(self.names.state_bucket)
        except NotFoundError:  # BucketNotFoundError: the run has not declared it (yet)
            return {}
        out: dict[str, dict] = {}
        for key in ("controller", "trainer"):
            try:
                entry = await kv.get(key)
            except (KeyNotFoundError, KeyDeletedError):
                continue
            if entry.value:
                out[key] = json.loads(entry.value)
        return out

    async def run_finished(self) -> bool:
        """Whether the run has ended: its trainer state says it reached its last step (`done`)
        and no launch began since. A `run_started` event stored after the last `run_finished`
        (events are ordered by stream sequence) is `areal run --resume` extending a finished
        run, whose trainer has not yet reset the old `done`: not finished."""
        if not (await self.kv_state()).get("trainer", {}).get("done"):
            return False
        stream = self.names.stream(S.EVENTS)
        ended = await last_seq(self._nc, stream, self.names.events_subject("run_finished"))
        started = await last_seq(self._nc, stream, self.names.events_subject("run_started"))
        return started <= ended  # equal: neither is stored (0)

    async def on_run_finished(self, cb: Callable[[], None]) -> None:
        """Call `cb` when the run's `run_finished` event is published from now on (core
        subscription: check `run_finished()` after this for a run that ended before)."""

        async def on_msg(msg: Msg) -> None:
            cb()

        subject = self.names.events_subject("run_finished")
        self._subs.append(await self._nc.subscribe(subject, cb=on_msg))

    async def close(self) -> None:
        # best effort: the observer is going away; the server drops its interest either way
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        with contextlib.suppress(Exception):
            await self._nc.drain()


async def list_runs(nc: Client) -> list[str]:
    """Run ids with streams on this server: the metrics streams' names read back through
    `run_of_stream` (the inverse of `RunNames.stream`), kept only when the stream carries that
    run's subjects (a stream made by hand or by an older naming is not a run)."""
    runs: list[str] = []
    for info in await nc.jetstream().streams_info():
        found = run_of_stream(info.config.name)
        if found is None or found[1] != S.METRICS:
            continue
        run_id = found[0]
        if (info.config.subjects or []) == [RunNames(run_id).subject(S.METRICS, ">")]:
            runs.append(run_id)
    return sorted(set(runs))


async def discover_run(
    url: str,
    *,
    patience: Patience = OBSERVER_PATIENCE,
    note: Note | None = None,
    credentials: Credentials = NO_CREDENTIALS,
) -> str:
    """The only run on the server at `url`; a clear error when there are none or several (and
    `ConnectionError` when nothing answers at `url` within `patience`)."""
    nc = await _observer_connect(url, "areal-tap-discover", patience, note, None, credentials)
    try:
        runs = await list_runs(nc)
    finally:
        with contextlib.suppress(Exception):  # best effort: a read-only probe connection
            await nc.close()
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise LookupError(f"no areal run on {url} yet: start one, or pass --run ID")
    raise LookupError(f"several runs on {url} ({', '.join(runs)}): pass --run ID")


class LostServer:
    """Set once an observer's server has been gone for `Patience.reconnect_s` (the connection is
    closed by then); `reason` says which server and the last error."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        self.reason = reason
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


async def _observer_connect(
    url: str,
    name: str,
    patience: Patience,
    note: Note | None,
    on_lost: Note | None,
    credentials: Credentials = NO_CREDENTIALS,
    reconnects: Reconnects | None = None,
) -> Client:
    """`connect` for observers: bounded patience, the observer hint in errors, and one `note`
    when the server has not answered within a second (so a wait is never silent)."""
    bound = (
        ""
        if patience.first_connect_s is None
        else f"; giving up after {patience.first_connect_s:g} s"
    )

    def say_waiting() -> None:
        if note is not None:
            note(f"waiting for NATS at {url}{bound}")

    waiting = asyncio.get_running_loop().call_later(1.0, say_waiting)
    try:
        return await connect(
            url,
            name,
            patience=patience,
            on_lost=on_lost,
            hint=OBSERVER_HINT,
            credentials=credentials,
            auth_hint=OBSERVER_AUTH_HINT,
            reconnects=reconnects,
        )
    finally:
        waiting.cancel()
