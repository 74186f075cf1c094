"""Micro-batch packing: hand-worked placements and a hypothesis property test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal.algo.packing import pack_ffd, pack_ffd_shared, pack_fixed, padding_fraction


def test_ffd_hand_worked() -> None:
    # lengths by index: 0:3 1:8 2:5 3:2 4:6, budget 10; descending order 1(8) 4(6) 2(5) 0(3) 3(2)
    # 8 -> new mb0 [1];  6 -> mb0 8+6 > 10, new mb1 [4];  5 -> mb1 (6+5 > 10) no, new mb2 [2]
    # 3 -> fits mb1 (9) and mb2 (8), both hold 1 seq -> lowest index mb1 -> [4, 0]
    # 2 -> fits mb0 (10) and mb2 (7); mb0 and mb2 hold 1 seq, mb1 holds 2 -> mb0 -> [1, 3]
    assert pack_ffd([3, 8, 5, 2, 6], 10) == [[1, 3], [4, 0], [2]]


def test_ffd_prefers_fewest_sequences_over_first_fit() -> None:
    # 6, 3, 3, 1, 1 budget 10: 6 -> mb0 [0]; 3 -> mb0 (9) [0, 1]; 3 -> new mb1 [2]
    # 1 -> fits mb0 (10, 2 seqs) and mb1 (4, 1 seq): first fit would pick mb0, fewest picks mb1
    # 1 -> fits mb0 (10, 2 seqs) and mb1 (5, 2 seqs): tie -> lowest index mb0
    assert pack_ffd([6, 3, 3, 1, 1], 10) == [[0, 1, 4], [2, 3]]


def test_ffd_over_long_sequence_gets_its_own_micro_batch() -> None:
    # 15 > budget 10 -> mb0 [0], alone: never split, never dropped, and nothing joins it
    # 5 -> new mb1 [3]; 4 -> mb1 (9); 0 -> mb1 (9) rather than the over-long mb0
    assert pack_ffd([15, 4, 0, 5], 10) == [[0], [3, 1, 2]]
    assert pack_ffd([11, 12], 10) == [[1], [0]]  # two over-long ones, longest first


def test_ffd_stable_for_equal_lengths() -> None:
    # equal lengths keep input order: 0 -> mb0; 1 -> mb0 (4); 2 -> new mb1; 3 -> mb1 (4)
    assert pack_ffd([2, 2, 2, 2], 4) == [[0, 1], [2, 3]]


def test_ffd_empty_and_bad_budget() -> None:
    assert pack_ffd([], 10) == []
    with pytest.raises(ValueError):
        pack_ffd([1], 0)
    with pytest.raises(ValueError):
        pack_ffd([-1], 10)


def test_pack_fixed() -> None:
    assert pack_fixed(5, 2) == [[0, 1], [2, 3], [4]]
    assert pack_fixed(4, 4) == [[0, 1, 2, 3]]
    assert pack_fixed(0, 3) == []
    with pytest.raises(ValueError):
        pack_fixed(3, 0)


def test_padding_fraction_hand_values() -> None:
    # mb [0, 1] lengths 4, 2 -> padded 8, real 6; mb [2] length 5 -> padded 5, real 5
    # pad = (13 - 11) / 13
    assert padding_fraction([4, 2, 5], [[0, 1], [2]]) == pytest.approx(2 / 13)
    assert padding_fraction([3, 3], [[0, 1]]) == 0.0
    assert padding_fraction([], []) == 0.0
    assert padding_fraction([0, 0], [[0, 1]]) == 0.0


def test_ffd_pads_less_than_fixed_on_mixed_lengths() -> None:
    lengths = [100, 10, 90, 20, 80, 30, 70, 40]
    ffd = padding_fraction(lengths, pack_ffd(lengths, 200))
    fixed = padding_fraction(lengths, pack_fixed(len(lengths), 2))
    assert ffd < fixed


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=300), max_size=60),
    budget=st.integers(min_value=1, max_value=256),
)
def test_ffd_properties(lengths: list[int], budget: int) -> None:
    mbs = pack_ffd(lengths, budget)
    flat = sorted(i for mb in mbs for i in mb)
    assert flat == list(range(len(lengths)))  # every index exactly once
    for mb in mbs:
        assert mb  # no empty micro-batch
        total = sum(lengths[i] for i in mb)
        assert total <= budget or (len(mb) == 1 and lengths[mb[0]] > budget)
    assert 0.0 <= padding_fraction(lengths, mbs) < 1.0 or not lengths


def shared_cost(mb: list[int], keys: list[int], plens: list[int], olens: list[int]) -> int:
    """Tokens of a micro-batch whose row carries each distinct prompt once."""
    return sum(plens[i] for i in {keys[i]: i for i in mb}.values()) + sum(olens[i] for i in mb)


def test_ffd_shared_keeps_groups_together() -> None:
    # two groups of 4 (prompt 10, outputs 5) and one of 2 (prompt 30, outputs 20): 30 + 30 + 70
    keys = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    plens = [10] * 8 + [30, 30]
    olens = [5] * 8 + [20, 20]
    mbs = pack_ffd_shared(keys, plens, olens, 70)
    assert sorted(sorted(mb) for mb in mbs) == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9]]
    # a group over the budget is cut into consecutive parts, each with its prompt
    mbs = pack_ffd_shared([0] * 6, [10] * 6, [8] * 6, 40)
    assert sorted(sorted(mb) for mb in mbs) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="same length"):
        pack_ffd_shared([0, 1], [3], [1, 1], 10)


@settings(max_examples=150, deadline=None)
@given(
    groups=st.lists(
        st.tuples(st.integers(1, 40), st.lists(st.integers(0, 60), min_size=1, max_size=9)),
        max_size=12,
    ),
    budget=st.integers(min_value=1, max_value=256),
)
def test_ffd_shared_properties(groups: list[tuple[int, list[int]]], budget: int) -> None:
    keys, plens, olens = [], [], []
    for k, (p, outs) in enumerate(groups):
        for t in outs:
            keys.append(k)
            plens.append(p)
            olens.append(t)
    mbs = pack_ffd_shared(keys, plens, olens, budget)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(keys)))  # each index once
    for mb in mbs:
        assert mb
        # within budget, unless one prompt + one output alone exceeds it
        assert shared_cost(mb, keys, plens, olens) <= budget or (
            len(mb) == 1 and plens[mb[0]] + olens[mb[0]] > budget
        )
    # a group that fits the budget as a whole is never split
    for k, (p, outs) in enumerate(groups):
        if p + sum(outs) <= budget:
            assert sum(any(keys[i] == k for i in mb) for mb in mbs) == 1
