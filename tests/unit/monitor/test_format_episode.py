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


def test_areal_top_shows_the_episodes_of_the_last_batch():
    from areal.monitor.top import episode_line

    assert episode_line({"turns_mean": 1.0, "masked_token_frac": 0.0}) is None  # single-turn
    line = episode_line(
        {
            "turns_mean": 1.9,
            "tool_calls_mean": 0.95,
            "tool_call_frac": 0.97,
            "tool_ok_frac": 0.93,
            "tool_error_frac": 0.02,
            "tool_s_mean": 0.004,
            "masked_token_frac": 0.21,
        }
    )
    assert line == (
        "episodes: 1.90 turns, 0.95 tool calls, called 97%, ok 93%, errors 2%, tool 0.00 s, "
        "env tokens 21%"
    )
