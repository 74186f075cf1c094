"""Dr. GRPO, RLOO and REINFORCE++ advantages with hand-worked numbers and edge cases."""

from __future__ import annotations

import pytest
import torch

from areal.algo.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

ESTIMATORS = [grpo_advantages, dr_grpo_advantages, rloo_advantages, reinforce_pp_advantages]


def test_dr_grpo_centres_without_the_std() -> None:
    # [1, 2, 6]: mean 3 -> [-2, -1, 3]; [0, 4]: mean 2 -> [-2, 2] (GRPO would give [-1, 1])
    adv = dr_grpo_advantages(torch.tensor([[1.0, 2.0, 6.0]]))
    torch.testing.assert_close(adv, torch.tensor([[-2.0, -1.0, 3.0]]))
    torch.testing.assert_close(
        dr_grpo_advantages(torch.tensor([[0.0, 4.0]])), torch.tensor([[-2.0, 2.0]])
    )


def test_rloo_leave_one_out_baseline() -> None:
    # [1, 0, 0, 1], G = 4: A_0 = 1 - (0 + 0 + 1) / 3 = 2/3, A_1 = 0 - (1 + 0 + 1) / 3 = -2/3
    adv = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    torch.testing.assert_close(adv, torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))
    # [3, 1, 2]: 3 - (1 + 2) / 2 = 1.5, 1 - (3 + 2) / 2 = -1.5, 2 - (3 + 1) / 2 = 0
    adv = rloo_advantages(torch.tensor([[3.0, 1.0, 2.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1.5, -1.5, 0.0]]))
    # = G / (G - 1) * (r - mean): 3/2 * [1, -1, 0]
    torch.testing.assert_close(adv, 1.5 * dr_grpo_advantages(torch.tensor([[3.0, 1.0, 2.0]])))


def test_rloo_single_sample_groups_have_no_baseline() -> None:
    # G = 1: no other sample to compare with -> 0 (not r - nan)
    adv = rloo_advantages(torch.tensor([[1.0], [5.0]]))
    assert torch.equal(adv, torch.zeros(2, 1))


def test_reinforce_pp_whitens_group_centred_advantages_over_the_batch() -> None:
    # group means: [[1, 0], [2, 0]] -> [[0.5, -0.5], [1, -1]]; batch mean 0,
    # population std sqrt((0.25 + 0.25 + 1 + 1) / 4) = sqrt(0.625) = 0.790569
    # -> [[0.632456, -0.632456], [1.264911, -1.264911]] (GRPO: [[1, -1], [1, -1]])
    adv = reinforce_pp_advantages(torch.tensor([[1.0, 0.0], [2.0, 0.0]]), eps=0.0)
    s = 0.625**0.5
    torch.testing.assert_close(adv, torch.tensor([[0.5 / s, -0.5 / s], [1 / s, -1 / s]]))
    assert adv.mean().item() == pytest.approx(0.0, abs=1e-7)
    assert adv.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)


def test_reinforce_pp_keeps_an_identical_group_at_zero() -> None:
    # [[1, 1], [1, 0]] -> centred [[0, 0], [0.5, -0.5]], std sqrt(0.5 / 4) = 0.353553
    # -> [[0, 0], [1.414214, -1.414214]]
    adv = reinforce_pp_advantages(torch.tensor([[1.0, 1.0], [1.0, 0.0]]), eps=0.0)
    r2 = 2.0**0.5
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0], [r2, -r2]]))


@pytest.mark.parametrize("fn", ESTIMATORS)
def test_identical_rewards_and_all_zero_batches_give_exact_zeros(fn) -> None:
    # 0.1 * 3 / 3 is not exactly 0.1 in float32: no residue may leak into the advantages
    rewards = torch.tensor([[0.1, 0.1, 0.1], [7.0, 7.0, 7.0]])
    assert torch.equal(fn(rewards), torch.zeros(2, 3))


@pytest.mark.parametrize("fn", ESTIMATORS)
def test_empty_batch_and_integer_rewards(fn) -> None:
    assert fn(torch.zeros(0, 4)).shape == (0, 4)
    adv = fn(torch.tensor([[1, 0], [0, 1]]))
    assert adv.dtype == torch.float32 and torch.isfinite(adv).all()
    with pytest.raises(ValueError, match="n_groups, G"):
        fn(torch.tensor([1.0, 0.0]))
