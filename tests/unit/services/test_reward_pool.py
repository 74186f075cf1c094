"""RewardService's pool failures: a scorer that kills its process, a reset that breaks another
call in flight, a closed pool. Counters come from the heartbeat."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from areal.services.reward import RewardService
from areal.services.reward_pool import ScoringPool
from schemas.subjects import RunNames
from tests.unit.services.test_reward_batching import sample, score_all

SCORERS = "tests.unit.services.scorers"


def service(fn: str, *, timeout_s: float, pool_workers: int, batch_size: int) -> RewardService:
    return RewardService(
        SimpleNamespace(worker_id="r", names=RunNames("r")),
        f"{SCORERS}:{fn}",
        timeout_s=timeout_s,
        pool_workers=pool_workers,
        batch_size=batch_size,
    )


@pytest.mark.asyncio
async def test_a_scorer_that_kills_its_process_costs_only_its_own_sample():
    svc = service("picky", timeout_s=2.0, pool_workers=1, batch_size=8)
    try:
        out = await asyncio.wait_for(score_all(svc, ["7", "crash", "7"]), 120)  # hang guard
        assert [r for r, _ in out] == [1.0, 0.0, 1.0]
        assert out[1][1]["error"].startswith("scoring failed: BrokenProcessPool")
        assert "error" not in out[0][1] and "error" not in out[2][1]
        hb = svc.heartbeat()
        # calls: the batch (crash, reset 1), "7" alone, "crash" alone (reset 2), "crash" in
        # quarantine (its reset, 3: blamed only there), "7" alone -> 5 calls, 3 resets
        assert hb["pool_calls"] == 5 and hb["pool_resets"] == 3 and hb["errors"] == 1
    finally:
        svc.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("fn", "bad", "error"),
    [
        ("exits", "exit", "SystemExit: 2"),  # raised on, it ended the worker's event loop
        ("unprintable", "bad", "_Unprintable: <its message could not be formatted>"),
    ],
)
async def test_a_scorer_that_exits_or_raises_oddly_costs_only_its_own_sample(fn, bad, error):
    svc = service(fn, timeout_s=2.0, pool_workers=1, batch_size=8)
    try:
        out = await asyncio.wait_for(score_all(svc, ["7", bad, "7"]), 120)  # hang guard
        assert [r for r, _ in out] == [1.0, 0.0, 1.0]
        assert out[1][1]["error"] == error
        assert svc.heartbeat()["pool_calls"] == 1  # one batch: nothing failed it whole
    finally:
        svc.close()


@pytest.mark.slow  # ~7 s on 2 cores: pool processes restart
@pytest.mark.asyncio
async def test_a_call_broken_by_another_calls_reset_is_retried_not_blamed(tmp_path: Path):
    # Two calls in flight (pool_workers=2, batch_size=3): B = [hang-once, "7", "8"] and
    # A = ["hang"]. Both hang with SIGALRM blocked. A's backstop comes first (1 x 1.0 s + 5 s
    # = 6 s, B's is 3 x 1.0 s + 5 s = 8 s): A's pool is killed and rebuilt, which breaks B's
    # call; B is retried whole on the new pool, where its first sample no longer hangs.
    svc = service("unstoppable", timeout_s=1.0, pool_workers=2, batch_size=3)
    try:
        texts = [f"hang-once:{tmp_path / 'marker'}", "7", "8", "hang"]
        out = await asyncio.wait_for(score_all(svc, texts), 120)
        assert [r for r, _ in out] == [1.0, 1.0, 0.0, 0.0]
        assert [d.get("error") for _, d in out] == [None, None, None, "timeout after 1.0s"]
        hb = svc.heartbeat()  # calls: B, A, B again; one reset (A's). Blaming B: 2 resets.
        assert hb["pool_calls"] == 3 and hb["pool_resets"] == 1 and hb["errors"] == 1
    finally:
        svc.close()


@pytest.mark.asyncio
async def test_scoring_after_close_raises_instead_of_answering():
    svc = service("picky", timeout_s=2.0, pool_workers=1, batch_size=8)
    assert (await svc.score(sample(0, "7")))[0] == 1.0
    svc.close()
    svc.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(svc.score(sample(1, "7")), 60)
    assert svc.heartbeat()["pool_resets"] == 0


@pytest.mark.slow  # ~8 s on 2 cores: pool processes crash and restart
@pytest.mark.asyncio
async def test_other_samples_crashes_never_score_an_innocent_sample_zero():
    """With 2 scoring processes, samples that crash theirs reset the pool again and again, and
    each reset breaks the innocent sample's call beside them. It is retried, then scored in
    quarantine, where only its own crash could break it: it keeps its real score."""
    pool = ScoringPool(f"{SCORERS}:slow_or_crash", workers=2, timeout_s=5.0)
    try:

        async def crashers() -> None:
            for _ in range(12):
                await pool.score([("crash", "")])

        storm = asyncio.create_task(crashers())
        innocent = await asyncio.wait_for(pool.score([("1", "1")]), 300)  # hang guard
        crashed = await asyncio.wait_for(storm, 300)
        assert crashed is None
        assert innocent[0][:2] == (1.0, None)
        assert pool.n_resets >= 12  # each crasher's own crash
    finally:
        pool.close()
