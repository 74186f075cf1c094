"""Run events (`areal.<run>.events.<kind>`) and metrics (`areal.<run>.metrics.<role>.<type>`)
delivered live to a typed callback.

A core subscription: it sees messages published from the moment it exists (both are also kept
in the run's streams for replay, `areal tap events --history N`). With `stream` given, a
`StreamFollower` (`areal.bus.follow`: direct gets, no consumer) replays what the stream still
holds of the subject first, then goes on live, each stored record once and in order (for a
reader that must not miss records published while it was down). A message that does not
decode as the expected model is logged and skipped; the subscription keeps going.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from areal.bus.codec import DecodeError, decode
from areal.bus.follow import StoredMsg, StreamFollower, follow_stream
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


class EventSubscription(BusSubscription):
    """A live subscription to one kind of run event."""


async def subscribe_decoded(
    nc: Client,
    subject: str,
    cls: type[M],
    cb: Callable[[M], Awaitable[None]],
    stream: str | None = None,
) -> BusSubscription | StreamFollower:
    """Decoded messages of `subject`: live (core), or with `stream` every record the stream
    holds and then each new one (`follow_stream`)."""

    async def on_msg(msg: Msg | StoredMsg) -> None:
        try:
            obj = decode(msg.data, cls)
        except DecodeError as e:
            log.warning("bad_live_message", subject=msg.subject, reason=str(e))
            return
        await cb(obj)

    if stream is not None:
        return await follow_stream(nc, stream, subject, on_msg)
    return BusSubscription(await nc.subscribe(subject, cb=on_msg), subject)


async def subscribe_events(nc: Client, subject: str, cb: OnEvent) -> EventSubscription:
    sub = await subscribe_decoded(nc, subject, Event, cb)
    assert isinstance(sub, BusSubscription)
    return EventSubscription(sub._sub, subject)
