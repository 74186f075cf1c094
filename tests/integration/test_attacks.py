"""The attacks one role's account could make on a run, against a real nats-server with the
run's per-role accounts: each is refused by the server and changes nothing (no consumer is
made, the stage's queue and consumer are as they were, no run_finished is stored), and a
run_finished that is not signed with the run's key is refused by the workers' check."""

from __future__ import annotations

import asyncio

import pytest

from areal.bus.auth import load_credentials
from areal.bus.client import Bus
from areal.bus.embedded import EmbeddedNats
from areal.bus.nats_config import authorization_block, ensure_accounts
from areal.config import NatsSettings
from areal.security.keys import RunKeys
from schemas import Event, ScoredSample
from schemas import subjects as S
from tests import attacks
from tests.factories import make_sample

pytestmark = pytest.mark.integration
GUARD_S = 60.0


@pytest.fixture
def secure(tmp_path, run_id):
    keys = tmp_path / "keys"
    server = EmbeddedNats(
        store_dir=tmp_path / "nats",
        authorization=authorization_block(ensure_accounts(keys, [run_id])),
    ).start()
    try:
        yield server, lambda role: load_credentials(keys / f"{role}.json")
    finally:
        server.stop()


async def bus_of(url, run_id, role, creds, keys=None, declare=False) -> Bus:
    return await Bus.connect(
        url,
        run_id,
        role,
        f"{role}-0",
        NatsSettings(),
        credentials=creds(role),
        declare=declare,
        keys=keys,
    )


async def test_every_attack_is_refused_and_changes_nothing(secure, run_id):
    server, creds = secure
    await (await bus_of(server.url, run_id, "launcher", creds, declare=True)).close()
    reward = await bus_of(server.url, run_id, "reward", creds)
    trainer = await bus_of(server.url, run_id, "trainer", creds)
    try:
        for i in range(3):  # scored groups queued for the trainer
            sample = make_sample().model_copy(update={"task_id": f"t{i}"})
            await reward.publish(S.REWARDS, ScoredSample(sample=sample, reward=1.0))
        names = S.RunNames(run_id)
        js = trainer._js
        before = {
            name: (await js.stream_info(name)).state.consumer_count
            for name in [names.stream(s) for s in S.ALL_STREAMS] + [f"KV_{names.state_bucket}"]
        }
        durable = await js.consumer_info(names.stream(S.REWARDS), S.CONSUMER_OF[S.REWARDS])

        refusals = [await attack() for attack in attacks.every_attack(server.url, run_id, creds)]
        assert len(refusals) == 11 and all(isinstance(r, attacks.Refusal) for r in refusals)

        after = {name: (await js.stream_info(name)).state.consumer_count for name in before}
        assert after == before  # no consumer was made anywhere
        again = await js.consumer_info(names.stream(S.REWARDS), S.CONSUMER_OF[S.REWARDS])
        assert again.config.filter_subject == durable.config.filter_subject
        info = await js.stream_info(names.stream(S.REWARDS))
        assert info.state.messages == 3 and info.config.max_msgs == -1  # nothing deleted
        events = await js.stream_info(names.stream(S.EVENTS), subjects_filter=">")
        assert names.events_subject("run_finished") not in (events.state.subjects or {})
    finally:
        await reward.close()
        await trainer.close()


async def test_only_a_run_finished_the_trainer_signed_is_trusted(secure, run_id):
    server, creds = secure
    await (await bus_of(server.url, run_id, "launcher", creds, declare=True)).close()
    keys = RunKeys.generate()
    trainer = await bus_of(server.url, run_id, "trainer", creds, keys=keys)
    rollout = await bus_of(server.url, run_id, "rollout", creds, keys=keys.public())
    got: list[Event] = []
    arrived = asyncio.Event()

    async def on_finished(ev: Event) -> None:
        got.append(ev)
        if len(got) == 3:
            arrived.set()

    await rollout.subscribe_events("run_finished", on_finished)
    await rollout.stream_depth(S.EVENTS)  # a round trip: the subscription is in place
    try:
        await attacks.unsigned_run_finished(server.url, run_id, creds("trainer"))
        # signed with another run's key: refused as well
        other = await bus_of(server.url, run_id, "trainer", creds, keys=RunKeys.generate())
        await other.event("run_finished", steps=1)
        await other.close()
        await trainer.event("run_finished", steps=2)  # the real one
        await asyncio.wait_for(arrived.wait(), GUARD_S)
        verdicts = [rollout.event_rejection(ev) for ev in got]
        assert "not signed" in verdicts[0]
        assert "refuses" in verdicts[1]
        assert verdicts[2] is None and got[2].detail == {"steps": 2}
        # a tampered copy of the real one (its detail changed) no longer verifies
        tampered = got[2].model_copy(update={"detail": {"steps": 999}})
        assert "refuses" in rollout.event_rejection(tampered)
    finally:
        await trainer.close()
        await rollout.close()
