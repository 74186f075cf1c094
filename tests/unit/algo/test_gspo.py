"""GSPO (Zheng et al. 2025, arXiv 2507.18071): the sequence-level ratio and clip, hand-worked."""

from __future__ import annotations

import math

import pytest
import torch

from areal.algo.gspo import gspo_loss
from areal.algo.loss import LossInput, PPOLossConfig, ppo_loss
from areal.algo.loss_norm import Normaliser

LN = math.log


def t64(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def make_input(
    log_ratio: list[float],
    seq_lens: list[int],
    adv: list[float],
    *,
    denom: float | torch.Tensor | None = None,
    prox_minus_behav: list[float] | None = None,
    mask: list[bool] | None = None,
) -> LossInput:
    """Tokens of sequences of `seq_lens`; logp - prox = `log_ratio`; prox - behav as given."""
    n = len(log_ratio)
    prox = torch.full((n,), -1.0, dtype=torch.float64)
    behav = prox - t64(*(prox_minus_behav or [0.0] * n))
    logp = (prox + t64(*log_ratio)).requires_grad_(True)
    seq_ids = torch.repeat_interleave(
        torch.arange(len(seq_lens)), torch.tensor(seq_lens, dtype=torch.long)
    )
    m = torch.tensor(mask if mask is not None else [True] * n, dtype=torch.bool)
    return LossInput(
        logp=logp,
        prox_logp=prox,
        behav_logp=behav,
        adv=t64(*(a for a, k in zip(adv, seq_lens, strict=True) for _ in range(k))),
        mask=m,
        seq_ids=seq_ids,
        versions=torch.zeros(n, dtype=torch.long),
        loss_denominator=float(m.sum()) if denom is None else denom,
    )


CFG = PPOLossConfig(decoupled=False, behav_imp_weight_cap=None)  # w_i = 1: the paper's setting


def test_sequence_ratio_is_the_geometric_mean_and_clips_per_sequence() -> None:
    # seq 0: log ratios [ln 4, 0]        -> s0 = exp((ln 4 + 0) / 2) = 2,   A = +1
    #   min(2 * 1, clip(2, 1 - 3e-4, 1 + 4e-4) * 1) = 1.0004 -> loss_t = -1.0004 (clipped)
    # seq 1: log ratios [ln 0.125, 0, 0] -> s1 = exp(ln(1/8) / 3) = 0.5, A = -1
    #   min(-0.5, clip(0.5) * -1 = -0.9997) = -0.9997 -> loss_t = +0.9997 (clipped)
    # token norm (5 tokens): (2 * -1.0004 + 3 * 0.9997) / 5 = 0.9983 / 5 = 0.19966
    inp = make_input([LN(4), 0.0, LN(0.125), 0.0, 0.0], [2, 3], [1.0, -1.0])
    out = gspo_loss(inp, CFG)
    assert out.loss.item() == pytest.approx(0.19966, abs=1e-9)
    assert (out.n_tokens, out.n_kept, out.clip_count) == (5, 5, 5.0)
    out.loss.backward()
    assert torch.equal(inp.logp.grad, torch.zeros(5, dtype=torch.float64))  # all clipped
    # sequence norm: S = 2, seq 0's tokens / (2 * 2), seq 1's / (2 * 3):
    # 2 * -1.0004 / 4 + 3 * 0.9997 / 6 = -0.5002 + 0.49985 = -0.00035, the paper's
    # 1/G sum_i min(s_i A_i, clip(s_i) A_i) = (-1.0004 + 0.9997) / 2
    norm = Normaliser.of([2, 3], "sequence")
    inp_s = make_input(
        [LN(4), 0.0, LN(0.125), 0.0, 0.0],
        [2, 3],
        [1.0, -1.0],
        denom=norm.denominator([2, 3], [2, 3]),
    )
    assert gspo_loss(inp_s, CFG).loss.item() == pytest.approx(-0.00035, abs=1e-9)


def test_unclipped_gradient_flows_through_every_token_of_the_sequence() -> None:
    # wide clip range: L = -1/S sum_i A_i s_i (sequence norm), and d s_i / d logp_t = s_i / |o_i|
    # seq 0: -1/2 * 1 * 2 / 2 = -0.5 per token; seq 1: -1/2 * -1 * 0.5 / 3 = 1/12 per token
    cfg = PPOLossConfig(
        decoupled=False, behav_imp_weight_cap=None, gspo_eps_clip_low=0.99, gspo_eps_clip_high=10
    )
    norm = Normaliser.of([2, 3], "sequence")
    inp = make_input(
        [LN(4), 0.0, LN(0.125), 0.0, 0.0],
        [2, 3],
        [1.0, -1.0],
        denom=norm.denominator([2, 3], [2, 3]),
    )
    out = gspo_loss(inp, cfg)
    # -1/2 (1 * 2 + -1 * 0.5) = -0.75
    assert out.loss.item() == pytest.approx(-0.75, abs=1e-12)
    assert out.clip_count == 0.0
    out.loss.backward()
    torch.testing.assert_close(inp.logp.grad, t64(-0.5, -0.5, 1 / 12, 1 / 12, 1 / 12))


def test_decoupled_weight_is_per_sequence_and_the_cap_drops_whole_sequences() -> None:
    # one seq of 2 tokens, logp = prox (s = 1), prox - behav = [ln 2, ln 8]
    # w = exp((ln 2 + ln 8) / 2) = exp(ln 4) = 4; A = 1 -> loss_t = -4 * 1 = -4, token mean -4
    inp = make_input([0.0, 0.0], [2], [1.0], prox_minus_behav=[LN(2), LN(8)])
    out = gspo_loss(inp, PPOLossConfig(behav_imp_weight_cap=5.0))
    assert out.loss.item() == pytest.approx(-4.0, abs=1e-12)
    assert out.imp_weight_max == pytest.approx(4.0) and out.imp_weight_sum == pytest.approx(8.0)
    # cap 3 < 4: the whole sequence leaves the loss (not clipped)
    out = gspo_loss(inp, PPOLossConfig(behav_imp_weight_cap=3.0))
    assert out.loss.item() == 0.0 and (out.n_kept, out.n_imp_masked, out.n_tokens) == (0, 2, 2)


def test_one_token_sequences_are_token_level_ppo() -> None:
    # with |o_i| = 1, s_i = u_t and w_i = w_t: GSPO is decoupled PPO with the same clip range
    g = torch.Generator().manual_seed(0)
    n = 6
    log_ratio = (torch.rand(n, generator=g, dtype=torch.float64) - 0.5).tolist()
    pmb = (torch.rand(n, generator=g, dtype=torch.float64) - 0.5).tolist()
    adv = (torch.rand(n, generator=g, dtype=torch.float64) - 0.5).tolist()
    cfg = PPOLossConfig(
        gspo_eps_clip_low=0.1,
        gspo_eps_clip_high=0.15,
        eps_clip_low=0.1,
        eps_clip_high=0.15,
        behav_imp_weight_cap=1.3,
    )
    inp = make_input(log_ratio, [1] * n, adv, prox_minus_behav=pmb)
    g_out = gspo_loss(inp, cfg)
    p_out = ppo_loss(inp.logp, inp.prox_logp, inp.behav_logp, inp.adv, inp.mask, cfg, float(n))
    assert g_out.loss.item() == pytest.approx(p_out.loss.item(), abs=1e-12)
    for k in ("n_kept", "clip_count", "approx_kl_sum", "imp_weight_sum", "n_imp_masked"):
        assert getattr(g_out, k) == pytest.approx(getattr(p_out, k), abs=1e-12), k


def test_masked_tokens_leave_the_ratio_and_may_hold_nan() -> None:
    # seq of 3 tokens, the middle one masked with NaN log ratio: s = exp((ln 4 + 0) / 2) = 2
    # wide clip, A = 1, token norm over 2 loss tokens: loss = -(2 + 2) / 2 = -2
    cfg = PPOLossConfig(decoupled=False, gspo_eps_clip_low=0.99, gspo_eps_clip_high=10)
    inp = make_input([LN(4), float("nan"), 0.0], [3], [1.0], mask=[True, False, True])
    out = gspo_loss(inp, cfg)
    assert out.loss.item() == pytest.approx(-2.0) and out.n_tokens == 2
    out.loss.backward()
    assert torch.isfinite(inp.logp.grad).all() and inp.logp.grad[1] == 0.0


def test_all_masked_and_empty_inputs_give_zero_connected_to_the_graph() -> None:
    inp = make_input([0.3, -0.2], [1, 1], [1.0, -1.0], mask=[False, False], denom=0.0)
    out = gspo_loss(inp, PPOLossConfig())
    assert out.loss.item() == 0.0 and out.n_tokens == 0 and out.imp_weight_max == 0.0
    out.loss.backward()
    assert torch.equal(inp.logp.grad, torch.zeros(2, dtype=torch.float64))
    empty = make_input([], [], [], denom=0.0)
    out = gspo_loss(empty, PPOLossConfig())
    assert out.loss.item() == 0.0 and (out.n_tokens, out.n_kept) == (0, 0)
