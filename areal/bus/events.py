"""Run events (`areal.<run>.events.<kind>`) delivered live to a typed callback.

A core subscription: it sees events published from the moment it exists (events are also kept
in the run's events stream for replay, `areal tap events --history N`). A message that does not
decode as a `schemas.Event` is logged and skipped; the subscription keeps going.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from areal.bus.codec import DecodeError, decode
from schemas import Event

log = structlog.get_logger()

OnEvent = Callable[[Event], Awaitable[None]]


class BusSubscription:
    """A live subscription handed out by the bus (no nats object exposed); `unsubscribe` ends
    it."""

    def __init__(self, sub: Subscription, subject: str) -> None:
        self._sub, self.subject = sub, subject

    async def unsubscribe(self) -> None:
        await self._sub.unsubscribe()


class EventSubscription(BusSubscription):
    """A live subscription to one kind of run event."""


async def subscribe_events(nc: Client, subject: str, cb: OnEvent) -> EventSubscription:
    async def on_msg(msg: Msg) -> None:
        try:
            event = decode(msg.data, Event)
        except DecodeError as e:
            log.warning("bad_event", subject=msg.subject, reason=str(e))
            return
        await cb(event)

    return EventSubscription(await nc.subscribe(subject, cb=on_msg), subject)
