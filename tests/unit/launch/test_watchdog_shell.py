"""The launcher's watchdog shell (`areal.launch.watchdog`): what it does with the core's
decisions. A fake bus records events; the clock is the test's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from areal.core.watchdog import WatchdogPolicy
from areal.launch.watchdog import LauncherWatchdog
from schemas import Event, MetricRecord


class FakeBus:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.subscribed: list[tuple] = []

    async def subscribe_metrics(self, role, type_, cb):
        self.subscribed.append(("metrics", role, type_))
        return SimpleNamespace(unsubscribe=_noop)

    async def subscribe_events(self, kind, cb):
        self.subscribed.append(("events", kind))
        return SimpleNamespace(unsubscribe=_noop)

    async def event(self, kind: str, **detail) -> None:
        self.events.append((kind, detail))


async def _noop() -> None:
    return None


def _beat(wid: str, role: str, pid: int) -> MetricRecord:
    return MetricRecord(
        role=role, worker_id=wid, type="heartbeat", values={"pid": pid, "host": "h1"}
    )


def test_a_frozen_worker_of_the_launcher_is_killed_reported_and_its_cost_counted() -> None:
    async def scenario() -> tuple[LauncherWatchdog, FakeBus, list[str]]:
        now = [0.0]
        killed: list[str] = []

        def kill(wid: str) -> int | None:  # only rollout-0 is a process of this launcher
            if wid != "rollout-0":
                return None
            killed.append(wid)
            return 4321

        dog = LauncherWatchdog(
            WatchdogPolicy(frozen_after_s=10.0, startup_s=60.0), kill=kill, clock=lambda: now[0]
        )
        bus = FakeBus()
        await dog.attach(bus)
        dog.started("rollout-0", "rollout", 4321)
        for t in range(0, 11):  # rollout-0 beats once, at t=0; trainer-0 every second
            now[0] = float(t)
            if t == 0:
                await dog._on_beat(_beat("rollout-0", "rollout", 4321))
                dog.on_step(1)
            await dog._on_beat(_beat("trainer-0", "trainer", 7))
            await dog._on_beat(_beat("launcher", "launcher", 1))  # not a worker: ignored
            dog.tick()
        # a worker joined from elsewhere, silent too: named, not killed
        await dog._on_beat(_beat("rollout-gpu7", "rollout", 55))
        for t in range(11, 22):
            now[0] = float(t)
            await dog._on_beat(_beat("trainer-0", "trainer", 7))
            dog.tick()
        dog.exited("rollout-0", 4321)
        dog.started("rollout-0", "rollout", 5000)  # the launcher's restart
        now[0] = 25.0
        await dog._on_beat(_beat("rollout-0", "rollout", 5000))
        await dog._on_beat(_beat("trainer-0", "trainer", 7))
        now[0] = 26.0
        dog.on_step(2)
        await dog.close()
        return dog, bus, killed

    dog, bus, killed = asyncio.run(scenario())
    assert killed == ["rollout-0"]  # once, though it stayed silent
    assert ("metrics", "*", "heartbeat") in bus.subscribed
    frozen = [d for k, d in bus.events if k == "worker_frozen"]
    assert [d["worker_id"] for d in frozen] == ["rollout-0", "rollout-gpu7"]
    mine, joined = frozen
    assert mine["pid"] == 4321 and mine["host"] == "h1" and mine["silent_s"] == 10.0
    assert mine["action"].startswith("SIGKILLed (pid 4321)")
    assert joined["action"].startswith("none: not a process of this launcher")
    [recovered] = [d for k, d in bus.events if k == "worker_recovered"]
    # out from t=0 (its last beat) to t=25 (the restart's first); no new step from 0 to 26
    assert recovered == {
        "worker_id": "rollout-0",
        "role": "rollout",
        "down_s": 25.0,
        "held_s": 26.0,
        "step": 2,
    }
    [line, _] = dog.report()
    assert line.startswith("watchdog: rollout-0 froze (10.0 s without a heartbeat")
    assert line.endswith("out 25.0 s, the run held 26.0 s")


def test_a_worker_that_said_it_stopped_is_not_named() -> None:
    async def scenario() -> FakeBus:
        now = [0.0]
        dog = LauncherWatchdog(
            WatchdogPolicy(frozen_after_s=10.0, startup_s=60.0),
            kill=lambda wid: None,
            clock=lambda: now[0],
        )
        bus = FakeBus()
        await dog.attach(bus)
        await dog._on_beat(_beat("rollout-gpu7", "rollout", 55))
        stop = Event(type="worker_stopped", role="rollout", worker_id="rollout-gpu7")
        stop.detail = {"pid": 55, "exit_code": 0}
        await dog._on_stopped(stop)
        for t in range(1, 40):
            now[0] = float(t)
            await dog._on_beat(_beat("trainer-0", "trainer", 7))
            dog.tick()
        await dog.close()
        return bus

    assert asyncio.run(scenario()).events == []
