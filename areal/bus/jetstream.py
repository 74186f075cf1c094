"""JetStream's pull and publish protocols spoken directly over the core NATS connection.

nats-py's `fetch()` costs two tasks, a uuid and often a fresh pull request per message when
messages trickle in one by one (the normal case for a trainer fed at the pipeline's rate), and
its `publish()` a random token, a `wait_for` and a `PubAck` dataclass per message. Per sample
that is more Python than the codec; these two classes do the same protocol with less.

`PullInbox`: the consume loop keeps pull requests open on the server for as many messages as it
has room for; the server streams messages to one inbox subscription as they arrive, and the
loop takes them in batches. `outstanding` is how many messages the open requests may still
deliver. Each delivered message takes one off. A request's end carries `Nats-Pending-Messages`,
the part it did not deliver, which is taken off too: status 408 "Request Timeout" at its
expiry, or 409 "Batch Completed", "Message Size Exceeds MaxBytes" (its byte cap reached) or an
error such as "Exceeded MaxWaiting". The byte cap keeps what one request may deliver well under
the server's and the client's pending limits (64 / 128 MiB), where large samples would
otherwise get the worker cut off as a slow consumer. Invariant: held leases + outstanding <=
max_inflight, so the server never sends more than the loop has room for. Should a status be
lost, the count is reset once every request has passed its expiry plus a grace period. Two
losses are known at once and re-asked at once: a reconnect (the server, maybe another one of
the cluster, holds none of this client's requests) and status 409 "Leadership Change" with no
pending count (the consumer's leader moved to another server of a cluster: its open requests
are gone). Each request asks for an idle heartbeat (status 100 while it delivers nothing):
requests that fall silent for a few heartbeats died with the server that held them (a consumer
leader SIGKILLed in a cluster sends no 409) and are asked again then, not at their expiry. A 503
(no JetStream behind the subject: an election, a restart) is answered by a new request only
after `NO_RESPONDERS_BACKOFF_S`, never in a spin.

`PublishAcks`: a JetStream publish is a core publish with a reply subject; the stream answers
there with its ack (`{"stream", "seq"}` or `{"error"}`). Replies come to one wildcard inbox
subscription and resolve a future per publish; the timeout is one timer handle per publish. A
publish the server refuses for lack of permission gets no ack: `deny(subject, error)` (called
when the server reports the violation) fails the publishes waiting on that subject at once, and
a reconnect (`reconnected`) times out every publish still waiting, to be retried at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import Callable

import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

log = structlog.get_logger()

STATUS = "Status"
DESCRIPTION = "Description"
PENDING_MESSAGES = "Nats-Pending-Messages"
# A request that ends because it delivered its batch or reached its byte cap: nothing wrong.
ROUTINE_409 = ("Batch Completed", "Message Size Exceeds MaxBytes")
REQUEST_GRACE_S = 2.0  # after a request's expiry, how long to wait for its 408 before resetting
LEADERSHIP_CHANGE = "Leadership Change"  # 409: the consumer's leader moved; its requests are gone
HEARTBEAT_S = 1.0  # the server's idle heartbeat (status 100) per open request, at most this
HEARTBEATS_MISSED = 3  # silent for this many heartbeats: the requests died with their server
NO_RESPONDERS_BACKOFF_S = 0.5  # after a 503 (JetStream electing or down), before asking again


class PublishAcks:
    """Futures for JetStream publish acks, resolved from one wildcard reply subscription (closed
    with the connection)."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox() + "."
        self._next = 0
        self._waiting: dict[str, asyncio.Future] = {}
        self._subjects: dict[str, str] = {}  # token -> subject of the publish waiting there
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.prefix + "*", cb=self._on_reply)

    async def _on_reply(self, msg: Msg) -> None:
        fut = self._waiting.pop(msg.subject[len(self.prefix) :], None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def reconnected(self) -> None:
        """The connection was re-established: publishes still waiting for an ack time out now
        (their caller retries them with the same `Nats-Msg-Id`). One sent before the server
        went away gets no ack from the server that answers now, and would otherwise hold its
        caller for the whole timeout (10 s) after the server is back; one the client buffered
        and sent on the reconnect is only sent again, and de-duplicated."""
        for fut in self._waiting.values():
            _expire(fut)

    def deny(self, subject: str, error_of: Callable[[str], Exception]) -> None:
        """Fail every publish waiting for an ack on `subject` (compared case-insensitively: the
        client library lower-cases the server's report) with `error_of(its subject)`: the
        server refused it, no ack will come."""
        for token, subj in list(self._subjects.items()):
            fut = self._waiting.get(token)
            if subj.lower() == subject.lower() and fut is not None and not fut.done():
                fut.set_exception(error_of(subj))

    async def publish(
        self, subject: str, data: bytes, headers: dict[str, str] | None, timeout_s: float
    ) -> int:
        """Publish and wait for the stream's ack; returns the stream sequence.

        Raises `nats.errors.TimeoutError` (no ack in time: retry with the same `Nats-Msg-Id`),
        `nats.errors.NoRespondersError` (no stream on the subject, or JetStream is down), or
        `nats.js.errors.APIError` (the stream refused the message)."""
        self._next += 1
        token = str(self._next)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiting[token] = fut
        self._subjects[token] = subject
        timer = loop.call_later(timeout_s, _expire, fut)
        try:
            await self.nc.publish(subject, data, reply=self.prefix + token, headers=headers)
            msg = await fut
        finally:
            timer.cancel()
            self._waiting.pop(token, None)
            self._subjects.pop(token, None)
        if msg is None:
            raise nats.errors.TimeoutError
        status = _status(msg)
        if status == "503":
            raise nats.errors.NoRespondersError
        if status is not None:
            desc = msg.headers.get(DESCRIPTION, "")
            raise nats.js.errors.APIError(code=int(status), description=desc)
        ack = json.loads(msg.data)
        if "error" in ack:
            raise nats.js.errors.APIError.from_error(ack["error"])
        return ack.get("seq", 0)


def _status(msg: Msg) -> str | None:
    """A status message's code (e.g. "408"), or None for a message with a payload to handle."""
    return msg.headers.get(STATUS) if msg.headers else None


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class PullInbox:
    """Open pull requests of one durable consumer and the messages they have delivered."""

    def __init__(
        self,
        nc: Client,
        stream: str,
        durable: str,
        *,
        batch_cap: int,
        max_bytes: int,
        expires_s: float,
    ) -> None:
        self.nc = nc
        self.api_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.inbox = nc.new_inbox()
        self.batch_cap = batch_cap
        self.max_bytes = max_bytes  # per request; >= the largest message, or it never comes
        self.expires_s = expires_s
        self.outstanding = 0
        self.last_expiry = 0.0  # monotonic time by which every open request has expired
        self.buf: collections.deque[Msg] = collections.deque()
        self.wake = asyncio.Event()  # set by a delivery and by a settled lease (room)
        self.held: set = set()  # this loop's unsettled leases (they remove themselves)
        self._reconnects = nc.stats["reconnects"]  # at the last request: a change drops them all
        self.heartbeat_s = min(HEARTBEAT_S, expires_s / 4)
        self.last_heard = 0.0  # monotonic time of the last message or status in the inbox
        self.not_before = 0.0  # no request before this (monotonic; after a 503)
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.inbox, cb=self._on_msg)

    async def _on_msg(self, msg: Msg) -> None:
        self.buf.append(msg)
        self.last_heard = time.monotonic()
        self.wake.set()

    def release(self, lease: object) -> None:
        self.held.discard(lease)
        self.wake.set()

    async def top_up(self, max_inflight: int) -> None:
        """Ask for more messages once at least half of what there is room for is not asked."""
        self.wake.clear()  # what settles or arrives from here on wakes the next `wait`
        if self.outstanding and time.monotonic() > self.last_expiry + REQUEST_GRACE_S:
            log.warning("pull_requests_lost", subject=self.api_subject, assumed=self.outstanding)
            self.outstanding = 0
        reconnects = self.nc.stats["reconnects"]
        if reconnects != self._reconnects:  # the server (maybe another one) has none of them
            if self.outstanding:
                log.info("pull_reissued", subject=self.api_subject, cause="reconnect")
            self.outstanding = 0
            self._reconnects = reconnects
        if self.outstanding and self._silent():
            await asyncio.sleep(0.1)  # a busy loop may not have read what already came: let it
            if self.outstanding and self._silent():
                # no heartbeat: the server that held the requests (the consumer's leader) died
                log.info("pull_reissued", subject=self.api_subject, cause="heartbeats missed")
                self.outstanding = 0
        if time.monotonic() < self.not_before:
            return
        target = min(max_inflight - len(self.held), self.batch_cap)
        deficit = target - self.outstanding
        if deficit <= 0 or deficit < max(1, target // 2):
            return
        req = {
            "batch": deficit,
            "max_bytes": self.max_bytes,
            "expires": int(self.expires_s * 1e9),
            "idle_heartbeat": int(self.heartbeat_s * 1e9),
        }
        await self.nc.publish(self.api_subject, json.dumps(req).encode(), reply=self.inbox)
        if not self.outstanding:
            self.last_heard = time.monotonic()  # the silence is counted from the first request
        self.outstanding += deficit
        self.last_expiry = time.monotonic() + self.expires_s

    def _silent(self) -> bool:
        return time.monotonic() - self.last_heard > HEARTBEATS_MISSED * self.heartbeat_s

    async def wait(self, timeout_s: float) -> None:
        """Until a delivery, a settled lease or the timeout (no task per wait)."""
        if self.buf or self.wake.is_set():
            return
        handle = asyncio.get_running_loop().call_later(timeout_s, self.wake.set)
        try:
            await self.wake.wait()
        finally:
            handle.cancel()

    def take(self) -> list[Msg]:
        """The delivered messages, with the pull requests' status messages accounted and
        dropped."""
        out: list[Msg] = []
        while self.buf:
            msg = self.buf.popleft()
            status = _status(msg)
            if status is None:
                self.outstanding = max(0, self.outstanding - 1)
                out.append(msg)
            else:
                self._on_status(status, msg)
        return out

    def _on_status(self, status: str, msg: Msg) -> None:
        desc = msg.headers.get(DESCRIPTION, "")
        pending = msg.headers.get(PENDING_MESSAGES)
        if pending is not None and pending.isdigit():
            self.outstanding = max(0, self.outstanding - int(pending))
        elif status == "503":  # no JetStream behind the API subject: nothing was registered
            self.outstanding = 0
            self.not_before = time.monotonic() + NO_RESPONDERS_BACKOFF_S  # no spinning on 503s
        elif status == "409" and desc == LEADERSHIP_CHANGE:
            # every open request of this consumer is gone with its old leader: ask again now
            log.info("pull_reissued", subject=self.api_subject, cause="leadership change")
            self.outstanding = 0
            self.wake.set()
            return
        if status not in ("100", "408") and not (status == "409" and desc in ROUTINE_409):
            log.warning(
                "pull_status",
                subject=self.api_subject,
                status=status,
                description=desc,
            )

    async def close(self) -> list[Msg]:
        """Unsubscribe; returns delivered messages not yet taken (the caller hands them back)."""
        if self._sub is not None:
            with contextlib.suppress(Exception):  # connection already closed
                await self._sub.unsubscribe()
        return self.take()
