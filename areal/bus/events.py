"""Run events (`areal.<run>.events.<kind>`) and metrics (`areal.<run>.metrics.<role>.<type>`)
delivered live to a typed callback.

A core subscription: it sees messages published from the moment it exists (both are also kept
in the run's streams for replay, `areal tap events --history N`). With `js` given, an ordered
JetStream consumer replays what the stream still holds of the subject first, then goes on live
(for a reader that must not miss records published while it was down), and after a server
restart resumes where it left off (`subscribe_ordered`). A message that does not
decode as the expected model is logged and skipped; the subscription keeps going.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from areal.bus.codec import DecodeError, decode
from schemas import Event, Message, MetricRecord

log = structlog.get_logger()

M = TypeVar("M", bound=Message)
OnEvent = Callable[[Event], Awaitable[None]]
OnMetric = Callable[[MetricRecord], Awaitable[None]]


class BusSubscription:
    """A live subscription handed out by the bus (no nats object exposed); `unsubscribe` ends
    it."""

    def __init__(self, sub: Subscription, subject: str) -> None:
        self._sub, self.subject = sub, subject

    async def unsubscribe(self) -> None:
        await self._sub.unsubscribe()


RENEW_GIVE_UP_S = 90.0  # a renewal that fails (the server cannot make the consumer yet) is
RENEW_FIRST_DELAY_S = 0.5  # retried after 0.5 s, doubling up to 5 s, for this long
RENEW_MAX_DELAY_S = 5.0


class RenewedSubscription(BusSubscription):
    """A subscription through an ordered JetStream consumer, opened again on `renew_soon()`
    (the bus calls it after every reconnect).

    An ordered consumer is ephemeral and lives on one server: a restarted server, or a failover
    to another node of a cluster, loses it, and the library notices only after two missed 5 s
    heartbeats, 10-20 s in which nothing is delivered. `open_` makes the new subscription and
    decides where it starts: the weights subscription again at the latest announcement (its
    callback may see one twice and takes repeats), `subscribe_ordered` after the last message it
    delivered (none missed, none repeated). A failed `open_` is tried again for
    `give_up_after_s`; `open_` itself should try once (this is the one retry loop)."""

    def __init__(
        self,
        first: BusSubscription,
        open_: Callable[[], Awaitable[BusSubscription]],
        give_up_after_s: float = RENEW_GIVE_UP_S,
    ):
        super().__init__(first._sub, first.subject)
        self._open, self._give_up_after_s = open_, give_up_after_s
        self._renewing: asyncio.Task[None] | None = None
        self._closed = False
        self.renewals = 0

    @property
    def closed(self) -> bool:
        return self._closed

    def renew_soon(self) -> None:
        if not self._closed and (self._renewing is None or self._renewing.done()):
            self._renewing = asyncio.ensure_future(self._renew())

    async def _renew(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._give_up_after_s
        delay, attempt = RENEW_FIRST_DELAY_S, 0
        while True:
            attempt += 1
            try:
                new = await self._open()
                break
            except Exception as e:  # noqa: BLE001 - a background task: say so, try again
                # e.g. a cluster still electing the stream's leader: the consumer cannot be
                # made yet (nats-py's own reset of the old one may still come, later)
                error = f"{type(e).__name__}: {e}"
                if self._closed:
                    return
                if loop.time() + delay > deadline:
                    log.error(
                        "resubscribe_gave_up",
                        subject=self.subject,
                        attempts=attempt,
                        error=error,
                        note="kept the old subscription; the next reconnect tries again",
                    )
                    return
                log.warning(
                    "resubscribe_failed", subject=self.subject, attempt=attempt, error=error
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RENEW_MAX_DELAY_S)
        old, self._sub = self._sub, new._sub
        self.renewals += 1
        with contextlib.suppress(nats.errors.Error):
            await old.unsubscribe()
        if self._closed:  # unsubscribed while the new one was being made
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()

    async def unsubscribe(self) -> None:
        self._closed = True
        if self._renewing is not None and not self._renewing.done():
            self._renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewing
        await self._sub.unsubscribe()


async def subscribe_ordered(
    js: JetStreamContext,
    subject: str,
    cb: Callable[[Msg], Awaitable[None]],
    config: ConsumerConfig,
    give_up_after_s: float = RENEW_GIVE_UP_S,
    **options: Any,
) -> RenewedSubscription:
    """A subscription through an ordered consumer (`config` says where it starts; `options`
    go to `js.subscribe`) that `renew_soon()` opens again where it left off: from the stream
    sequence after the last one delivered (or as `config` says, when none was yet). The old and
    the new consumer may both deliver for a moment; each stream sequence reaches `cb` once, in
    order, so a renewal neither misses a message nor repeats one (for `areal tap --history`,
    `areal top`: records, not states, where a repeat would be counted twice). A renewal the
    server cannot make yet is retried for `give_up_after_s`."""
    last = 0  # the highest stream sequence passed to `cb`

    async def on_msg(msg: Msg) -> None:
        nonlocal last
        seq = msg.metadata.sequence.stream
        if seq <= last:  # the other consumer of a renewal delivered it already
            return
        last = seq
        await cb(msg)

    async def open_() -> BusSubscription:
        cfg = dataclasses.replace(config)  # nats-py writes its inbox into the config it gets
        if last:
            cfg = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=last + 1
            )
        sub = await js.subscribe(subject, cb=on_msg, config=cfg, ordered_consumer=True, **options)
        return BusSubscription(sub, subject)

    return RenewedSubscription(await open_(), open_, give_up_after_s)


class EventSubscription(BusSubscription):
    """A live subscription to one kind of run event."""


async def subscribe_decoded(
    nc: Client,
    subject: str,
    cls: type[M],
    cb: Callable[[M], Awaitable[None]],
    js: JetStreamContext | None = None,
    give_up_after_s: float = RENEW_GIVE_UP_S,
) -> BusSubscription:
    async def on_msg(msg: Msg) -> None:
        try:
            obj = decode(msg.data, cls)
        except DecodeError as e:
            log.warning("bad_live_message", subject=msg.subject, reason=str(e))
            return
        await cb(obj)

    if js is not None:
        return await subscribe_ordered(
            js, subject, on_msg, ConsumerConfig(deliver_policy=DeliverPolicy.ALL), give_up_after_s
        )
    return BusSubscription(await nc.subscribe(subject, cb=on_msg), subject)


async def subscribe_events(nc: Client, subject: str, cb: OnEvent) -> EventSubscription:
    sub = await subscribe_decoded(nc, subject, Event, cb)
    return EventSubscription(sub._sub, subject)
