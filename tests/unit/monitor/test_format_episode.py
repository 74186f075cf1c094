"""`areal tap` shows an episode turn by turn: the model's text apart from the tool's, each tool
turn with its call, latency and error; the version range ignores environment tokens."""

from __future__ import annotations

from areal.monitor.format import json_line, one_line, to_record
from tests.unit.services.test_reward_episode import episode_sample


def test_an_episode_reads_turn_by_turn():
    line = one_line(to_record(episode_sample(error="timeout")))
    head, model1, tool, model2 = line.split("\n")
    assert "turns=2 tool_calls=1 tool_errors=1" in head and "v0..0" in head  # -1 is no version
    assert model1.split()[0] == "model" and '"<calc>37*41"' in model1
    assert tool.split()[0] == "tool" and '"<r>1517</r>"' in tool
    assert 'calc("37*41")' in tool and 'error="timeout"' in tool
    assert model2.split()[0] == "model" and '"1517"' in model2


def test_json_lines_carry_the_turns_and_calls_as_plain_data():
    import json

    rec = json.loads(json_line(to_record(episode_sample())))
    assert [t["role"] for t in rec["turns"]] == ["model", "env", "model"]
    assert rec["tool_calls"][0]["output"] == "1517"
