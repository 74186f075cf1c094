"""KL to the frozen reference: the three estimators on hand-worked values, the penalty under the
normaliser, exact zeros for equal policies, masked tokens."""

from __future__ import annotations

import math

import pytest
import torch

from areal.algo.kl import kl_per_token
from areal.algo.loss import LossInput, PPOLossConfig
from areal.algo.registry import compute_loss

LN2 = math.log(2.0)


def t64(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def test_estimators_hand_values() -> None:
    # logp - ref = [ln 2, -ln 2] -> log_r = ref - logp = [-ln 2, ln 2], r = [0.5, 2]
    # k1 = -log_r = [ln 2, -ln 2] = [0.693147, -0.693147]
    # k2 = log_r^2 / 2 = [0.240227, 0.240227]
    # k3 = r - 1 - log_r = [0.5 - 1 + ln 2, 2 - 1 - ln 2] = [0.193147, 0.306853]
    logp, ref, m = t64(LN2, -LN2), t64(0.0, 0.0), torch.tensor([True, True])
    torch.testing.assert_close(kl_per_token(logp, ref, m, "k1"), t64(LN2, -LN2))
    torch.testing.assert_close(kl_per_token(logp, ref, m, "k2"), t64(LN2**2 / 2, LN2**2 / 2))
    torch.testing.assert_close(kl_per_token(logp, ref, m, "k3"), t64(LN2 - 0.5, 1 - LN2))
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_per_token(logp, ref, m, "k4")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_equal_policies_give_exact_zero_and_masked_tokens_nothing(estimator) -> None:
    logp = t64(-1.3, -0.2, float("nan"))
    kl = kl_per_token(logp, logp.clone(), torch.tensor([True, True, False]), estimator)
    assert torch.equal(kl, torch.zeros(3, dtype=torch.float64))


def make_input(logp: torch.Tensor, ref: torch.Tensor, denom: float) -> LossInput:
    n = logp.shape[0]
    return LossInput(
        logp=logp,
        prox_logp=logp.detach().clone(),
        behav_logp=logp.detach().clone(),
        adv=torch.zeros(n, dtype=torch.float64),  # no policy-gradient term: only the KL
        mask=torch.ones(n, dtype=torch.bool),
        seq_ids=torch.zeros(n, dtype=torch.long),
        versions=torch.zeros(n, dtype=torch.long),
        loss_denominator=denom,
        ref_logp=ref,
    )


def test_penalty_is_added_under_the_normaliser_with_its_gradient() -> None:
    # A = 0, so the loss is kl_coef * sum k3 / denom = 0.1 * (0.193147 + 0.306853) / 4 = 0.0125
    # d k3 / d logp = 1 - r: [1 - 0.5, 1 - 2] = [0.5, -1], times 0.1 / 4 -> [0.0125, -0.025]
    logp = t64(LN2, -LN2).requires_grad_(True)
    out = compute_loss(make_input(logp, t64(0.0, 0.0), 4.0), PPOLossConfig(kl_coef=0.1))
    assert out.loss.item() == pytest.approx(0.0125, abs=1e-12)
    assert out.kl_ref_sum == pytest.approx(0.5, abs=1e-12)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, t64(0.0125, -0.025))


def test_off_means_no_reference_needed_and_on_without_one_is_an_error() -> None:
    logp = t64(-1.0, -2.0).requires_grad_(True)
    inp = make_input(logp, t64(0.0, 0.0), 2.0)
    assert compute_loss(inp, PPOLossConfig()).kl_ref_sum is None  # off: not reported
    no_ref = LossInput(**{**inp.__dict__, "ref_logp": None})
    with pytest.raises(ValueError, match="reference log-probs"):
        compute_loss(no_ref, PPOLossConfig(kl_coef=0.1))
