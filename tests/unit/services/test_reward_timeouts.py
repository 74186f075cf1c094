"""RewardService timeouts are per sample (issue 10, bug 5): a batch is not one timeout budget.

The pool tests use the scorers in `scorers.py`; the last ones call `score_items` in this process
(the pytest main thread, as in a pool process) to check the alarm's own bookkeeping.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from types import FrameType, SimpleNamespace

import pytest

from areal.rewards.scoring import score_items
from areal.services.reward import RewardService
from schemas.subjects import RunNames
from tests.unit.services.test_reward_batching import sample, score_all

SCORERS = "tests.unit.services.scorers"


def service(fn: str, timeout_s: float) -> RewardService:
    return RewardService(
        SimpleNamespace(worker_id="r", names=RunNames("r")),
        f"{SCORERS}:{fn}",
        timeout_s=timeout_s,
        pool_workers=1,
        batch_size=8,
    )


@pytest.mark.asyncio
async def test_slow_samples_each_within_the_timeout_are_scored_in_one_call():
    # 3 samples x 0.8 s = 2.4 s for the call, but each sample takes 0.8 s < timeout_s = 2.0 s.
    svc = service("slow", timeout_s=2.0)
    try:
        out = await asyncio.wait_for(score_all(svc, ["7", "8", "7"]), 60)  # hang guard only
        assert [r for r, _ in out] == [1.0, 0.0, 1.0]  # their real rewards, none timed out
        assert all("error" not in d for _, d in out)
        hb = svc.heartbeat()
        assert hb["pool_calls"] == 1 and hb["pool_resets"] == 0 and hb["errors"] == 0
    finally:
        svc.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("fn", ["picky", "stubborn", "deaf"])
async def test_a_hanging_sample_times_out_alone_in_its_batch(fn: str):
    # picky just sleeps; stubborn retries its work on any Exception (the timeout is not one);
    # deaf catches even the timeout and answers 1.0: each is still reported timed out.
    svc = service(fn, timeout_s=2.0)
    try:
        out = await asyncio.wait_for(score_all(svc, ["7", "hang", "7"]), 60)
        assert [r for r, _ in out] == [1.0, 0.0, 1.0]
        assert out[1][1]["error"] == "timeout after 2.0s"
        assert "error" not in out[0][1] and "error" not in out[2][1]
        hb = svc.heartbeat()  # the alarm stopped the hang inside the call: no reset, no retry
        assert hb["pool_calls"] == 1 and hb["pool_resets"] == 0 and hb["errors"] == 1
    finally:
        svc.close()


@pytest.mark.slow  # ~15 s on 2 cores: waits out a hard timeout and a pool restart
@pytest.mark.asyncio
async def test_a_hang_the_alarm_cannot_stop_is_killed_with_its_pool():
    # `unstoppable` blocks SIGALRM, so only the backstop (3 x 1.0 s + 5 s slack for the batch,
    # then 1.0 s + 5 s for the culprit alone) ends it: pool killed, batch re-scored one by one.
    svc = service("unstoppable", timeout_s=1.0)
    try:
        out = await asyncio.wait_for(score_all(svc, ["7", "hang", "7"]), 120)
        assert [r for r, _ in out] == [1.0, 0.0, 1.0]
        assert out[1][1]["error"] == "timeout after 1.0s"
        assert "error" not in out[0][1] and "error" not in out[2][1]
        hb = svc.heartbeat()
        # 1 batch call + 3 calls of one sample; resets: the batch's pool, then the culprit's
        assert hb["pool_calls"] == 4 and hb["pool_resets"] == 2 and hb["errors"] == 1
        assert (await svc.score(sample(9, "7")))[0] == 1.0  # the rebuilt pool works
    finally:
        svc.close()


def _never(signum: int, frame: FrameType | None) -> None:
    raise AssertionError("the previous SIGALRM handler must not run during these tests")


def test_score_items_restores_the_previous_handler_and_timer():
    prev_handler = signal.signal(signal.SIGALRM, _never)
    # a timer already running (pytest-timeout uses one): 1000 s, far beyond this test
    prev_timer = signal.setitimer(signal.ITIMER_REAL, 1000.0)
    try:
        fn = f"{SCORERS}:picky"
        out = score_items(fn, [("7", "7"), ("hang", "7"), ("boom", "7"), ("8", "7")], 0.3)
        assert [(r, e) for r, e, _ in out] == [
            (1.0, None),
            (0.0, "timeout after 0.3s"),
            (0.0, "ValueError: scorer exploded"),
            (0.0, None),
        ]
        assert signal.getsignal(signal.SIGALRM) is _never
        delay_s, interval_s = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < delay_s <= 1000.0 and interval_s == 0.0  # re-armed with the time it had left
    finally:
        signal.setitimer(signal.ITIMER_REAL, *prev_timer)
        signal.signal(signal.SIGALRM, prev_handler)


def test_score_items_off_the_main_thread_scores_without_an_alarm():
    out: list = []
    worker = threading.Thread(
        target=lambda: out.extend(score_items(f"{SCORERS}:picky", [("7", "7"), ("8", "7")], 0.3))
    )
    worker.start()
    worker.join(30)  # hang guard only
    assert [(r, e) for r, e, _ in out] == [(1.0, None), (0.0, None)]
