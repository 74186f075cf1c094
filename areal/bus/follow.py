"""Following a stream's subject without a consumer: batched direct gets, woken by a doorbell.

Why not an ordered consumer: creating any consumer needs `$JS.API.CONSUMER.CREATE`, and a
consumer may name a `deliver_subject` its creator may not publish on; the server then publishes
the stream's messages there on the creator's behalf (nats-server does not check; DESIGN section
10). With that grant any account could stop a run (deliver a record to `events.run_finished`)
or feed a stage's queue. So no role creates consumers: a follower reads stored messages by
sequence (`$JS.API.DIRECT.GET.<stream>` with `next_by_subj` and `batch`, which only reads), and
a core subscription on the same subject is its doorbell: a message there means "read again now"
(its payload is never used, so whatever arrives on it can only cause a read).

Invariants:
- `cb` sees each stored message of the subject at most once, in stream order, starting where
  `start_seq` / `start_time` say; a reconnect, a restarted server or a lost doorbell delays a
  message (the follower reads again at least every `idle_poll_s`), never skips or repeats one;
- a read that fails (no answer, a server away) is retried with a growing pause (0.25 s to 5 s),
  logged once per failure streak; `unsubscribe` stops it for good;
- what `cb` raises is logged and the message counts as delivered (one bad record must not stop
  a follower, nor replay forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = structlog.get_logger()

BATCH = 256  # messages per direct get
IDLE_POLL_S = 1.0  # read again this often without a doorbell (one lost while reconnecting)
REPLY_TIMEOUT_S = 10.0  # a read without an answer this long is retried
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 5.0


@dataclass(frozen=True)
class StoredMsg:
    """One message as the stream stored it."""

    subject: str
    data: bytes
    headers: dict[str, str]
    seq: int
    stored_at: float  # epoch seconds, the server's timestamp
    pending: int  # messages of the followed subject stored after this one (when it was read)

    @property
    def msg_id(self) -> str | None:
        return self.headers.get("Nats-Msg-Id")


OnStored = Callable[[StoredMsg], Awaitable[None]]


def parse_stamp(text: str) -> float:
    """`2026-12-06T19:51:28.255264779Z` (RFC 3339, nanoseconds) -> epoch seconds."""
    head, _, frac = text.rstrip("Z").partition(".")
    base = dt.datetime.fromisoformat(head).replace(tzinfo=dt.timezone.utc).timestamp()
    return base + (float(f"0.{frac}") if frac.isdigit() else 0.0)


class StreamFollower:
    """Deliver the stored messages of `subject` (wildcards allowed) in stream `stream` to `cb`,
    then each new one as it is stored. Start with `start()`; `unsubscribe()` ends it."""

    def __init__(
        self,
        nc: Client,
        stream: str,
        subject: str,
        cb: OnStored,
        *,
        start_seq: int = 1,
        start_time: dt.datetime | None = None,
        idle_poll_s: float = IDLE_POLL_S,
        batch: int = BATCH,
    ) -> None:
        self._nc, self.stream, self.subject, self._cb = nc, stream, subject, cb
        self._next_seq = max(1, start_seq)
        self._start_time = start_time
        self._idle_poll_s, self._batch = idle_poll_s, batch
        self._bell = asyncio.Event()
        self._replies: asyncio.Queue[Msg] = asyncio.Queue()
        self._tokens = itertools.count()
        self._token = ""
        self._inbox = nc.new_inbox()
        self._subs: list[Subscription] = []
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.delivered = 0
        self.caught_up = asyncio.Event()  # set once a read found nothing more to deliver

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def next_seq(self) -> int:
        return self._next_seq

    async def start(self) -> StreamFollower:
        async def on_bell(_msg: Msg) -> None:
            self._bell.set()

        async def on_reply(msg: Msg) -> None:
            if msg.subject.rsplit(".", 1)[-1] == self._token:  # not a late answer to a retry
                self._replies.put_nowait(msg)

        self._subs.append(await self._nc.subscribe(f"{self._inbox}.*", cb=on_reply))
        self._subs.append(await self._nc.subscribe(self.subject, cb=on_bell))
        self._task = asyncio.create_task(self._run(), name=f"follow {self.subject}")
        return self

    def renew_soon(self) -> None:
        """Read again now (the bus calls it after a reconnect: messages stored meanwhile rang
        no doorbell here)."""
        self._bell.set()

    async def _run(self) -> None:
        delay, failing = RETRY_FIRST_S, False
        while not self._closed:
            self._bell.clear()
            try:
                more = await self._read_batch()
            except (nats.errors.Error, asyncio.TimeoutError, OSError) as e:
                if not failing:
                    log.warning("follow_read_failed", subject=self.subject, error=repr(e))
                failing = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            if failing:
                log.info("follow_read_recovered", subject=self.subject)
            delay, failing = RETRY_FIRST_S, False
            if more:
                continue
            self.caught_up.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._bell.wait(), self._idle_poll_s)

    async def _read_batch(self) -> bool:
        """One direct get of up to `batch` messages from `_next_seq`; True when more wait."""
        req: dict = {"next_by_subj": self.subject, "batch": self._batch}
        if self._start_time is not None and self._next_seq == 1:
            req["start_time"] = self._start_time.astimezone(dt.timezone.utc).isoformat()
        else:
            req["seq"] = self._next_seq
        self._token = str(next(self._tokens))
        while not self._replies.empty():  # nothing of an earlier read is left to confuse this one
            self._replies.get_nowait()
        await self._nc.publish(
            f"$JS.API.DIRECT.GET.{self.stream}",
            json.dumps(req).encode(),
            reply=f"{self._inbox}.{self._token}",
        )
        while True:
            msg = await asyncio.wait_for(self._replies.get(), REPLY_TIMEOUT_S)
            headers = dict(msg.headers or {})
            status = headers.get("Status")
            if status == "404":  # nothing (more) stored
                return False
            if status == "204":  # end of a batch: more may follow
                return int(headers.get("Nats-Num-Pending", "0") or 0) > 0
            if status:
                raise nats.errors.Error(
                    f"direct get of {self.subject} from {self.stream}: {status} "
                    f"{headers.get('Description', '')}"
                )
            seq = int(headers["Nats-Sequence"])
            if seq < self._next_seq:
                continue
            self._next_seq = seq + 1
            stored = StoredMsg(
                subject=headers.get("Nats-Subject", self.subject),
                data=msg.data or b"",
                headers=headers,
                seq=seq,
                stored_at=parse_stamp(headers.get("Nats-Time-Stamp", "1970-01-01T00:00:00Z")),
                pending=int(headers.get("Nats-Num-Pending", "0") or 0),
            )
            try:
                await self._cb(stored)
            except Exception as e:  # noqa: BLE001 - one record must not stop the follower
                log.exception("follow_callback_failed", subject=stored.subject, error=repr(e))
            self.delivered += 1
            if "Nats-Num-Pending" not in headers:  # a server without batches: one per read
                return True

    async def unsubscribe(self) -> None:
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._subs.clear()


async def follow_stream(
    nc: Client,
    stream: str,
    subject: str,
    cb: OnStored,
    *,
    start_seq: int = 1,
    start_time: dt.datetime | None = None,
) -> StreamFollower:
    """A started `StreamFollower` (see the module docstring)."""
    return await StreamFollower(
        nc, stream, subject, cb, start_seq=start_seq, start_time=start_time
    ).start()


async def last_seq(nc: Client, stream: str, subject: str, timeout_s: float = 5.0) -> int:
    """The sequence of the last message stored on the literal `subject` (0: none), by a direct
    get (`last_by_subj`): where to start following only what comes next."""
    try:
        reply = await nc.request(
            f"$JS.API.DIRECT.GET.{stream}",
            json.dumps({"last_by_subj": subject}).encode(),
            timeout=timeout_s,
        )
    except nats.errors.NoRespondersError:
        raise nats.errors.Error(f"stream {stream} does not answer direct gets") from None
    headers = reply.headers or {}
    if headers.get("Status") == "404":
        return 0
    if headers.get("Status"):
        raise nats.errors.Error(
            f"direct get of {subject} from {stream}: {headers.get('Status')} "
            f"{headers.get('Description', '')}"
        )
    return int(headers["Nats-Sequence"])
