"""Rewards see the episode: a reward function that takes `episode=` gets the prompt, the turns
as text, the tool calls and the task's metadata (plain data, through the scoring process); one
that takes `(completion, answer)` is called as before; overlong shaping judges the last turn."""

from __future__ import annotations

from areal.bus.codec import pack
from areal.rewards.registry import get_reward_fn
from areal.rewards.scoring import score_items, takes_episode
from areal.services.reward import episode_of, last_turn_tokens
from schemas.messages import ToolCallInfo, TurnText
from tests.factories import make_sample

SCORER = "tests.unit.services.scorers:tool_use_reward"


def episode_sample(error: str | None = None):
    turns = [
        TurnText(role="model", text="<calc>37*41", n_tokens=3),
        TurnText(role="env", text="<r>1517</r>", n_tokens=2),
        TurnText(role="model", text="1517", n_tokens=4),
    ]
    call = ToolCallInfo(name="calc", arguments="37*41", output="1517", error=error)
    return make_sample().model_copy(
        update={
            "output_ids": pack(list(range(9)), "int32"),
            "behav_logp": pack([-0.1] * 3 + [0.0] * 2 + [-0.1] * 4, "float32"),
            "versions": pack([0] * 3 + [-1] * 2 + [0] * 4, "int32"),
            "loss_mask": pack([1, 1, 1, 0, 0, 1, 1, 1, 1], "uint8"),
            "turns": turns,
            "tool_calls": [call],
            "prompt": "37*41=",
            "answer": "1517",
            "n_turns": 2,
            "n_tool_calls": 1,
        }
    )


def test_a_reward_that_takes_the_episode_sees_it():
    assert takes_episode(get_reward_fn(SCORER)) and not takes_episode(get_reward_fn("arithmetic"))
    good, failed = episode_sample(), episode_sample(error="timeout")
    ep = episode_of(good)
    assert ep["prompt"] == "37*41=" and [t["role"] for t in ep["turns"]] == [
        "model",
        "env",
        "model",
    ]
    assert ep["tool_calls"][0]["name"] == "calc" and ep["n_turns"] == 2
    items = [(s.output_text, s.answer, episode_of(s)) for s in (good, failed)]
    assert [r for r, _, _ in score_items(SCORER, items, 10.0)] == [1.0, 0.0]


def test_a_two_argument_reward_ignores_the_episode_and_single_turn_is_one_model_turn():
    s = make_sample()
    ((reward, error, _),) = score_items(
        "arithmetic", [(s.output_text, s.answer, episode_of(s))], 10.0
    )
    assert error is None
    ep = episode_of(s)
    assert ep["turns"] == [{"role": "model", "text": s.output_text, "n_tokens": len(s.output_ids)}]


def test_overlong_shaping_judges_the_last_model_turn():
    assert last_turn_tokens(episode_sample()) == 4
    s = make_sample()
    assert last_turn_tokens(s) == len(s.output_ids)
