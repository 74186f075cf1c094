"""`bench/algorithms.py`: the pieces that turn runs into the report (no run here): every planned
run is valid run settings, time to target and the per-task target read the rolling mean as
documented, and a cell shows the mean over seeds with each seed's value."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path[:0] = [str(BENCH)]

import algorithms as A  # noqa: E402


def outcome(spec: A.Spec, rewards: list[float], ok: bool = True) -> A.Outcome:
    return A.Outcome(
        key=spec.key,
        spec=spec.__dict__,
        ok=ok,
        rc=0 if ok else 1,
        cmd="areal run ...",
        code="git x, clean",
        load_before=1.0,
        load_after=1.0,
        wall_s=float(len(rewards)),
        rewards=rewards,
        wall_at_step=[float(i + 1) for i in range(len(rewards))],  # step k ends at k s
        eval_reward=0.5,
    )


def test_the_plan_is_whole_seeds_of_valid_run_settings() -> None:
    from areal.config import load_settings

    specs = A.plan(["grid", "staleness"], [0, 1])
    per_seed = 2 * len(A.LOSSES) * len(A.ADVANTAGES) + len(A.LOSSES) * len(A.ETAS)
    assert len(specs) == 2 * per_seed and len({s.key for s in specs}) == len(specs)
    assert {s.seed for s in specs[:per_seed]} == {0}  # seeds outermost
    for s in specs[:per_seed]:
        settings = load_settings(A.TASKS[s.task][0], s.overrides(7))
        assert (settings.algo.loss, settings.algo.advantage) == (s.loss, s.advantage)
        assert settings.train.total_steps == 7
        if s.eta == 0:
            assert settings.algo.max_staleness == 0 and not settings.rollout.interruptible


def test_time_to_target_is_the_first_full_window_reaching_it() -> None:
    spec = A.Spec("grid", "quickstart", "ppo", "grpo", None, 0)
    # 10 steps at 0.0, then 1.0: the 10-step mean reaches 0.5 at step 15 (5 ones, 5 zeros)
    o = outcome(spec, [0.0] * 10 + [1.0] * 10)
    assert o.time_to(0.5) == 15.0
    assert o.time_to(1.01) is None
    # a window that is not full yet never counts: 0.9 at step 1 is not a 10-step mean
    assert outcome(spec, [0.9] + [0.0] * 12).time_to(0.5) is None
    assert o.final() == 1.0


def test_the_target_is_a_fraction_of_the_default_recipes_final_reward() -> None:
    runs = {
        s.key: outcome(s, r)
        for s, r in [
            (A.Spec("grid", "quickstart", "ppo", "grpo", None, 0), [0.6] * 10),
            (A.Spec("grid", "quickstart", "ppo", "grpo", None, 1), [0.8] * 10),
            (A.Spec("grid", "quickstart", "gspo", "grpo", None, 0), [0.1] * 10),  # not the default
            (A.Spec("staleness", "quickstart", "ppo", "grpo", 4, 0), [0.1] * 10),  # nor this
        ]
    }
    got = A.targets(runs)
    assert got == {"quickstart": pytest.approx(A.TARGET_FRAC * 0.7)}  # no running_sum run


def test_a_cell_is_the_mean_over_seeds_with_each_seed() -> None:
    assert A._cell([1.0, 3.0], ".1f") == "2.0 (1.0/3.0)"
    assert A._cell([1.0, None], ".1f") == "1.0 [1 of 2] (1.0/-)"
    assert A._cell([None, math.nan], ".1f") == "- (-/-)"
    assert A._cell([0.25], ".2f") == "0.25" and A._cell([None], ".2f") == "-"
