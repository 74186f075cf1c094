"""Evaluation during training: the rollout workers answer the held-out set every K versions.

A round is due when the worker's policy version reaches the next multiple of K (version 0, the
starting model, included). Exactly one replica runs a round: the one whose `kv_claim` of the
round's key succeeds. It lets its running batch of training samples finish (taking no new
requests meanwhile), generates one completion per held-out item with the eval sampling
parameters on the weights it holds (no weight switch during a round), scores them in its own
scoring process with the run's reward function and per-sample timeout, and publishes one
`eval` metric. Training goes on meanwhile on the samples already produced; the trainer appends
each round to `eval.jsonl` in the run dir. An idle worker loads fetched weights whose round is
due (the run's final version is published when nothing is left to generate), and the trainer
waits for the round on the final weights (`eval.final_wait_s`) before the run ends. `areal eval`
(`areal.launch.evaluate`) runs one round of this code on a model dir.

Invariants:
- Each round is published at most once per run (the KV claim), with the version whose weights
  produced every completion of it (`version`, >= `round`).
- A round that fails (engine or scorer error) is logged and skipped, never retried with other
  weights; a replica that dies mid-round loses that round only (the claim is not released).
- Rounds only move forward: a worker that comes back at version v skips rounds below v.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog

from areal.engines.base import GenOutput, GenRequest, InferenceEngine, SamplingParams
from areal.services.reward_pool import ScoringPool

log = structlog.get_logger()


@dataclass(frozen=True)
class EvalItem:
    prompt_ids: list[int]
    answer: str


@dataclass(frozen=True)
class EvalPlan:
    every_versions: int  # K >= 1
    items: list[EvalItem]  # the held-out set, rendered as the controller renders tasks
    params: SamplingParams
    reward_fn: str
    timeout_s: float


class Evaluator:
    """Decides when a round is due and runs it (the rollout service calls `due` and `run`)."""

    def __init__(self, plan: EvalPlan) -> None:
        if plan.every_versions < 1 or not plan.items:
            raise ValueError("an eval plan needs every_versions >= 1 and a non-empty held-out set")
        self.plan = plan
        self.next_round = 0
        self._pool: ScoringPool | None = None

    def due(self, version: int) -> int | None:
        """The round to run at `version`, or None. Rounds are multiples of K; a worker that is
        past several due rounds runs only the latest one."""
        if version < self.next_round:
            return None
        return version - version % self.plan.every_versions

    def skip(self, rnd: int) -> None:
        """Round `rnd` is done (here or by another replica): wait for the next one."""
        self.next_round = max(self.next_round, rnd + self.plan.every_versions)

    async def score(self, texts: list[str]) -> list[tuple[float, str | None]]:
        if self._pool is None:
            self._pool = ScoringPool(self.plan.reward_fn, workers=1, timeout_s=self.plan.timeout_s)
        scored = await self._pool.score(
            [(t, it.answer) for t, it in zip(texts, self.plan.items, strict=True)]
        )
        return [(reward, error) for reward, error, _ in scored]

    def generate(self, engine: InferenceEngine) -> tuple[int, list[GenOutput]]:
        """Generating thread: one completion per item on the engine's current weights."""
        version = engine.version
        reqs = [
            GenRequest(key=f"eval/{i}", prompt_ids=it.prompt_ids)
            for i, it in enumerate(self.plan.items)
        ]
        outs = engine.generate(reqs, params=self.plan.params)
        return version, outs

    def summary(
        self,
        rnd: int,
        version: int,
        outs: list[GenOutput],
        scores: list[tuple[float, str | None]],
        secs: float,
    ) -> dict[str, Any]:
        n = len(outs)
        return {
            "round": rnd,
            "version": version,
            "eval_reward": sum(r for r, _ in scores) / n,
            "n": n,
            "errors": sum(e is not None for _, e in scores),
            "gen_len_mean": sum(len(o.output_ids) for o in outs) / n,
            "truncated_frac": sum(o.finish_reason == "length" for o in outs) / n,
            "temperature": self.plan.params.temperature,
            "eval_s": round(secs, 3),
            "time": time.time(),
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
