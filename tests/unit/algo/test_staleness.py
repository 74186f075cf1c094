"""Hand-worked cases of the staleness rule (DESIGN section 4)."""

from __future__ import annotations

import pytest

from areal.algo.staleness import (
    admissible_count,
    admission_capacity,
    can_admit,
    is_fresh,
    sample_staleness,
    staleness_histogram,
)


def test_admission_capacity_hand_values() -> None:
    # (i + η + 1) * B
    assert admission_capacity(0, 0, 4) == 4  # (0 + 0 + 1) * 4: synchronous, one batch
    assert admission_capacity(0, 2, 4) == 12  # (0 + 2 + 1) * 4
    assert admission_capacity(5, 1, 8) == 56  # (5 + 1 + 1) * 8
    assert admission_capacity(3, 4, 0) == 0  # B = 0: nothing may be admitted


def test_can_admit_exactly_at_the_bound() -> None:
    # capacity (1 + 1 + 1) * 2 = 6: outstanding 5 -> 6 <= 6 ok; outstanding 6 -> 7 > 6 refused
    assert can_admit(5, version=1, max_staleness=1, batch_size=2)
    assert not can_admit(6, version=1, max_staleness=1, batch_size=2)
    assert not can_admit(7, version=1, max_staleness=1, batch_size=2)


def test_synchronous_rl_admits_one_batch_per_version() -> None:
    # η = 0, B = 3: version 0 allows 3 tasks, version 1 allows 6 in total
    assert [can_admit(k, 0, 0, 3) for k in range(5)] == [True, True, True, False, False]
    assert can_admit(5, 1, 0, 3) and not can_admit(6, 1, 0, 3)


def test_admissible_count_never_negative() -> None:
    assert admissible_count(0, 0, 1, 4) == 8  # (0 + 1 + 1) * 4 - 0
    assert admissible_count(6, 0, 1, 4) == 2  # 8 - 6
    assert admissible_count(8, 0, 1, 4) == 0
    # outstanding above capacity (e.g. a count seen before a drop was folded in): 0, not -2
    assert admissible_count(10, 0, 1, 4) == 0


def test_admissible_count_agrees_with_can_admit() -> None:
    for outstanding in range(0, 30):
        for version in range(0, 4):
            n = admissible_count(outstanding, version, 2, 3)
            assert (n > 0) == can_admit(outstanding, version, 2, 3)


def test_sample_staleness() -> None:
    assert sample_staleness(7, 7) == 0
    assert sample_staleness(7, 4) == 3  # 7 - 4
    assert sample_staleness(3, 5) == 0  # a token newer than i counts as lag 0, never -2


def test_is_fresh_exactly_at_the_bound() -> None:
    # i = 10, η = 2: oldest token version must be >= 8
    assert is_fresh(10, 8, 2)  # staleness 2 == η: kept
    assert not is_fresh(10, 7, 2)  # staleness 3 > η: dropped
    assert is_fresh(10, 10, 0)  # η = 0 keeps only the current version
    assert not is_fresh(10, 9, 0)
    assert is_fresh(0, 0, 0)


def test_staleness_histogram() -> None:
    # i = 5, versions [5, 5, 4, 2, 6] -> lags [0, 0, 1, 3, 0]
    assert staleness_histogram(5, [5, 5, 4, 2, 6]) == {0: 3, 1: 1, 3: 1}
    assert list(staleness_histogram(9, [1, 9, 5])) == [0, 4, 8]  # keys sorted by lag
    assert staleness_histogram(5, []) == {}
    assert staleness_histogram(2, iter([2, 1])) == {0: 1, 1: 1}  # any iterable


@pytest.mark.parametrize(
    ("version", "max_staleness", "batch_size"), [(0, -1, 4), (0, 1, -1), (3, -2, -2)]
)
def test_negative_arguments_rejected(version: int, max_staleness: int, batch_size: int) -> None:
    with pytest.raises(ValueError):
        admission_capacity(version, max_staleness, batch_size)
    with pytest.raises(ValueError):
        can_admit(0, version, max_staleness, batch_size)
    with pytest.raises(ValueError):
        admissible_count(0, version, max_staleness, batch_size)


def test_is_fresh_rejects_negative_staleness_bound() -> None:
    with pytest.raises(ValueError):
        is_fresh(3, 3, -1)
