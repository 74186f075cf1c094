"""Each reward replica counts and logs its share: groups and samples scored, rejected groups and
markers passed on, in its heartbeat, in a periodic `reward_worker_stats` line while the counts
move, and in `reward_stopped` at exit (what `docker compose logs reward` shows per replica)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from areal.services.common import stats_log_loop
from areal.services.reward import RewardService
from areal.services.samples import rejection_marker
from schemas import SampleGroup
from schemas.subjects import RunNames
from tests.factories import make_sample

RUN, G = "rs", 2
FN = "tests.unit.services.scorers:picky"


def group(seq: int, texts: tuple[str, ...] = ("42", "41")) -> SampleGroup:
    return SampleGroup(
        samples=[
            make_sample(
                task_id=f"{RUN}-t{seq}", task_seq=seq, sample_idx=i, group_size=G, output_text=t
            )
            for i, t in enumerate(texts)
        ]
    )


class Lease:
    def __init__(self) -> None:
        self.outcome: str | None = None

    async def ack(self) -> None:
        self.outcome = "ack"

    async def dead_letter(self, reason: str) -> None:
        self.outcome = "dead_letter"


class FakeBus:
    """What the reward service asks of the bus; `consume` delivers `inbox` then waits for stop."""

    def __init__(self, inbox: list[SampleGroup]) -> None:
        self.names, self.worker_id = RunNames(RUN), "reward-7"
        self.inbox = inbox
        self.published: list[Any] = []
        self.leases: list[Lease] = []

    async def publish(self, stream: str, msg: Any, *rest: str, msg_id: str | None = None):
        self.published.append(msg)

    async def dead_letter(self, stage: str, msg: Any, reason: str) -> None:
        pass

    async def latest_weights(self):
        return SimpleNamespace(version=2)  # make_sample's samples are of version 2

    async def metric(self, type_: str, values: dict) -> None:
        pass

    async def consume(self, stream, cls, handler, *, stop, **_: Any) -> None:
        for g in self.inbox:
            self.leases.append(lease := Lease())
            await handler(g, lease)
        await stop.wait()


def service(bus: FakeBus, **kw: Any) -> RewardService:
    return RewardService(bus, FN, timeout_s=20, pool_workers=1, **kw)


@pytest.mark.asyncio
async def test_a_replica_counts_groups_samples_rejections_and_markers():
    marker = rejection_marker(f"{RUN}-t9", 9, G, "too long", worker_id="rollout-1")
    foreign = group(1).model_copy(
        update={"samples": [make_sample(task_id="other-t1", task_seq=1, group_size=G)]}
    )
    bus = FakeBus([])
    svc = service(bus)
    try:
        for g in (group(0), group(1, ("42", "boom")), SampleGroup(samples=[marker]), foreign):
            await svc.handle(g, Lease())
    finally:
        svc.close()
    # 2 groups of 2 scored ("boom" raises: reward 0, counted as an error), 1 marker passed on,
    # 1 group of another run dead-lettered
    assert svc.stats() == {"groups": 2, "samples": 4, "errors": 1, "rejected": 1, "markers": 1}
    hb = svc.heartbeat()
    assert {k: hb[k] for k in svc.stats()} == svc.stats() and "worker_id" not in hb


@pytest.mark.asyncio
async def test_run_logs_the_counts_while_they_move_and_once_more_at_exit():
    bus = FakeBus([group(0), group(1)])
    svc = service(bus, stats_log_s=0.01)
    stop = asyncio.Event()
    with capture_logs() as logs:
        task = asyncio.create_task(svc.run(stop))

        async def two_groups_logged() -> None:
            while not any(e["event"] == "reward_worker_stats" and e["groups"] == 2 for e in logs):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(two_groups_logged(), 30)
        stop.set()
        await asyncio.wait_for(task, 30)
    assert [ls.outcome for ls in bus.leases] == ["ack", "ack"]
    periodic = [e for e in logs if e["event"] == "reward_worker_stats"]
    final = [e for e in logs if e["event"] == "reward_stopped"]
    want = {
        "worker_id": "reward-7",
        "groups": 2,
        "samples": 4,
        "errors": 0,
        "rejected": 0,
        "markers": 0,
    }
    assert periodic[-1].items() >= want.items()
    assert len(final) == 1 and final[0].items() >= want.items()
    # unchanged counts are not logged again: at most one line per distinct count
    assert len(periodic) == len({e["groups"] for e in periodic})


@pytest.mark.asyncio
async def test_the_stats_loop_skips_idle_periods_and_ends_on_stop():
    calls = 0
    called_thrice = asyncio.Event()

    def stats() -> dict:
        nonlocal calls
        calls += 1
        if calls == 3:
            called_thrice.set()
        return {"n": min(calls, 2)}  # 1, 2, 2, 2, ...: a replica gone idle

    stop = asyncio.Event()
    with capture_logs() as logs:
        loop = asyncio.create_task(stats_log_loop("x_stats", stats, stop, 0.001))
        await asyncio.wait_for(called_thrice.wait(), 10)
        stop.set()
        await asyncio.wait_for(loop, 10)
    assert [e["n"] for e in logs if e["event"] == "x_stats"] == [1, 2]
