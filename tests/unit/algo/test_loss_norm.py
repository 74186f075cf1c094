"""The loss normaliser (token, sequence, Dr. GRPO's constant) with hand-worked values."""

from __future__ import annotations

import pytest
import torch

from areal.algo.loss import PPOLossConfig, ppo_loss
from areal.algo.loss_norm import Normaliser


def test_token_is_the_minibatch_loss_token_count() -> None:
    # loss tokens [3, 0, 5] -> 8, one number for every token (today's denominator)
    norm = Normaliser.of([3, 0, 5], "token")
    assert norm == Normaliser(8.0) and norm.denominator([3], [4]) == 8.0


def test_sequence_divides_each_token_by_samples_times_its_length() -> None:
    # S = 2 samples with loss tokens (the one with 0 does not count); sample of 3 loss tokens
    # (4 output tokens, one an environment token) -> 2 * 3 = 6 on each of its 4 tokens
    norm = Normaliser.of([3, 0, 5], "sequence")
    assert norm == Normaliser(2.0, per_sequence=True)
    den = norm.denominator([3, 5], [4, 5])
    assert den.tolist() == [6.0] * 4 + [10.0] * 5


def test_dr_grpo_constant_ignores_the_answer_lengths() -> None:
    # Dr. GRPO: 2 samples, budget L = 4 tokens: sum of token losses / (2 * 4)
    # token losses all -1 (A = 1, ratio 1), 3 + 1 loss tokens: -4 / 8 = -0.5 (token mean: -1)
    norm = Normaliser.of([3, 1], "constant", loss_norm_tokens=4)
    assert norm.denominator([3, 1], [3, 1]) == 8.0
    z = torch.zeros(4, dtype=torch.float64)
    out = ppo_loss(
        z,
        z,
        z,
        torch.ones(4, dtype=torch.float64),
        torch.ones(4, dtype=torch.bool),
        PPOLossConfig(),
        norm.denominator([3, 1], [3, 1]),
    )
    assert out.loss.item() == pytest.approx(-0.5)
    # the same samples, longer answers, same constant: the normaliser does not move
    assert Normaliser.of([4, 4], "constant", loss_norm_tokens=4).batch_term == 8.0


def test_per_token_denominators_give_the_sample_mean_in_ppo() -> None:
    # token losses -1 (A = 1, ratio 1); sample 0 has 1 token, sample 1 has 3:
    # sequence norm: -1/2 (1/1 * 1 + 1/3 * 3) = -1 (token norm would also give -1 here, so
    # use A = [2, 1, 1, 1]: sample mean = -(2 + 1) / 2 = -1.5, token mean -5 / 4 = -1.25)
    adv = torch.tensor([2.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    z = torch.zeros(4, dtype=torch.float64)
    m = torch.ones(4, dtype=torch.bool)
    seq = Normaliser.of([1, 3], "sequence").denominator([1, 3], [1, 3])
    assert ppo_loss(z, z, z, adv, m, PPOLossConfig(), seq).loss.item() == pytest.approx(-1.5)
    tok = Normaliser.of([1, 3], "token").denominator([1, 3], [1, 3])
    assert ppo_loss(z, z, z, adv, m, PPOLossConfig(), tok).loss.item() == pytest.approx(-1.25)


def test_empty_minibatch_and_bad_settings() -> None:
    assert Normaliser.of([], "token").batch_term == 0.0
    assert Normaliser.of([], "sequence").denominator([], []).shape == (0,)
    assert Normaliser.of([], "constant", loss_norm_tokens=8).batch_term == 0.0
    with pytest.raises(ValueError, match="loss_norm_tokens"):
        Normaliser.of([1], "constant")
    with pytest.raises(ValueError, match="unknown loss_norm"):
        Normaliser.of([1], "tokens")
