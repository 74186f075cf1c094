"""`bench/agentic.py` and `bench/episode_staleness.py`: the pieces that turn a run's data into
the report (no run here): the latency settings are valid run settings, episodes are joined
with their group's outcome and lag, drop rates are bucketed, and the held-out eval batches the
turns of many episodes into one engine call."""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path[:0] = [str(BENCH)]

import agentic as A  # noqa: E402
from episode_staleness import group_buckets  # noqa: E402

from areal.engines.base import GenOutput  # noqa: E402
from areal.workflows.api import Episode, Segment  # noqa: E402


@pytest.mark.parametrize("name", list(A.LATENCIES))
def test_latency_settings_are_run_settings(name: str) -> None:
    from areal.config import load_settings
    from areal.tools.runner import SimulatedLatency

    s = load_settings(A.CONFIG, [*A.COMMON, *A.latency_override(name, 3)])
    kw = s.rollout.workflow_kwargs
    assert kw["max_concurrent_calls"] == 1024 and kw["tools"] == ["calc"]
    if A.LATENCIES[name] is None:
        assert "latency" not in kw
        return
    lat = SimulatedLatency.model_validate(kw["latency"])
    assert lat.seed == 3
    if lat.kind == "lognormal":  # heavy: the same mean as fixed (1 s)
        assert math.exp(math.log(lat.seconds) + lat.sigma**2 / 2) == pytest.approx(1.0, abs=0.01)


def ep(task: str, seq: int, idx: int, **kw) -> dict:
    base = {"task_id": task, "task_seq": seq, "sample_idx": idx, "n_turns": 2, "tool_s": 1.5}
    base |= {"gen_s": 1.8, "tokens": 30, "vmin": 3, "vmax": 4}
    return base | kw


def test_episode_table_joins_outcomes_and_lags() -> None:
    watch = SimpleNamespace(
        episodes={
            ("a", 0): ep("a", 0, 0),
            ("a", 1): ep("a", 0, 1, vmin=5, vmax=5, n_turns=1, tool_s=0.0),
            ("b", 0): ep("b", 1, 0, vmin=1),
            ("c", 0): ep("c", 2, 0),  # still in flight when the run stopped: left out
        },
        retired={"b": {"type": "task_dropped_stale", "task_id": "b", "version": 4}},
    )
    res = SimpleNamespace(records=[{"step": 1, "trained_on_version": 6, "task_seqs": [0]}])
    rows = {(r["task_id"], r["sample_idx"]): r for r in A.episode_table(watch, res)}
    assert set(rows) == {("a", 0), ("a", 1), ("b", 0)}
    assert rows[("a", 0)]["outcome"] == "trained" and rows[("a", 0)]["lag"] == 3
    assert rows[("a", 1)]["lag"] == 1
    assert rows[("b", 0)]["outcome"] == "dropped_stale" and rows[("b", 0)]["lag"] == 3


def test_drop_buckets_rates_and_order() -> None:
    eps = [
        ep("a", 0, 0, tool_s=0.0, n_turns=1, outcome="trained", lag=0),
        ep("a", 0, 1, tool_s=0.2, outcome="trained", lag=1),
        ep("b", 1, 0, tool_s=7.0, gen_s=8.0, outcome="dropped_stale", lag=2),
        ep("b", 1, 1, tool_s=12.0, gen_s=13.0, outcome="dropped_stale", lag=3),
    ]
    b = A.drop_buckets(eps)
    assert [(r["bucket"], r["episodes"], r["dropped"]) for r in b["turns"]] == [
        ("1", 1, 0),
        ("2", 3, 2),
    ]
    lat = b["tool latency s"]
    assert [r["bucket"] for r in lat] == ["0", "(0, 0.5)", "[5, 10)", ">= 10"]
    assert [r["drop_rate"] for r in lat] == [0.0, 0.0, 1.0, 1.0]
    assert lat[-1]["lag_mean"] == 3 and lat[-1]["lag_max"] == 3
    md = A.drops_md({"x": b, "y": A.drop_buckets(eps[:2])}, ["tool latency s"])
    assert "| 0 | 0/1 (0.000), 0.00/0 | 0/1 (0.000), 0.00/0 |" in md
    assert "| >= 10 | 1/1 (1.000), 3.00/3 |  |" in md
    groups = group_buckets(eps)
    assert [(g["bucket"], g["groups"], g["dropped"]) for g in groups] == [
        ("[1, 2)", 1, 0),
        ("[10, 20)", 1, 1),
    ]


class TwoTurns:
    """Generates, waits on a 'tool', generates again: the eval must batch both turns."""

    async def arun_episode(self, gen, task, sample_idx):
        first = await gen.generate(task.prompt_ids, max_new_tokens=2)
        await asyncio.sleep(0.001)
        second = await gen.generate(task.prompt_ids + first.output_ids + [9])
        segs = [Segment.model(first, "a"), Segment.env([9], "r"), Segment.model(second, "b")]
        return Episode(segments=segs, finish_reason="stop", n_turns=2)


class CountingEngine:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def generate(self, reqs, *, params):
        self.calls.append(len(reqs))
        return [GenOutput(r.key, [7], [0.0], [0], "stop") for r in reqs]


def test_eval_batches_the_turns_of_all_episodes() -> None:
    engine = CountingEngine()
    parts = SimpleNamespace(workflow=TwoTurns(), engine=engine, params=None)
    tasks = [SimpleNamespace(prompt_ids=[1, 2, i]) for i in range(20)]
    episodes = asyncio.run(A._run_eval(parts, tasks))
    assert len(episodes) == 20 and all(e.n_turns == 2 for e in episodes)
    assert sum(engine.calls) == 40 and len(engine.calls) <= 4  # batched, not one call a turn


def test_a_recorded_run_comes_back_for_a_resumed_report() -> None:
    from _rl import RunResult

    cmd = ["python", "-m", "areal.cli", "run", "x.yaml", "--set", "a={b: 1}"]
    records = [
        {"step": i + 1, "wall_s": 2.0 * (i + 1), "samples": 128, "reward_mean": 0.1 * i}
        for i in range(12)
    ]
    res = RunResult("sync", Path("/tmp/x"), cmd, 0, 40.0, records=records)
    res.summary = {"dropped_stale": 0, "admitted": 192}
    mode = A.modes_for_bench()[0]
    run = A.Run("fixed", 1, mode, res, [ep("a", 0, 0, outcome="trained", lag=0)], None, 1536)
    run.eval_t1, run.eval_greedy = 0.5, 0.9
    d = {**A.run_json(run, 0.3), "episodes": run.episodes}
    back = A.run_from_json(d, mode)
    assert A.run_json(back, 0.3) == A.run_json(run, 0.3)
    assert back.episodes == run.episodes and back.res.samples == 12 * 128
