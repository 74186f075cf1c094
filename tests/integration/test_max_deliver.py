"""A message no stage can settle ends visibly, never silently (`nats.max_deliver`).

JetStream stops delivering a message after its consumer's `max_deliver`, and in a work-queue
stream it then stays there unseen: its task never ends, the trainer's last step never fills, and
the run hangs at the end. So the server's consumers have no limit, and the bus gives a message up
itself once it has used its deliveries, through the stage's `refuse`: a dead letter with the
reason, and a rejection marker downstream, so the trainer retires the task (accounted as
rejected, its slot given back). Each stage here: a rollout whose engine keeps failing, a reward
whose scorer keeps failing, a trainer handed a group that its earlier incarnations held and lost.
And the trainer does not wait for data once its consumer has died.
"""

from __future__ import annotations

import asyncio

import pytest

from areal.bus.client import Bus
from areal.bus.codec import pack
from areal.config import NatsSettings
from areal.core.scheduling import SchedulerPolicy
from areal.engines.base import SamplingParams
from areal.services.reward import RewardService
from areal.services.rollout import RolloutService
from schemas import SampleGroup, ScoredGroup, ScoredSample
from schemas import subjects as S
from schemas.state import CONTROLLER_KEY, ControllerState
from tests.factories import make_sample, make_task
from tests.integration.conftest import model_dir  # noqa: F401  (fixture)
from tests.integration.test_trainer_publish import make_trainer

pytestmark = pytest.mark.integration

GUARD_S = 120.0  # a hang guard only


async def until(pred, what: str, timeout_s: float = GUARD_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await pred():
        assert loop.time() < deadline, f"hang guard: {what}"
        await asyncio.sleep(0.1)


async def depth(bus: Bus, stream: str) -> int:
    return await bus.stream_depth(stream)


class FailingEngine:
    """Takes the requests it is offered, then fails (a CUDA OOM on every batch, say)."""

    version = 0

    def __init__(self) -> None:
        self.calls = 0

    def generate(
        self, requests, *, params, poll_weights=None, on_finished=None, poll_requests=None
    ):
        self.calls += 1
        if poll_requests is not None:
            poll_requests()
        raise RuntimeError("engine exploded")

    def check_weights(self, state_dict, version):
        pass

    def load_weights(self, update):
        pass


async def test_a_task_whose_generation_keeps_failing_is_retired_not_stranded(nats_url, run_id):
    bus = await Bus.connect(nats_url, run_id, "rollout", "rollout-0", NatsSettings(max_deliver=2))
    engine = FailingEngine()
    svc = RolloutService(
        bus,
        engine,
        lambda ids: "",
        SamplingParams(max_new_tokens=4, stop_token_ids=()),
        policy=SchedulerPolicy(interruptible=False),
        max_concurrent_tasks=1,
    )
    stop = asyncio.Event()
    runner = asyncio.create_task(svc.run(stop))
    task = make_task(task_id=f"{run_id}-t0", seq=0)
    await bus.publish(S.PROMPTS, task)
    await until(lambda: _marker_and_dead_letter(bus), "the task's marker and dead letter")
    assert engine.calls == 2  # max_deliver attempts, then given up on its next delivery
    await until(lambda: _is_zero(bus, S.PROMPTS), "the task removed from prompts")
    stop.set()
    await runner
    await bus.close()


async def _marker_and_dead_letter(bus: Bus) -> bool:
    return await depth(bus, S.TRAJECTORIES) == 1 and await depth(bus, S.DLQ) == 1


async def _is_zero(bus: Bus, stream: str) -> bool:
    return await depth(bus, stream) == 0


class BrokenReward(RewardService):
    async def score(self, sample):  # e.g. its scoring pool broken under it
        raise RuntimeError("the scoring pool is closed")


async def test_a_group_whose_scoring_keeps_failing_tells_the_trainer(nats_url, run_id):
    bus = await Bus.connect(nats_url, run_id, "reward", "reward-0", NatsSettings(max_deliver=2))
    svc = BrokenReward(bus, "math", timeout_s=2.0, pool_workers=1)
    samples = [  # version-0 tokens: nothing is published yet
        make_sample(
            task_id=f"{run_id}-t0",
            task_seq=0,
            sample_idx=i,
            group_size=2,
            versions=pack([0] * 5, "int32"),
        )
        for i in range(2)
    ]
    stop = asyncio.Event()
    runner = asyncio.create_task(svc.run(stop))
    await bus.publish(S.TRAJECTORIES, SampleGroup(samples=samples))
    await until(lambda: _is_one(bus, S.REWARDS), "a marker on rewards")
    stop.set()
    await runner
    assert await depth(bus, S.DLQ) == 1  # the group, with the scorer's error
    assert await depth(bus, S.TRAJECTORIES) == 0
    await bus.close()


async def _is_one(bus: Bus, stream: str) -> bool:
    return await depth(bus, stream) == 1


async def test_a_group_its_trainers_kept_losing_is_retired_as_rejected(
    nats_url,
    run_id,
    model_dir,  # noqa: F811
    tmp_path,
):
    settings = NatsSettings(max_deliver=2)
    bus = await Bus.connect(nats_url, run_id, "trainer", "trainer-0", settings)
    await bus.kv_put(CONTROLLER_KEY, ControllerState(admitted=1, admitting=1))
    sample = make_sample(
        task_id=f"{run_id}-t0",
        task_seq=0,
        sample_idx=0,
        group_size=1,
        versions=pack([0] * 5, "int32"),
    )
    await bus.publish(S.REWARDS, ScoredGroup(scored=[ScoredSample(sample=sample, reward=1.0)]))

    # two trainer incarnations took the group and stopped holding it (handed back unsettled)
    seen: list[int] = []
    lost = asyncio.Event()

    async def lose(obj, lease):
        seen.append(lease.num_delivered)
        if lease.num_delivered < settings.max_deliver:
            await lease.nak()
        else:
            await lease.nak(delay_s=2.0)  # back only once the next trainer runs
            lost.set()

    await bus.consume(S.REWARDS, ScoredGroup, lose, max_inflight=1, stop=lost)
    assert seen == [1, 2]

    svc = make_trainer(bus, model_dir, tmp_path)
    stop = asyncio.Event()
    runner = asyncio.create_task(svc.run(stop))
    await until(lambda: _rejected_and_written(svc), "the task retired as rejected, checkpointed")
    assert svc.intake.state.trained == 0
    await until(lambda: _is_zero(bus, S.REWARDS), "the group acked with the checkpoint")
    assert await depth(bus, S.DLQ) == 1
    stop.set()
    await runner
    await bus.close()


async def _rejected_and_written(svc) -> bool:
    return svc.intake.kv_state().rejected == 1


async def test_a_trainer_whose_consumer_died_stops_instead_of_waiting_for_data(
    nats_url,
    run_id,
    model_dir,  # noqa: F811
    tmp_path,
):
    bus = await Bus.connect(nats_url, run_id, "trainer", "trainer-0")

    async def dead_consumer(*args, **kwargs):
        await asyncio.sleep(0.2)
        raise RuntimeError("consumer crashed")

    bus.consume = dead_consumer  # this bus only
    svc = make_trainer(bus, model_dir, tmp_path)
    with pytest.raises(RuntimeError, match="consumer crashed"):
        await asyncio.wait_for(svc.run(asyncio.Event()), GUARD_S)
    await bus.close()
