"""Reward: scores groups in a process pool, each sample within its own timeout; publishes them
scored, one message per group as they came.

Samples that arrive together (a group's G, and other groups'), are scored in one pool call (up to `batch_size`; at most
`pool_workers` calls in flight): per-call IPC, pickling and thread hand-offs cost far more than
a string-matching scorer, so one call per sample made the reward worker one of the busiest
processes of a CPU run.

Invariants:
- A group is acknowledged only after its scored group is published (same msg id, so a
  redelivery after a crash is de-duplicated by the server).
- `timeout_s` is per sample, wherever the sample sits in its batch: a scorer that raises or runs
  past `timeout_s` gives reward 0 with the error in `verifier["error"]`, and the other samples of
  its batch keep their own rewards, scored in the same call (`areal/rewards/scoring.py`).
- With overlong shaping (`rollout.overlong: penalty`) the published reward is the score plus
  DAPO's overlong term (`areal/algo/overlong.py`), both kept in `verifier` (`score`,
  `overlong_penalty`), so the score itself is never lost.
- A scorer that hangs beyond the alarm's reach, or kills its process, costs a pool reset
  (`pool_resets` in the heartbeat) and a one-by-one re-score of its batch
  (`areal/services/reward_pool.py`); the sample is never lost.
- A group is checked against the run before it is scored (`areal.core.validate.check_group`):
  one that does not fit is dead-lettered with the reason, and a rejection marker for its task
  goes on to the trainer (which retires the task), so one bad message costs only its own task. A rollout's
  marker is passed through unscored. A score that is not finite or outside the scorer's declared
  range counts as a scorer error (reward 0, `verifier["error"]`).
- Each replica counts what it did (`stats()`: groups and samples scored, errors, rejected groups,
  markers passed on) and logs it as `reward_worker_stats` every `stats_log_s` while the count
  moves and once more at exit as `reward_stopped`, so `docker compose logs reward` shows each
  replica's share; the same counts are in its heartbeat.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import structlog

from areal.algo.overlong import overlong_penalty
from areal.bus.client import Bus, Lease
from areal.bus.codec import unpack
from areal.core.validate import Bounds, Verdict, check_group, check_marker
from areal.rewards.registry import get_reward_fn
from areal.rewards.scoring import Item, Scored, takes_episode
from areal.services.common import BusyMeter, heartbeat_loop, stats_log_loop
from areal.services.reward_pool import ScoringPool
from areal.services.samples import publish_group, rejection_marker
from schemas import Sample, SampleGroup, ScoredGroup, ScoredSample
from schemas import subjects as S

log = structlog.get_logger()


def _scored_group(scored: list[ScoredSample]) -> ScoredGroup:
    return ScoredGroup(scored=scored)


def last_turn_tokens(sample: Sample) -> int:
    """Tokens of the sample's last model turn (the whole output when no token is masked):
    overlong shaping judges a turn against `max_new_tokens`, not an episode's tool output."""
    if sample.loss_mask is None:
        return len(sample.output_ids)
    mask = unpack(sample.loss_mask).tolist()
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    return end - start


@dataclass(frozen=True)
class OverlongShaping:
    """DAPO's soft overlong punishment for completions near or at `max_new_tokens`."""

    max_new_tokens: int
    buffer: int
    penalty: float

    def __call__(self, sample: Sample) -> float:
        n = last_turn_tokens(sample)
        return overlong_penalty(
            n,
            sample.finish_reason,
            max_new_tokens=self.max_new_tokens,
            buffer=self.buffer,
            penalty=self.penalty,
        )


def episode_of(s: Sample) -> dict:
    """The episode a reward function taking `episode=` sees: plain data (it crosses into the
    scoring process): the prompt, the segments as text, the tool calls, the task's metadata."""
    turns = [t.model_dump() for t in s.turns] or [
        {"role": "model", "text": s.output_text, "n_tokens": len(s.output_ids)}
    ]
    return {
        "prompt": s.prompt,
        "turns": turns,
        "tool_calls": [c.model_dump() for c in s.tool_calls],
        "metadata": dict(s.metadata),
        "finish_reason": s.finish_reason,
        "n_turns": s.n_turns,
    }


