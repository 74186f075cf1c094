"""`RenewedSubscription`: what a renewal does when the server cannot make the new consumer yet
(a cluster still electing the stream's leader after a node died): it tries again, and the old
subscription stays until a new one is made."""

from __future__ import annotations

import asyncio

import pytest

from areal.bus import events
from areal.bus.events import BusSubscription, RenewedSubscription


class _Sub:
    def __init__(self, name: str) -> None:
        self.name, self.unsubscribed = name, False

    async def unsubscribe(self) -> None:
        self.unsubscribed = True


def _never_renewed(
    first: _Sub, tries: list[int], give_up_after_s: float = 60.0
) -> RenewedSubscription:
    """A subscription whose renewals always fail (each try appends to `tries`)."""

    async def open_() -> BusSubscription:
        tries.append(1)
        raise TimeoutError("nats: timeout")

    return RenewedSubscription(BusSubscription(first, "s"), open_, give_up_after_s)  # type: ignore[arg-type]


async def test_a_failed_renewal_is_tried_again_until_the_consumer_is_made(monkeypatch):
    monkeypatch.setattr(events, "RENEW_FIRST_DELAY_S", 0.01)
    opened: list[_Sub] = []
    failures = 2

    async def open_() -> BusSubscription:
        nonlocal failures
        if failures:
            failures -= 1
            raise TimeoutError("nats: timeout")  # what a leaderless stream answers
        opened.append(_Sub(f"new-{len(opened)}"))
        return BusSubscription(opened[-1], "s")  # type: ignore[arg-type]

    first = _Sub("first")
    sub = RenewedSubscription(BusSubscription(first, "s"), open_)  # type: ignore[arg-type]
    sub.renew_soon()
    await asyncio.wait_for(sub._renewing, 60.0)  # a hang guard
    assert sub.renewals == 1 and [s.name for s in opened] == ["new-0"]
    assert sub._sub is opened[0] and first.unsubscribed  # the old one ends only then
    await sub.unsubscribe()
    assert opened[0].unsubscribed


async def test_a_renewal_that_never_succeeds_keeps_the_old_subscription(monkeypatch):
    monkeypatch.setattr(events, "RENEW_FIRST_DELAY_S", 0.01)
    monkeypatch.setattr(events, "RENEW_MAX_DELAY_S", 0.01)
    first, tries = _Sub("first"), []
    sub = _never_renewed(first, tries, give_up_after_s=0.1)
    sub.renew_soon()
    await asyncio.wait_for(sub._renewing, 60.0)  # a hang guard: it gives up after 0.1 s
    assert len(tries) > 1 and sub.renewals == 0  # tried again, then gave up
    assert sub._sub is first and not first.unsubscribed
    sub.renew_soon()  # the next reconnect tries again
    await asyncio.wait_for(sub._renewing, 60.0)
    assert len(tries) > 2 and sub._sub is first


@pytest.mark.parametrize("when", ["before", "during"])
async def test_unsubscribe_stops_a_renewal_that_is_retrying(monkeypatch, when):
    monkeypatch.setattr(events, "RENEW_FIRST_DELAY_S", 0.05)
    first, tries = _Sub("first"), []
    sub = _never_renewed(first, tries)
    if when == "before":
        await sub.unsubscribe()
    sub.renew_soon()
    if when == "during":
        await asyncio.sleep(0.02)
        await sub.unsubscribe()
    await asyncio.sleep(0.2)
    assert len(tries) == (0 if when == "before" else 1)
    assert first.unsubscribed
