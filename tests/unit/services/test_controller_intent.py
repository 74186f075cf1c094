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


class RestartBus(Bus):
    """The KV of a controller that died after publishing its intent's tasks, before it counted
    them (`admitted`), and a trainer that has since returned their slots."""

    def __init__(self, saved: ControllerState, trainer: TrainerState) -> None:
        super().__init__()
        self.saved, self.trainer_rec = saved, trainer
        self.latest = SimpleNamespace(version=0)

    async def kv_get(self, key, model):
        return self.saved if model is ControllerState else self.trainer_rec

    async def kv_put(self, key, value) -> None:
        await super().kv_put(key, value)
        if isinstance(value, ControllerState):
            self.saved = value.model_copy()

    async def kv_watch(self, key):
        return SilentWatch()


def test_a_restarted_controller_believes_slots_returned_for_its_last_intent():
    """B = 2, η = 0: tasks 0 and 1 were filtered; the controller recorded the intent to admit 2
    and 3, published them and died before recording `admitted = 4`; the trainer filtered 2 and 3
    as well (returned 4). The restarted controller must believe that record (4 returned of 4
    it meant to admit): refusing it, it admitted nothing more, ever, and the run hung."""
    bus = RestartBus(ControllerState(admitted=2, admitting=4), TrainerState(filtered=4))
    ctrl = controller(bus)
    stop = asyncio.Event()

    async def main() -> None:
        task = asyncio.create_task(ctrl.run(stop))
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(task, 60)  # hang guard

    asyncio.run(main())
    assert ctrl.trainer.returned == 4 and not ctrl._refusals
    published = [m.seq for k, m in bus.log if k == "publish" and isinstance(m, Task)]
    assert published[:2] == [2, 3]  # the intent again (the server drops the copies)
    assert 4 in published and 5 in published  # and the run goes on
