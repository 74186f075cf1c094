"""Math answer extraction and number comparison."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal.rewards.math import extract_answer, math_reward, numbers_equal, parse_number


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so x = 3 and \\boxed{42}. Also 7", "42"),
        ("\\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),  # last box, nested braces
        ("Natalia sold 48 clips...\n#### 72", "72"),
        ("#### 1,234 dollars", "1,234"),
        ("The answer is 17.", "17"),
        ("Answer: -2.5\nthanks 9", "-2.5"),
        ("answer: x+1", "x+1"),  # not a number: kept as text
        ("3 apples plus 4 pears makes 7 fruits", "7"),
        ("ratio 3/4", "3/4"),
        ("no numbers at all", None),
        ("", None),
        ("\\boxed{unclosed 5", "5"),  # unbalanced box falls through to the last number
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        ("42", "42.0", True),
        ("1,234", "1234", True),
        ("0.75", "3/4", True),
        ("\\frac{3}{4}", "0.75", True),
        ("$5$", "5", True),
        ("-2", "- 2", True),
        ("1/3", "0.333", False),
        ("7", "8", False),
        ("x+1", "x + 1", True),  # text fallback after normalisation
        ("", "", False),
        ("1/0", "1/0", True),  # not a number, same text
    ],
)
def test_numbers_equal(a, b, equal):
    assert numbers_equal(a, b) is equal


def test_parse_number():
    assert parse_number("12") == 12
    assert parse_number("abc") is None
    assert parse_number("1/0") is None


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("... so the total is \\boxed{72}", "72", 1.0),
        ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # GSM8K-style reference
        ("The answer is 71", "72", 0.0),
        ("I don't know", "72", 0.0),
        ("\\boxed{0.5}", "1/2", 1.0),
    ],
)
def test_math_reward(completion, answer, reward):
    assert math_reward(completion, answer) == reward


@given(st.text(max_size=200), st.text(max_size=20))
def test_never_raises(completion, answer):
    assert math_reward(completion, answer) in (0.0, 1.0)


@given(st.integers(-(10**9), 10**9))
def test_integers_round_trip(n):
    assert math_reward(f"so \\boxed{{{n:,}}}", str(n)) == 1.0
