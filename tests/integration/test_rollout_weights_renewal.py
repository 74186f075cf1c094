"""A reconnect of the bus's connection (or `WeightsFollower.announcement_missed`) makes the weights follower
read again while the rollout's callback for a version is still busy fetching it: the version is
fetched and decoded once (the follower never repeats an announcement, and the rollout's fetch
runs in a task of its own)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from areal.bus.client import Bus
from areal.core.scheduling import SchedulerPolicy
from areal.core.validate import Bounds
from areal.engines.base import SamplingParams
from areal.services.rollout import RolloutService

pytestmark = pytest.mark.integration


class FakeEngine:
    version = 0

    def check_weights(self, state, version) -> None:
        return None


async def wait_until(cond, timeout_s=30.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline
        await asyncio.sleep(0.01)


async def test_a_renewal_does_not_throw_away_the_fetch_under_way(nats_url, run_id):
    trainer = await Bus.connect(nats_url, run_id, "trainer", "trainer-0")
    rollout = await Bus.connect(nats_url, run_id, "rollout", "rollout-0")
    gate, entered = threading.Event(), threading.Event()

    calls: list[int] = []

    def decode(data: bytes):
        calls.append(1)
        entered.set()
        gate.wait(30)  # a slow decode (or a slow fetch): the callback is busy
        return {}

    svc = RolloutService(
        rollout,
        FakeEngine(),
        lambda ids: "",
        SamplingParams(max_new_tokens=8, stop_token_ids=()),
        policy=SchedulerPolicy(interruptible=True),
        max_concurrent_tasks=1,
        weights_from_bytes=decode,
        bounds=Bounds(run_id=run_id),
    )
    await svc.weights.start()
    sub = svc.weights.sub
    try:
        await trainer.put_weights(1, b"x" * 64, "float32", step=1)
        await asyncio.to_thread(entered.wait, 30)
        rollout._on_reconnect()  # what the connection's reconnect callback calls
        await asyncio.sleep(1.0)  # a repeated delivery of v1 would be handled now
        gate.set()
        await asyncio.sleep(2.0)
        # v1 is stored, announced, and the stream's latest; it should be known to the rollout
        assert svc.sched.known_version == 1
        assert len(calls) == 1, f"v1 fetched and decoded {len(calls)} times"
    finally:
        gate.set()
        await sub.unsubscribe()
        await trainer.close()
        await rollout.close()
