"""DAPO's soft overlong punishment."""

from __future__ import annotations

import pytest

from areal.algo.overlong import overlong_penalty


def pen(n, reason="stop", L=100, C=20, p=1.0):
    return overlong_penalty(n, reason, max_new_tokens=L, buffer=C, penalty=p)


def test_zero_before_the_buffer_then_a_linear_ramp():
    assert pen(10) == 0.0 and pen(80) == 0.0
    assert pen(90) == pytest.approx(-0.5)
    assert pen(100) == pytest.approx(-1.0)


def test_cut_samples_get_the_whole_penalty_whatever_the_buffer():
    assert pen(100, "length") == -1.0
    assert pen(100, "length", C=0, p=0.5) == -0.5
    assert pen(99, "stop", C=0) == 0.0  # buffer 0: only cut samples are penalised


def test_never_positive_never_below_minus_penalty():
    for n in range(0, 130, 7):
        for reason in ("stop", "length"):
            assert -2.0 <= pen(n, reason, C=300, p=2.0) <= 0.0
