"""Rewards for the synthetic tasks."""

from __future__ import annotations

import pytest

from areal.rewards.synthetic import (
    arithmetic_reward,
    cut_completion,
    running_sum_reward,
    tool_arithmetic_reward,
)


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("68", 1.0),
        (" 68 ", 1.0),
        ("68\nmore text 12", 1.0),  # text after the first newline never counts
        ("68<eos>junk", 1.0),
        ("68<eos><pad><pad>", 1.0),
        ("680", 0.0),
        ("6", 0.0),
        ("68+1", 0.0),
        ("", 0.0),
        ("\n68", 0.0),  # an empty first line is an empty answer
    ],
)
def test_arithmetic_reward(completion, reward):
    assert arithmetic_reward(completion, "68") == reward


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("3 8 9 11", 1.0),
        ("11", 1.0),  # only the final total is checked
        ("3 8 9 12", 0.0),
        ("3 8 9 11<eos>5", 1.0),
        ("3 8 9 11\n5", 1.0),
        ("3 8 9 11 ", 1.0),
        ("no numbers", 0.0),
        ("", 0.0),
    ],
)
def test_running_sum_reward(completion, reward):
    assert running_sum_reward(completion, "11") == reward


def test_running_sum_bad_answer_is_zero():
    assert running_sum_reward("3", "three") == 0.0


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("<calc>37*41+5<r>1522</r>1522", 1.0),  # a call, its result, the answer
        ("<calc>37*41+5`<r>1522</r>1522", 1.0),  # the stop token kept in the text
        ("1522", 1.0),  # no tool call: the whole completion is the answer
        ("<calc>37*41+5<r>1522</r>1522<eos>99", 1.0),  # nothing after the end counts
        ("<calc>37*41+5<r>1522</r> 1522 ", 1.0),
        ("<calc>37*41+5<r>1522</r>", 0.0),  # the result alone is no answer
        ("<calc>37*41+5<r>1522</r>1523", 0.0),
        ("<calc>37*41<r>1517</r>1522", 1.0),  # only the answer is checked
        ("<calc>1<r>1</r>x<r>1522</r>1522", 1.0),  # after the last result
        ("<calc>1<r>line one\nline two</r>1522", 1.0),  # a result may hold a newline
        ("<calc>37*41+5<r>1522</r>1522\n7", 1.0),
        ("<calc>37*41+5", 0.0),  # a call that never got its result
        ("", 0.0),
    ],
)
def test_tool_arithmetic_reward(completion, reward):
    assert tool_arithmetic_reward(completion, "1522") == reward


def test_cut_completion():
    assert cut_completion("  a b <eos>c\nd") == "a b"
