"""Reward: scores samples in a process pool with a timeout, publishes scored samples.

Samples that arrive together are scored in one pool call (up to `batch_size`; at most
`pool_workers` calls in flight): per-call IPC, pickling and thread hand-offs cost far more than
a string-matching scorer, so one call per sample made the reward worker one of the busiest
processes of a CPU run.

Invariants: a sample is acknowledged only after its scored sample is published (same msg id,
so a redelivery after a crash is de-duplicated by the server); a scorer that raises or times out
gives reward 0 with the error in `verifier` (the sample is not lost, and the other samples of its
batch keep their own rewards); a scorer that hangs is killed with its pool, which is rebuilt,
and the rest of its batch is re-scored one by one, each with the full timeout.
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


Scored = tuple[float, str | None, float]  # reward, error, seconds


def _score_many(fn_name: str, items: list[tuple[str, str]]) -> list[Scored]:
    """Runs in a pool process: score each (completion, answer); an exception is per item."""
    fn = get_reward_fn(fn_name)
    out: list[Scored] = []
    for completion, answer in items:
        t0 = time.perf_counter()
        try:
            out.append((float(fn(completion, answer)), None, time.perf_counter() - t0))
        except Exception as e:  # user scorer failed: reward 0, reason kept
            out.append((0.0, f"{type(e).__name__}: {e}", time.perf_counter() - t0))
    return out


class RewardService:
    def __init__(
        self,
        bus: Bus,
        fn_name: str,
        *,
        timeout_s: float,
        pool_workers: int,
        batch_size: int = 32,
    ) -> None:
        get_reward_fn(fn_name)  # fail fast on a bad spec, in this process
        self.bus, self.fn_name, self.timeout_s = bus, fn_name, timeout_s
        self.pool_workers, self.batch_size = pool_workers, batch_size
        self.pool = self._new_pool()
        self.n_scored = 0
        self.n_errors = 0
        self.n_calls = 0  # pool calls made (samples / calls = the batching achieved)
        self.meter = BusyMeter()
        self._queue: list[tuple[Sample, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._calls = asyncio.Semaphore(pool_workers)
        self._batcher: asyncio.Task | None = None
        self._inflight: set[asyncio.Task] = set()

    def _new_pool(self) -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(self.pool_workers, mp_context=mp.get_context("spawn"))

    def _reset_pool(self) -> None:
        old = self.pool
        self.pool = self._new_pool()
        for p in list(getattr(old, "_processes", {}).values()):
            p.kill()
        old.shutdown(wait=False, cancel_futures=True)

    async def score(self, sample: Sample) -> tuple[float, dict]:
        """Score one sample (batched with whatever else is waiting); never raises for a scorer
        error or timeout: those give reward 0 and `detail["error"]`."""
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._batch_loop())
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append((sample, fut))
        self._wake.set()
        reward, error, secs = await fut
        detail: dict = {"fn": self.fn_name, "time_s": round(secs, 6)}
        if error is not None:
            detail["error"] = error
            self.n_errors += 1
        return reward, detail

    async def _batch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # let the other handlers of this fetch enqueue too
            while self._queue:
                await self._calls.acquire()
                batch, self._queue = self._queue[: self.batch_size], self._queue[self.batch_size :]
                task = asyncio.create_task(self._score_batch(batch))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)

    async def _call(self, items: list[tuple[str, str]], timeout_s: float) -> list[Scored]:
        self.n_calls += 1
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.pool, _score_many, self.fn_name, items)
        return await asyncio.wait_for(fut, timeout_s)

    async def _score_batch(self, batch: list[tuple[Sample, asyncio.Future]]) -> None:
        items = [(s.output_text, s.answer) for s, _ in batch]
        try:
            try:
                results = await self._call(items, self.timeout_s)
            except asyncio.TimeoutError:
                self._reset_pool()
                if len(items) == 1:
                    results = [(0.0, f"timeout after {self.timeout_s}s", self.timeout_s)]
                else:  # find the culprit: each item alone, each with the full timeout
                    results = [await self._score_alone(item) for item in items]
            except Exception:  # a broken pool (a scorer killed its process, or another batch's
                # timeout reset it): rebuild, then each item alone so only the culprit scores 0
                self._reset_pool()
                results = [await self._score_alone(item) for item in items]
        finally:
            self._calls.release()
        for (_, fut), res in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(res)

    async def _score_alone(self, item: tuple[str, str]) -> Scored:
        try:
            return (await self._call([item], self.timeout_s))[0]
        except asyncio.TimeoutError:
            self._reset_pool()
            return (0.0, f"timeout after {self.timeout_s}s", self.timeout_s)
        except Exception as e:
            self._reset_pool()
            return (0.0, f"scoring failed: {type(e).__name__}: {e}", 0.0)

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
                S.TRAJECTORIES,
                Sample,
                self.handle,
                max_inflight=max(64, 2 * self.batch_size) * self.pool_workers,
                stop=stop,
            )
        finally:
            hb.cancel()
            if self._batcher is not None:
                self._batcher.cancel()
            self.pool.shutdown(wait=False, cancel_futures=True)

    def heartbeat(self) -> dict:
        return {
            "samples": self.n_scored,
            "errors": self.n_errors,
            "pool_calls": self.n_calls,
            "busy_frac": self.meter.busy_frac(),
            "fn": self.fn_name,
        }
