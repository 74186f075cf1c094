"""GRPO advantages with hand-worked numbers."""

from __future__ import annotations

import pytest
import torch

from areal.algo.advantages import grpo_advantages, zero_adv_groups


def test_group_normalisation_hand_values() -> None:
    # group [1, 0, 0, 1]: mean 0.5, population std 0.5 -> (r - 0.5) / 0.5 = [1, -1, -1, 1]
    # group [3, 1]: mean 2, std 1 -> [1, -1]
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    adv = grpo_advantages(rewards, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0]]))
    adv2 = grpo_advantages(torch.tensor([[3.0, 1.0], [0.0, 4.0]]), eps=0.0)
    torch.testing.assert_close(adv2, torch.tensor([[1.0, -1.0], [-1.0, 1.0]]))


def test_eps_is_added_to_std() -> None:
    # [0, 2]: mean 1, std 1 -> ±1 / (1 + 1e-6)
    adv = grpo_advantages(torch.tensor([[0.0, 2.0]]))
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 1.0]]) / (1.0 + 1e-6))


def test_without_std_normalisation_is_mean_centred() -> None:
    # [1, 2, 6]: mean 3 -> [-2, -1, 3]
    adv = grpo_advantages(torch.tensor([[1.0, 2.0, 6.0]]), norm_std=False)
    torch.testing.assert_close(adv, torch.tensor([[-2.0, -1.0, 3.0]]))


def test_identical_rewards_give_exact_zeros() -> None:
    # 0.1 * 3 / 3 is not exactly 0.1 in float32; the residue / 1e-6 must not leak out
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0], [7.0, 7.0, 7.0]])
    adv = grpo_advantages(rewards)
    assert torch.equal(adv[0], torch.zeros(3))
    assert torch.equal(adv[2], torch.zeros(3))
    assert torch.isfinite(adv).all()
    assert torch.equal(zero_adv_groups(rewards), torch.tensor([True, False, True]))


def test_single_sample_groups_are_zero() -> None:
    adv = grpo_advantages(torch.tensor([[1.0], [5.0]]))
    assert torch.equal(adv, torch.zeros(2, 1))
    assert zero_adv_groups(torch.tensor([[1.0], [5.0]])).all()


def test_group_advantages_sum_to_zero() -> None:
    g = torch.Generator().manual_seed(0)
    adv = grpo_advantages(torch.rand(16, 8, generator=g))
    torch.testing.assert_close(adv.sum(dim=1), torch.zeros(16), atol=1e-5, rtol=0)


def test_batch_norm_hand_values() -> None:
    # group step: [[1, 0], [0, 0]] -> [[1, -1], [0, 0]] (eps 0); batch mean 0,
    # population std sqrt((1 + 1 + 0 + 0) / 4) = sqrt(0.5) -> [[√2, -√2], [0, 0]]
    adv = grpo_advantages(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), batch_norm=True, eps=0.0)
    r2 = 2.0**0.5
    torch.testing.assert_close(adv, torch.tensor([[r2, -r2], [0.0, 0.0]]))


def test_batch_norm_has_zero_mean_unit_std() -> None:
    g = torch.Generator().manual_seed(1)
    adv = grpo_advantages(torch.randn(8, 4, generator=g) * 3 + 2, batch_norm=True)
    torch.testing.assert_close(adv.mean(), torch.tensor(0.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv.std(unbiased=False), torch.tensor(1.0), atol=1e-4, rtol=0)


def test_batch_norm_all_identical_stays_zero() -> None:
    adv = grpo_advantages(torch.ones(3, 4), batch_norm=True)
    assert torch.equal(adv, torch.zeros(3, 4))


def test_empty_batch() -> None:
    adv = grpo_advantages(torch.empty(0, 4))
    assert adv.shape == (0, 4)
    assert grpo_advantages(torch.empty(0, 4), batch_norm=True).shape == (0, 4)
    assert zero_adv_groups(torch.empty(0, 4)).shape == (0,)


def test_integer_rewards_become_float() -> None:
    # [0, 1]: mean 0.5, std 0.5 -> [-1, 1]
    adv = grpo_advantages(torch.tensor([[0, 1]]), eps=0.0)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 1.0]]))


def test_rejects_non_2d() -> None:
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(4))
    with pytest.raises(ValueError):
        zero_adv_groups(torch.zeros(2, 2, 2))
