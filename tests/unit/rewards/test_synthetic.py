"""Rewards for the synthetic tasks."""

from __future__ import annotations

import pytest

from areal.rewards.synthetic import arithmetic_reward, cut_completion, running_sum_reward


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


def test_cut_completion():
    assert cut_completion("  a b <eos>c\nd") == "a b"
