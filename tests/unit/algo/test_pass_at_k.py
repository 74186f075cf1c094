"""pass@k (`areal.algo.pass_at_k`): the unbiased estimator 1 - C(n-c, k) / C(n, k), checked
against hand-worked values and against counting k-subsets one by one."""

from __future__ import annotations

from itertools import combinations

import pytest

from areal.algo.pass_at_k import mean_pass_at_k, pass_at_k


def test_hand_worked_values():
    # n=4, c=1, k=1: 1 - C(3,1)/C(4,1) = 1 - 3/4 = 0.25 (= c/n)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # n=8, c=2, k=4: 1 - C(6,4)/C(8,4) = 1 - 15/70 = 11/14
    assert pass_at_k(8, 2, 4) == pytest.approx(11 / 14)
    # n=10, c=3, k=1: 3/10
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


def test_edges():
    assert pass_at_k(8, 0, 4) == 0.0  # nothing correct
    assert pass_at_k(8, 8, 1) == 1.0  # everything correct
    assert pass_at_k(8, 5, 4) == 1.0  # n - c = 3 < k = 4: every 4-subset holds a correct one
    assert pass_at_k(4, 1, 4) == 1.0  # k = n: any correct sample passes
    assert pass_at_k(1, 0, 1) == 0.0 and pass_at_k(1, 1, 1) == 1.0
    for bad in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


@pytest.mark.parametrize("n", [1, 3, 6])
def test_matches_counting_subsets(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(combinations(samples, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expected)
        # never decreases in k
        values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert values == sorted(values)


def test_large_n_is_exact_enough():
    # n=200, c=1, k=100: 1 - C(199,100)/C(200,100) = 1 - 100/200 = 0.5
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5, abs=1e-12)


def test_mean_over_problems():
    # problem 1: c=0 -> 0; problem 2: n=4, c=1, k=2 -> 0.5; problem 3: c=4 -> 1; mean 0.5
    assert mean_pass_at_k(4, [0, 1, 4], 2) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mean_pass_at_k(4, [], 1)
