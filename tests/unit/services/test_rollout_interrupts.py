"""Rate-limited interrupts in the rollout service: a pending version is switched to mid-batch at
most once per `interrupt_min_interval_s`, and a task admitted at that version does not start
before its weights are really in place."""

from __future__ import annotations

import asyncio

import pytest

from areal.bus.codec import pack
from areal.data.tiny_model import build_tiny_model
from areal.engines.base import GenRequest, SamplingParams, WeightUpdate
from areal.engines.torch_infer import TorchInferenceEngine, weights_from_safetensors
from areal.services.rollout import RolloutService, _InFlight
from schemas import Task


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return TorchInferenceEngine(str(build_tiny_model(tmp_path_factory.mktemp("m"), seed=0)))


def service(engine, interval: float) -> RolloutService:
    return RolloutService(
        None,
        engine,
        None,
        SamplingParams(),
        interruptible=True,  # type: ignore[arg-type]
        max_concurrent_tasks=1,
        weights_from_bytes=weights_from_safetensors,
        interrupt_min_interval_s=interval,
    )


def queue_task(svc: RolloutService, admitted_version: int) -> None:
    task = Task(
        task_id="t0",
        seq=0,
        dataset_index=0,
        prompt="1+1=",
        prompt_ids=pack([5, 6], "int32"),
        answer="2",
        group_size=1,
        admitted_version=admitted_version,
    )
    entry = _InFlight(task, None, 1, asyncio.get_running_loop().create_future())  # type: ignore[arg-type]
    svc._queue.append((entry, GenRequest(key="t0/0", prompt_ids=[5, 6])))


async def test_switches_at_most_once_per_interval(engine):
    svc = service(engine, interval=3600)
    svc._pending = WeightUpdate(version=1, state_dict={})
    first = svc._interrupt()
    assert first is not None and first.version == 1  # the first switch is never delayed
    svc._pending = WeightUpdate(version=2, state_dict={})
    assert svc._interrupt() is None  # within the interval: keep decoding on the current weights
    assert svc._pending.version == 2  # not lost: applied at the next allowed boundary
    queue_task(svc, admitted_version=2)
    assert svc._take_requests() == []  # its weights are not in place yet, so it must wait


async def test_zero_interval_switches_every_time(engine):
    svc = service(engine, interval=0.0)
    for v in (1, 2, 3):
        svc._pending = WeightUpdate(version=v, state_dict={})
        assert svc._interrupt().version == v
    svc._pending = WeightUpdate(version=4, state_dict={})
    queue_task(svc, admitted_version=4)
    assert [r.key for r in svc._take_requests()] == ["t0/0"]  # will start on v4, switched now
