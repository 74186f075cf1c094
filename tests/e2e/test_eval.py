"""`areal eval` against the run it evaluates: on the quickstart's final model, with the run's
own `config.json`, greedy decoding gives exactly the run's last in-run evaluation, the round the
run ends with on its final weights (`eval.final_wait_s`)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def areal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "areal.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_areal_eval_of_the_final_model_agrees_with_the_last_in_run_round(tmp_path):
    out = tmp_path / "run"
    res = areal(
        "run",
        "examples/arithmetic.yaml",
        "--out",
        str(out),
        "--quiet",
        "--set",
        f"run_id=eval-{uuid.uuid4().hex[:6]}",
        "--set",
        f"train.total_steps={STEPS}",
        "--set",
        f"eval.every_versions={STEPS}",  # rounds at version 0 and at the final version
        "--set",
        "data.eval_size=32",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rounds = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    last = rounds[-1]
    # the run ends with a round on its final weights (an idle rollout worker runs it, the
    # trainer waits for it before it finishes)
    assert [r["round"] for r in rounds] == [0, STEPS] and last["version"] == STEPS, rounds
    assert last["temperature"] == 0.0  # greedy

    report_path = tmp_path / "report.json"
    res = areal(
        "eval",
        str(out / "final"),
        "--config",
        str(out / "config.json"),
        "--n",
        "4",
        "--k",
        "1,4",
        "--out",
        str(report_path),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(report_path.read_text())
    greedy = report["greedy"]
    # the same held-out items, prompts, engine and reward: the same completions
    assert report["n_items"] == last["n"] == 32
    assert greedy["mean_reward"] == last["eval_reward"], (greedy, last)
    assert greedy["gen_len_mean"] == last["gen_len_mean"]
    assert greedy["truncated_frac"] == last["truncated_frac"]
    assert greedy["accuracy"] == last["eval_reward"]  # the arithmetic reward is 0 or 1
    # sampled pass@k at the run's temperature, from 4 samples of each item
    sampled = report["sampled"]
    assert sampled["n"] == 4 and sampled["temperature"] == 1.5
    assert 0.0 <= sampled["pass@1"] <= sampled["pass@4"] <= 1.0
    assert sampled["pass@4"] == sum(r["n_correct"] > 0 for r in report["items"]) / 32
    # the table
    assert "greedy accuracy" in res.stdout and "pass@4 (n=4, T=1.5)" in res.stdout
    assert f"{last['eval_reward']:.4f}" in res.stdout
