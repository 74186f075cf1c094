"""The controller records which tasks it is about to admit before it publishes them, and refuses
trainer records that the trainer could not have written."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from areal.core.admission import AdmissionPolicy
from areal.services.controller import Controller
from schemas import Task
from schemas.state import ControllerState, TrainerState
from schemas.subjects import RunNames


class Bus:
    def __init__(self) -> None:
        self.names, self.worker_id, self.log = RunNames("r"), "c", []
        self.latest = SimpleNamespace(version=2)

    async def kv_put(self, key, value) -> None:
        self.log.append(("kv", value.model_copy()))

    async def publish(self, stream, msg) -> None:
        self.log.append(("publish", msg))

    async def metric(self, *a) -> None:
        pass

    async def latest_weights(self):
        return self.latest


def controller(bus: Bus) -> Controller:
    item = SimpleNamespace(index=0, prompt="1+1=", answer="2", metadata={})
    return Controller(
        bus,
        SimpleNamespace(get=lambda i: item),
        SimpleNamespace(ids=lambda it: [1, 2]),
        policy=AdmissionPolicy(batch_size=2, max_staleness=0, total_steps=3),
        group_size=4,
    )


def test_the_intent_is_recorded_before_any_task_of_it_is_published():
    bus = Bus()
    assert asyncio.run(controller(bus).admit_once()) == 2
    kinds = [k for k, _ in bus.log]
    assert kinds == ["kv", "publish", "publish", "kv"]
    intent, done = bus.log[0][1], bus.log[-1][1]
    assert isinstance(intent, ControllerState) and (intent.admitted, intent.admitting) == (0, 2)
    assert (done.admitted, done.admitting) == (2, 2)
    assert [m.seq for k, m in bus.log if k == "publish" and isinstance(m, Task)] == [0, 1]


def test_an_implausible_trainer_record_is_refused():
    bus = Bus()
    ctrl = controller(bus)
    asyncio.run(ctrl.admit_once())
    cases = [
        (TrainerState(version=5), "never announced"),
        (TrainerState(version=1, step=1, done=True), "done at step 1 of 3"),
        (TrainerState(version=1, dropped_stale=3), "returned slots for 2 admitted"),
    ]
    for state, why in cases:
        assert why in (asyncio.run(ctrl._implausible(state)) or ""), why
    assert asyncio.run(ctrl._implausible(TrainerState(version=2, step=2))) is None
    ctrl.trainer = TrainerState(version=2)
    assert "went back" in asyncio.run(ctrl._implausible(TrainerState(version=1)))


class SilentWatch:
    """A watch whose consumer is gone: it reports nothing until reopened."""

    def __init__(self) -> None:
        self.reopens = 0

    async def wait(self, timeout_s: float) -> bool:
        await asyncio.sleep(0)
        return False

    def reopen(self) -> None:
        self.reopens += 1

    async def stop(self) -> None:
        pass


def test_a_version_the_watch_did_not_report_reopens_it():
    """The controller re-reads the trainer after every wait; a newer version that its watch did
    not report means the watch's consumer is gone (a cluster node's death the connection did
    not see): it reopens the watch, and only then."""
    bus = Bus()
    ctrl = controller(bus)
    watch = SilentWatch()
    states = iter([TrainerState(), TrainerState(), TrainerState(version=1, step=1)])
    stop = asyncio.Event()

    async def kv_get(key, model):
        if model is ControllerState:
            return None
        state = next(states, None)
        if state is None:
            stop.set()
            return TrainerState(version=1, step=1)
        return state

    async def kv_watch(key):
        return watch

    bus.kv_get, bus.kv_watch = kv_get, kv_watch
    asyncio.run(asyncio.wait_for(ctrl.run(stop), 30))
    assert ctrl.trainer.version == 1
    assert watch.reopens == 1  # once: for the one unreported version, not for unchanged reads
