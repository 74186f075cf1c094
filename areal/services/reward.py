"""Reward: scores samples in a process pool with a timeout, publishes scored samples.

Invariants: a sample is acknowledged only after its scored sample is published (same msg id,
so a redelivery after a crash is de-duplicated by the server); a scorer that raises or times out
gives reward 0 with the error in `verifier` (the sample is not lost); a scorer that hangs is
killed with its pool, which is rebuilt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import multiprocessing as mp
import time

import structlog

from areal.bus.client import Bus, Lease
from areal.rewards.registry import get_reward_fn
from areal.services.common import BusyMeter, heartbeat_loop
from schemas import Sample, ScoredSample
from schemas import subjects as S

log = structlog.get_logger()


def _score(fn_name: str, completion: str, answer: str) -> float:
    return float(get_reward_fn(fn_name)(completion, answer))


class RewardService:
    def __init__(self, bus: Bus, fn_name: str, *, timeout_s: float, pool_workers: int) -> None:
        get_reward_fn(fn_name)  # fail fast on a bad spec, in this process
        self.bus, self.fn_name, self.timeout_s, self.pool_workers = (
            bus,
            fn_name,
            timeout_s,
            pool_workers,
        )
        self.pool = self._new_pool()
        self.n_scored = 0
        self.n_errors = 0
        self.meter = BusyMeter()

    def _new_pool(self) -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(self.pool_workers, mp_context=mp.get_context("spawn"))

    def _reset_pool(self) -> None:
        old = self.pool
        self.pool = self._new_pool()
        for p in list(getattr(old, "_processes", {}).values()):
            p.kill()
        old.shutdown(wait=False, cancel_futures=True)

    async def score(self, sample: Sample) -> tuple[float, dict]:
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(
            self.pool, _score, self.fn_name, sample.output_text, sample.answer
        )
        detail: dict = {"fn": self.fn_name}
        try:
            reward = await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            self._reset_pool()
            reward, detail["error"] = 0.0, f"timeout after {self.timeout_s}s"
        except Exception as e:  # user scorer failed: reward 0, reason kept
            reward, detail["error"] = 0.0, f"{type(e).__name__}: {e}"
        detail["time_s"] = round(time.perf_counter() - t0, 6)
        self.n_errors += "error" in detail
        return reward, detail

    async def handle(self, sample: Sample, lease: Lease) -> None:
        self.meter.start()
        try:
            reward, detail = await self.score(sample)
        finally:
            self.meter.stop()
        scored = ScoredSample(
            sample=sample, reward=reward, verifier=detail, reward_worker_id=self.bus.worker_id
        )
        await self.bus.publish(S.REWARDS, scored)
        await lease.ack()
        self.n_scored += 1

    async def run(self, stop: asyncio.Event) -> None:
        log.info("reward_started", fn=self.fn_name)
        hb = asyncio.create_task(heartbeat_loop(self.bus, self.heartbeat, stop))
        try:
            await self.bus.consume(
                S.TRAJECTORIES, Sample, self.handle, max_inflight=64 * self.pool_workers, stop=stop
            )
        finally:
            hb.cancel()
            self.pool.shutdown(wait=False, cancel_futures=True)

    def heartbeat(self) -> dict:
        return {
            "samples": self.n_scored,
            "errors": self.n_errors,
            "busy_frac": self.meter.busy_frac(),
            "fn": self.fn_name,
        }
