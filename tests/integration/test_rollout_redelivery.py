"""Bug 2 of issue 10: a redelivered copy of a task that is still being generated must not be
acked at once. Before the fix the rollout service acked it; if the worker then died, the task
was gone from the stream and the run waited forever for its group.

Here a worker holds a task whose generation is blocked; the task's message is handed back and
redelivered to the same worker while it still generates. The worker then dies without settling
anything: the task must still be on the `prompts` stream (it comes back after ack_wait).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from areal.bus.client import Bus
from areal.core.scheduling import SchedulerPolicy
from areal.data.tiny_model import build_tiny_model
from areal.engines.base import InferenceEngineConfig, SamplingParams
from areal.engines.torch_infer import TorchInferenceEngine, weights_from_safetensors
from areal.services.rollout import RolloutService
from schemas import Task
from schemas import subjects as S
from tests.factories import make_task

pytestmark = pytest.mark.integration


class GatedEngine(TorchInferenceEngine):
    """The real engine; each decode step waits until the test opens the gate."""

    gate = threading.Event()
    started = threading.Event()
    idle = threading.Event()

    def _decode(self, batch, tokens):
        self.started.set()
        self.gate.wait(timeout=60)  # hang guard only
        return super()._decode(batch, tokens)

    def generate(self, *args, **kwargs):
        self.idle.clear()
        try:
            return super().generate(*args, **kwargs)
        finally:
            self.idle.set()

    @classmethod
    def reset(cls) -> None:
        cls.gate.clear()
        cls.started.clear()
        cls.idle.set()


async def wait_until(cond, what: str, timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s  # hang guard only
    while not cond():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def group_task(run_id: str) -> Task:
    return make_task(task_id=f"{run_id}-t0", prompt="1+2=", answer="3")


async def start_worker(nats_url: str, run_id: str, model_dir) -> tuple[Bus, RolloutService]:
    bus = await Bus.connect(nats_url, run_id, "rollout", "rollout-0")
    engine = GatedEngine(InferenceEngineConfig(kind="torch", model_path=str(model_dir), seed=0))
    svc = RolloutService(
        bus,
        engine,
        lambda ids: "",
        SamplingParams(max_new_tokens=8, stop_token_ids=()),
        policy=SchedulerPolicy(interruptible=True),
        max_concurrent_tasks=1,
        weights_from_bytes=weights_from_safetensors,
    )
    return bus, svc


async def redelivered_mid_generation(nats_url, run_id, model_dir):
    """A worker generating a task (blocked at its first decode step) whose message is handed
    back and redelivered to it; returns (bus, service, stop, runner, task)."""
    GatedEngine.reset()
    bus, svc = await start_worker(nats_url, run_id, model_dir)
    stop = asyncio.Event()
    runner = asyncio.create_task(svc.run(stop))
    task = group_task(run_id)
    await bus.publish(S.PROMPTS, task)
    await asyncio.to_thread(GatedEngine.started.wait, 60)  # generation of the task is under way
    (first,) = svc.sched.tasks[task.task_id].handles
    await first.nak()  # the server hands the message out again, to this worker (its only one)
    await wait_until(lambda: svc.stats["adopted_redeliveries"] == 1, "redelivery")
    return bus, svc, stop, runner, task


async def test_redelivery_of_a_task_in_progress_is_held_not_acked(nats_url, run_id, model_dir):
    bus, svc, stop, runner, task = await redelivered_mid_generation(nats_url, run_id, model_dir)
    assert len(svc.sched.tasks[task.task_id].handles) == 2  # the new lease is held with the task

    # the worker dies without settling anything: its task must still be on the stream
    stop.set()
    runner.cancel()
    await bus.close(nak_unsettled=False)
    observer = await Bus.connect(nats_url, run_id, "test", "observer")
    try:
        assert await observer.stream_depth(S.PROMPTS) == 1
    finally:
        await observer.close()
        GatedEngine.gate.set()  # let the orphaned generate call end
        await asyncio.to_thread(GatedEngine.idle.wait, 60)


async def test_an_adopted_redelivery_is_acked_with_its_task(nats_url, run_id, model_dir):
    bus, svc, stop, runner, task = await redelivered_mid_generation(nats_url, run_id, model_dir)
    GatedEngine.gate.set()  # let generation finish: both samples publish, the task is acked
    await wait_until(lambda: task.task_id not in svc.sched.tasks, "task done")
    assert svc.stats["samples"] == 2
    await wait_until(lambda: bus.held_leases == 0, "leases settled")
    assert await bus.stream_depth(S.PROMPTS) == 0  # acked: gone from the work queue
    assert await bus.stream_depth(S.TRAJECTORIES) == 1  # both samples published once, together
    stop.set()
    await runner
    await bus.close()
