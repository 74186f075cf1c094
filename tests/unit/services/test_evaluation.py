"""Evaluation rounds: when they are due, how a round is summarised, and eval.jsonl."""

from __future__ import annotations

import json

import pytest

from areal.engines.base import GenOutput, SamplingParams
from areal.services.evaluation import EvalItem, EvalPlan, Evaluator
from areal.services.run_files import EvalLog


def _plan(k=3, n=2):
    items = [EvalItem([1, 2], str(i)) for i in range(n)]
    return EvalPlan(k, items, SamplingParams(temperature=0.0), "arithmetic", 5.0)


def test_rounds_are_multiples_of_k_starting_at_version_0():
    ev = Evaluator(_plan(k=3))
    assert ev.due(0) == 0
    ev.skip(0)
    assert [ev.due(v) for v in (1, 2)] == [None, None]
    assert ev.due(3) == 3 and ev.due(4) == 3
    ev.skip(3)
    assert ev.due(5) is None
    assert ev.due(11) == 9  # several rounds behind: only the latest one runs
    ev.skip(9)
    assert ev.due(11) is None and ev.due(12) == 12


def test_plan_must_have_items_and_k():
    with pytest.raises(ValueError, match="non-empty held-out set"):
        Evaluator(EvalPlan(2, [], SamplingParams(), "math", 1.0))
    with pytest.raises(ValueError):
        Evaluator(_plan(k=0))


def test_summary_counts_rewards_errors_lengths_and_truncation():
    ev = Evaluator(_plan(n=2))
    outs = [
        GenOutput("eval/0", [5, 6, 2], [0.0] * 3, [3] * 3, "stop"),
        GenOutput("eval/1", [5] * 5, [0.0] * 5, [3] * 5, "length"),
    ]
    s = ev.summary(3, 4, outs, [(1.0, None), (0.0, "timeout after 5s")], 1.23456)
    assert s["round"] == 3 and s["version"] == 4 and s["n"] == 2
    assert s["eval_reward"] == 0.5 and s["errors"] == 1
    assert s["gen_len_mean"] == 4.0 and s["truncated_frac"] == 0.5 and s["eval_s"] == 1.235


def test_eval_log_keeps_each_round_once_across_restarts(tmp_path):
    path = tmp_path / "eval.jsonl"
    log = EvalLog(path)
    assert log.add({"round": 0, "version": 0, "eval_reward": 0.2})
    assert not log.add({"round": 0, "version": 0, "eval_reward": 0.2})  # a replayed record
    with open(path, "a") as f:
        f.write('{"round": 3, "vers')  # torn line from a crash
    again = EvalLog(path)
    assert again.rounds == {0}
    assert again.add({"round": 3, "version": 3, "eval_reward": 0.4})
    rounds = [json.loads(ln)["round"] for ln in path.read_text().splitlines()]
    assert rounds == [0, 3]
