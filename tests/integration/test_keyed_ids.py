"""Message ids keyed with the run's secret: an outsider who knows the id scheme cannot publish
first under the id of a real message to come and have the server drop the real one."""

from __future__ import annotations

import pytest

from areal.bus.client import Bus
from areal.bus.codec import encode
from areal.config import NatsSettings
from areal.security.keys import RunKeys
from schemas import subjects as S
from tests.factories import make_sample
from tests.integration.test_bus import raw_client

pytestmark = pytest.mark.integration


async def test_a_forged_message_under_a_real_id_does_not_preempt_the_real_one(nats_url, run_id):
    keys = RunKeys.generate()
    bus = await Bus.connect(nats_url, run_id, "rollout", "rollout-0", NatsSettings(), keys=keys)
    real = make_sample()
    async with raw_client(nats_url) as nc:  # the forger knows the scheme: task id / index
        forged = encode(make_sample(output_text="forged"))
        await nc.jetstream().publish(
            bus.names.subject(S.TRAJECTORIES), forged, headers={"Nats-Msg-Id": real.msg_id()}
        )
    for _ in range(3):  # the real one, and its retries: stored once, next to the forgery
        await bus.publish(S.TRAJECTORIES, real)
    assert await bus.stream_depth(S.TRAJECTORIES) == 2
    # the keyed id is deterministic for the run (a restarted worker republishes the same id)
    again = await Bus.connect(nats_url, run_id, "rollout", "rollout-1", NatsSettings(), keys=keys)
    await again.publish(S.TRAJECTORIES, real)
    assert await bus.stream_depth(S.TRAJECTORIES) == 2
    assert bus.keyed_id(real.msg_id()).startswith(real.msg_id() + "#")
    plain = await Bus.connect(nats_url, run_id, "rollout", "rollout-2", NatsSettings())
    assert plain.keyed_id(real.msg_id()) == real.msg_id()
    for b in (bus, again, plain):
        await b.close()
