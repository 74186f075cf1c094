"""How a tap lets the tail of a finished run arrive before it stops (`settle`): it returns once
no message came for `quiet_s`, at once when its count is reached, and never after `max_s`."""

from __future__ import annotations

import asyncio
import time

from areal.bus.tap import TapMessage
from areal.monitor.tap import Tap, settle


def _msg(i: int) -> TapMessage:
    # undecodable bytes still count as a message shown (rendered as `undecodable ...`)
    return TapMessage("areal.r.metrics.trainer.step", b"\xc1", f"id-{i}", time.time())


async def _deliver(tap: Tap, n: int, every_s: float) -> None:
    for i in range(n):
        await asyncio.sleep(every_s)
        await tap.on_message(_msg(i))


async def test_settle_waits_until_the_messages_stop():
    lines: list[str] = []
    tap = Tap(emit=lines.append)
    feeder = asyncio.ensure_future(_deliver(tap, 4, every_s=0.1))
    await settle(tap, quiet_s=0.5, max_s=60.0)
    assert feeder.done() and tap.n == 4  # every message of the tail was shown
    assert all(line.startswith("undecodable areal.r.metrics.trainer.step") for line in lines)


async def test_settle_returns_at_once_when_the_count_is_reached():
    tap = Tap(emit=None, count=2)
    feeder = asyncio.ensure_future(_deliver(tap, 2, every_s=0.05))
    await settle(tap, quiet_s=30.0, max_s=60.0)  # a quiet period this long would hang the test
    assert tap.done.is_set() and tap.n == 2
    await feeder


async def test_settle_gives_up_after_max_s_on_an_endless_stream():
    tap = Tap(emit=None)
    feeder = asyncio.ensure_future(_deliver(tap, 10_000, every_s=0.05))
    await asyncio.wait_for(settle(tap, quiet_s=0.5, max_s=0.6), 30.0)  # hang guard
    assert 0 < tap.n < 10_000
    feeder.cancel()