class RewardService:
    def __init__(
        self,
        bus: Bus,
        fn_name: str,
        *,
        timeout_s: float,
        pool_workers: int,
        batch_size: int = 32,
        overlong: OverlongShaping | None = None,
        bounds: Bounds | None = None,
        score_range: tuple[float, float] = (-math.inf, math.inf),
        stats_log_s: float = 30.0,
    ) -> None:
        # fail fast on a bad spec, in this process; and does it take the episode?
        self._takes_episode = takes_episode(get_reward_fn(fn_name))
        self.bus, self.fn_name, self.timeout_s = bus, fn_name, timeout_s
        self.pool_workers, self.batch_size = pool_workers, batch_size
        self.overlong = overlong
        self.bounds = bounds or Bounds(run_id=bus.names.run_id)
        self.score_range = score_range
        self._latest: int | None = None  # newest published policy version, as last read
        self.n_rejected = 0  # groups dead-lettered for not fitting the run
        self.pool = ScoringPool(fn_name, workers=pool_workers, timeout_s=timeout_s)
        self.n_scored = 0  # scored samples published and acked
        self.n_groups = 0  # scored groups published and acked
        self.n_markers = 0  # rollouts' rejection markers passed on unscored
        self.stats_log_s = stats_log_s
        self.n_errors = 0  # samples whose scorer raised or timed out (reward 0)
        self.meter = BusyMeter()
        self._queue: list[tuple[Sample, asyncio.Future[Scored]]] = []
        self._wake = asyncio.Event()
        self._calls = asyncio.Semaphore(pool_workers)
        self._batcher: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()

    async def score(self, sample: Sample) -> tuple[float, dict]:
        """Score one sample (batched with whatever else is waiting); never raises for a scorer
        error or timeout: those give reward 0 and `detail["error"]`."""
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.create_task(self._batch_loop())
        fut: asyncio.Future[Scored] = asyncio.get_running_loop().create_future()
        self._queue.append((sample, fut))
        self._wake.set()
        reward, error, secs = await fut
        lo, hi = self.score_range
        if error is None and not (math.isfinite(reward) and lo <= reward <= hi):
            error = f"scorer returned {reward!r}, outside its declared range [{lo:g}, {hi:g}]"
            reward = 0.0
        detail: dict = {"fn": self.fn_name, "time_s": round(secs, 6)}
        if error is not None:
            detail["error"] = error
            self.n_errors += 1
        return reward, detail

    def _item(self, s: Sample) -> Item:
        """What the scorer gets: (completion, answer), and the episode when it takes one."""
        if not self._takes_episode:
            return (s.output_text, s.answer)
        return (s.output_text, s.answer, episode_of(s))

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

    async def _score_batch(self, batch: list[tuple[Sample, asyncio.Future[Scored]]]) -> None:
        try:
            results = await self.pool.score([self._item(s) for s, _ in batch])
        except Exception as e:  # not a scorer's failure (e.g. the pool is closed): the handlers
            for _, fut in batch:  # waiting on this batch raise it, nothing is acked
                if not fut.done():
                    fut.set_exception(e)
            return
        finally:
            self._calls.release()
        for (_, fut), res in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(res)

    async def _check(self, group: SampleGroup) -> Verdict | None:
        if self._latest is None:
            self._latest = await self._latest_version()
        verdict = check_group(group, self.bounds, latest_version=self._latest)
        if verdict is not None and verdict.stale_view:  # a newer version may be out: look again
            self._latest = await self._latest_version()
            verdict = check_group(group, self.bounds, latest_version=self._latest)
        return verdict

    async def _latest_version(self) -> int:
        ann = await self.bus.latest_weights()
        return ann.version if ann is not None else 0

    async def _forward_marker(self, sample: Sample, lease: Lease) -> None:
        verdict = check_marker(sample, self.bounds)
        if verdict is not None:
            await lease.dead_letter(verdict.reason)
            return
        scored = ScoredSample(sample=sample, reward=0.0, reward_worker_id=self.bus.worker_id)
        await self.bus.publish(S.REWARDS, ScoredGroup(scored=[scored]))
        await lease.ack()
        self.n_markers += 1

    async def _refuse(self, sample: Sample, lease: Lease, reason: str) -> None:
        """Dead-letter a group (`sample`: its first); if it names a task of this run, tell the
        trainer (marker)."""
        self.n_rejected += 1
        g = self.bounds.group_size or sample.group_size
        if sample.task_id == self.bounds.task_id(sample.task_seq):
            marker = rejection_marker(
                sample.task_id, sample.task_seq, g, reason, worker_id=self.bus.worker_id
            )
            scored = ScoredSample(sample=marker, reward=0.0, reward_worker_id=self.bus.worker_id)
            await self.bus.publish(S.REWARDS, ScoredGroup(scored=[scored]))
        await lease.dead_letter(reason)

    async def handle(self, group: SampleGroup, lease: Lease) -> None:
        first = group.first
        if first.rejected and len(group.samples) == 1:
            await self._forward_marker(first, lease)
            return
        verdict = await self._check(group)
        if verdict is not None:
            await self._refuse(first, lease, verdict.reason)
            return
        self.meter.start()
        try:
            results = await asyncio.gather(*(self.score(s) for s in group.samples))
        finally:
            self.meter.stop()
        scored = [self._scored(s, r, d) for s, (r, d) in zip(group.samples, results, strict=True)]
        await publish_group(self.bus, S.REWARDS, scored, _scored_group)
        await lease.ack()
        self.n_scored += len(scored)
        self.n_groups += 1

    def _scored(self, sample: Sample, reward: float, detail: dict) -> ScoredSample:
        if self.overlong is not None:
            term = self.overlong(sample)
            detail |= {"score": reward, "overlong_penalty": term}
            reward += term
        return ScoredSample(
            sample=sample, reward=reward, verifier=detail, reward_worker_id=self.bus.worker_id
        )

    async def run(self, stop: asyncio.Event) -> None:
        log.info("reward_started", fn=self.fn_name, timeout_s=self.timeout_s)
        hb = asyncio.create_task(heartbeat_loop(self.bus, self.heartbeat, stop))
        report = asyncio.create_task(
            stats_log_loop("reward_worker_stats", self._logged_stats, stop, self.stats_log_s)
        )
        try:
            await self.bus.consume(
                S.TRAJECTORIES,
                SampleGroup,
                self.handle,
                # groups: up to a few pool calls' worth of samples waiting per scoring process
                max_inflight=max(16, self.batch_size // 2) * self.pool_workers,
                stop=stop,
                refuse=lambda group, lease, reason: self._refuse(group.first, lease, reason),
            )
        finally:
            hb.cancel()
            report.cancel()
            self.close()
            log.info("reward_stopped", **self._logged_stats())  # this replica's share of the run

    def close(self) -> None:
        """Stop batching and kill the scoring processes; idempotent."""
        if self._batcher is not None:
            self._batcher.cancel()
        self.pool.close()

    def stats(self) -> dict:
        """What this replica did so far (counts since it started; the heartbeat has them too)."""
        return {
            "groups": self.n_groups,
            "samples": self.n_scored,
            "errors": self.n_errors,
            "rejected": self.n_rejected,
            "markers": self.n_markers,
        }

    def _logged_stats(self) -> dict:
        # the worker id is bound to every log line of a worker process; named here as well,
        # so the line says whose counts these are wherever it is read
        return {"worker_id": self.bus.worker_id, **self.stats()}

    def heartbeat(self) -> dict:
        return {
            **self.stats(),
            "pool_calls": self.pool.n_calls,  # samples / pool_calls = the batching achieved
            "pool_resets": self.pool.n_resets,  # hangs past the backstop, dead scoring processes
            "busy_frac": self.meter.busy_frac(),
            "fn": self.fn_name,
        }
