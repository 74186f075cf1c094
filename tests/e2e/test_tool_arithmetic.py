"""The agentic example end to end: `areal run examples/tool_arithmetic.yaml`, the built-in tiny
model learning to call the `calc` tool (two-turn episodes, tool results never trained).

What it must show: the run keeps exact accounting (every step trained B tasks of G episodes,
nothing in flight or dead-lettered), its step records carry the episode statistics, and both
the reward and the share of episodes whose tool call ran rise.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_run import ROOT, areal, check_invariants, records

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
EXAMPLE = ROOT / "examples" / "tool_arithmetic.yaml"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@pytest.mark.slow  # ~1.5-2 minutes on a 2-core CPU, plus ~75 s the first time (warm start)
def test_the_tiny_model_learns_to_use_the_calc_tool(tmp_path):
    out = tmp_path / "run"
    res = areal("run", str(EXAMPLE), "--out", str(out), "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    B, G = cfg["algo"]["batch_size"], cfg["algo"]["group_size"]
    summary = check_invariants(out, eta=cfg["algo"]["max_staleness"], B=B)
    recs = records(out)
    assert summary["steps"] == cfg["train"]["total_steps"]
    for r in recs:
        assert r["samples"] == B * G and len(r["task_seqs"]) == B, r
        assert 1.0 <= r["turns_mean"] <= cfg["rollout"]["max_turns"], r
        assert 0.0 <= r["tool_ok_frac"] <= r["tool_call_frac"] <= 1.0, r
        assert r["masked_token_frac"] > 0.0, r  # some episode got a tool result in every step
    ok = [r["tool_ok_frac"] for r in recs]
    assert _mean(ok[-5:]) > _mean(ok[:5]) + 0.2, ok
    assert summary["reward_last5"] > summary["reward_first5"] + 0.3, summary
