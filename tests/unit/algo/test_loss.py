"""Decoupled PPO loss: hand-worked values, a plain-loop reference, gradients, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from areal.algo.loss import (
    PPOLossConfig,
    PPOLossOutput,
    behav_stat_sums,
    loglinear_prox_logp,
    loss_stat_sums,
    ppo_loss,
    reduce_loss_stats,
    stats_from_sums,
)

LN = math.log


def t64(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def reference_loop(
    logp: list[float],
    prox: list[float],
    behav: list[float],
    adv: list[float],
    mask: list[bool],
    cfg: PPOLossConfig,
    denom: float,
) -> dict[str, float]:
    """The objective written token by token, as in cleanrl's ppo.py."""
    total, n_kept, n_tokens, clipped, kl, w_sum, w_max, n_imp = 0.0, 0, 0, 0, 0.0, 0.0, 0.0, 0
    for t in range(len(logp)):
        if not mask[t]:
            continue
        n_tokens += 1
        if cfg.decoupled:
            old, w = prox[t], math.exp(prox[t] - behav[t])
        else:
            old, w = behav[t], 1.0
        w_sum += w
        w_max = max(w_max, w)
        if cfg.decoupled and cfg.behav_imp_weight_cap is not None and w > cfg.behav_imp_weight_cap:
            n_imp += 1
            continue
        n_kept += 1
        ratio = math.exp(logp[t] - old)
        pg_loss1 = -adv[t] * ratio
        pg_loss2 = -adv[t] * min(max(ratio, 1 - cfg.eps_clip_low), 1 + cfg.eps_clip_high)
        clipped += pg_loss2 > pg_loss1
        total += w * max(pg_loss1, pg_loss2)
        kl += (ratio - 1) - math.log(ratio)  # k3
    return {
        "loss": total / denom,
        "n_tokens": n_tokens,
        "n_kept": n_kept,
        "clip_count": clipped,
        "approx_kl_sum": kl,
        "imp_weight_sum": w_sum,
        "imp_weight_max": w_max,
        "n_imp_masked": n_imp,
    }


def test_hand_worked_three_tokens() -> None:
    # eps 0.2 / 0.2, cap 5, denominator 3
    # t0: u = 1.1, w = 1, A = 1  -> min(1.1, 1.1) = 1.1            -> pg = -1.1   (not clipped)
    # t1: u = 1.5, w = 1, A = 2  -> min(3.0, 1.2 * 2 = 2.4) = 2.4   -> pg = -2.4   (clipped)
    # t2: u = 0.5, w = 2, A = -1 -> min(-0.5, 0.8 * -1 = -0.8)      -> pg = -2 * -0.8 = 1.6 (clipped)
    # loss = (-1.1 - 2.4 + 1.6) / 3 = -1.9 / 3
    # approx_kl_sum (k3 = (r - 1) - ln r, r = u):
    #   t0: 0.1 - ln 1.1 = 0.1 - 0.0953102 = 0.0046898
    #   t1: 0.5 - ln 1.5 = 0.5 - 0.4054651 = 0.0945349
    #   t2: -0.5 - ln 0.5 = -0.5 + 0.6931472 = 0.1931472
    #   sum = 0.2923719 (the old k1 sum, -ln 1.1 - ln 1.5 - ln 0.5 = 0.1923719, is smaller)
    # entropy (given 0.5, 1.0, 1.5 per token) sums over the mask to 3.0
    logp = t64(LN(1.1), LN(1.5), LN(0.5))
    prox = t64(0.0, 0.0, 0.0)
    behav = t64(0.0, 0.0, LN(0.5))
    out = ppo_loss(
        logp,
        prox,
        behav,
        t64(1.0, 2.0, -1.0),
        torch.ones(3, dtype=torch.bool),
        PPOLossConfig(),
        3.0,
        entropy=t64(0.5, 1.0, 1.5),
    )
    assert out.loss.item() == pytest.approx(-1.9 / 3)
    assert (out.n_tokens, out.n_kept, out.n_imp_masked) == (3, 3, 0)
    assert out.clip_count == 2
    assert out.approx_kl_sum == pytest.approx(0.2923719, abs=1e-7)
    assert out.entropy_sum == pytest.approx(3.0)
    assert out.imp_weight_sum == pytest.approx(4.0)  # 1 + 1 + 2
    assert out.imp_weight_max == pytest.approx(2.0)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("cap", [5.0, 1.5, None])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_plain_loop(decoupled: bool, cap: float | None, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = 64
    logp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    prox = logp + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    behav = prox + torch.randn(n, generator=g, dtype=torch.float64) * 0.6
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.8
    cfg = PPOLossConfig(
        eps_clip_low=0.2, eps_clip_high=0.28, behav_imp_weight_cap=cap, decoupled=decoupled
    )
    denom = float(mask.sum()) + 7.0  # as if other micro-batches held 7 more tokens
    out = ppo_loss(logp, prox, behav, adv, mask, cfg, denom)
    ref = reference_loop(
        logp.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist(), cfg, denom
    )
    assert out.loss.item() == pytest.approx(ref["loss"], rel=1e-10, abs=1e-12)
    for key in ("n_tokens", "n_kept", "clip_count", "n_imp_masked"):
        assert getattr(out, key) == ref[key], key
    for key in ("approx_kl_sum", "imp_weight_sum", "imp_weight_max"):
        assert getattr(out, key) == pytest.approx(ref[key], rel=1e-10, abs=1e-12), key
    if decoupled and cap == 1.5:
        assert out.n_imp_masked > 0  # the cap branch was exercised


def test_gradient_unclipped_and_clipped() -> None:
    # one token, w = exp(0 - ln 0.5) = 2, u = 1, A = 1.5: loss = -2 * 1.5 = -3,
    # d loss / d logp = -w * A * u = -3
    logp = t64(0.0).requires_grad_()
    out = ppo_loss(logp, t64(0.0), t64(LN(0.5)), t64(1.5), torch.ones(1), PPOLossConfig(), 1.0)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-3.0)
    assert logp.grad is not None and logp.grad.item() == pytest.approx(-3.0)

    # u = 1.5 > 1.2 and A = 1 > 0: the clipped branch is taken -> gradient 0
    logp = t64(LN(1.5)).requires_grad_()
    ppo_loss(
        logp, t64(0.0), t64(0.0), t64(1.0), torch.ones(1), PPOLossConfig(), 1.0
    ).loss.backward()
    assert logp.grad is not None and logp.grad.item() == 0.0

    # u = 1.5, A = -1: min(-1.5, -1.2) = -1.5 unclipped -> loss = 1.5, grad = -A * u = 1.5
    logp = t64(LN(1.5)).requires_grad_()
    out = ppo_loss(logp, t64(0.0), t64(0.0), t64(-1.0), torch.ones(1), PPOLossConfig(), 1.0)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(1.5)
    assert logp.grad is not None and logp.grad.item() == pytest.approx(1.5)


def test_gradient_matches_autograd_of_reference_formula() -> None:
    g = torch.Generator().manual_seed(3)
    logp = (-torch.rand(32, generator=g, dtype=torch.float64)).requires_grad_()
    prox = logp.detach() + 0.1 * torch.randn(32, generator=g, dtype=torch.float64)
    behav = prox + 0.2 * torch.randn(32, generator=g, dtype=torch.float64)
    adv = torch.randn(32, generator=g, dtype=torch.float64)
    mask = torch.ones(32, dtype=torch.bool)
    out = ppo_loss(logp, prox, behav, adv, mask, PPOLossConfig(behav_imp_weight_cap=None), 32.0)
    (grad,) = torch.autograd.grad(out.loss, logp)
    # analytic: d/dlogp of -w * min(uA, clip(u)A) is -w * A * u where unclipped, else 0
    u = torch.exp(logp.detach() - prox)
    w = torch.exp(prox - behav)
    unclipped = (-adv * u) >= (-adv * u.clamp(0.8, 1.2))
    expected = torch.where(unclipped, -w * adv * u, torch.zeros_like(u)) / 32.0
    torch.testing.assert_close(grad, expected)


def test_no_gradient_flows_into_prox_or_behav() -> None:
    logp, prox, behav = (t64(-1.0, -2.0).requires_grad_() for _ in range(3))
    out = ppo_loss(logp, prox, behav, t64(1.0, -1.0), torch.ones(2), PPOLossConfig(), 2.0)
    out.loss.backward()
    assert logp.grad is not None
    assert prox.grad is None and behav.grad is None


def test_not_decoupled_is_standard_ppo() -> None:
    # u = exp(logp - behav) = 1.1, w = 1, A = 1 -> loss = -1.1; prox is unused (NaN here)
    out = ppo_loss(
        t64(LN(1.1)), t64(float("nan")), t64(0.0), t64(1.0), torch.ones(1),
        PPOLossConfig(decoupled=False, behav_imp_weight_cap=1.0), 1.0,
    )  # fmt: skip
    assert out.loss.item() == pytest.approx(-1.1)
    assert out.imp_weight_sum == 1.0 and out.imp_weight_max == 1.0 and out.n_imp_masked == 0
    # k3 against behav: r = 1.1 -> 0.1 - ln 1.1 = 0.0046898 (k1 would be -0.0953, negative)
    assert out.approx_kl_sum == pytest.approx(0.1 - LN(1.1))
    assert out.approx_kl_sum == pytest.approx(0.0046898, abs=1e-7)


def test_decoupled_equals_standard_when_prox_is_behav() -> None:
    g = torch.Generator().manual_seed(4)
    logp = -torch.rand(16, generator=g, dtype=torch.float64)
    behav = logp + 0.3 * torch.randn(16, generator=g, dtype=torch.float64)
    adv = torch.randn(16, generator=g, dtype=torch.float64)
    mask = torch.ones(16)
    a = ppo_loss(logp, behav, behav, adv, mask, PPOLossConfig(decoupled=True), 16.0)
    b = ppo_loss(logp, behav, behav, adv, mask, PPOLossConfig(decoupled=False), 16.0)
    assert a.loss.item() == pytest.approx(b.loss.item())
    assert a.clip_count == b.clip_count


def test_cap_masks_tokens_not_clips() -> None:
    # t0: w = exp(0 - ln 0.1) = 10 > 5 -> dropped; t1: w = exp(0 - ln 0.25) = 4 -> kept
    # kept t1: u = 1, A = 1 -> pg = -4 * 1 = -4; denominator 2 -> loss -2
    # (a clip of w to 5 would instead give (-5 - 4) / 2 = -4.5)
    out = ppo_loss(
        t64(0.0, 0.0),
        t64(0.0, 0.0),
        t64(LN(0.1), LN(0.25)),
        t64(1.0, 1.0),
        torch.ones(2),
        PPOLossConfig(),
        2.0,
    )
    assert out.loss.item() == pytest.approx(-2.0)
    assert (out.n_tokens, out.n_kept, out.n_imp_masked) == (2, 1, 1)
    assert out.imp_weight_sum == pytest.approx(14.0)  # 10 + 4, before cap masking
    assert out.imp_weight_max == pytest.approx(10.0)


def test_weight_exactly_at_cap_is_kept() -> None:
    # w = exp(0) = 1 == cap: kept (only w > cap is masked)
    out = ppo_loss(
        t64(0.0),
        t64(-0.5),
        t64(-0.5),
        t64(1.0),
        torch.ones(1),
        PPOLossConfig(behav_imp_weight_cap=1.0),
        1.0,
    )
    assert (out.n_kept, out.n_imp_masked) == (1, 0)


def test_asymmetric_clip() -> None:
    # eps_low 0.2, eps_high 0.28
    # t0: u = 1.25, A = 1: 1.25 < 1.28 -> not clipped (with symmetric 0.2 it would be, to 1.2)
    # t1: u = 0.75, A = -1: clip(0.75) = 0.8, min(-0.75, -0.8) = -0.8 -> clipped
    # loss = (-1.25 + 0.8) / 2 = -0.225
    logp, zero = t64(LN(1.25), LN(0.75)), t64(0.0, 0.0)
    cfg = PPOLossConfig(eps_clip_low=0.2, eps_clip_high=0.28)
    out = ppo_loss(logp, zero, zero, t64(1.0, -1.0), torch.ones(2), cfg, 2.0)
    assert out.loss.item() == pytest.approx(-0.225)
    assert out.clip_count == 1
    sym = ppo_loss(logp, zero, zero, t64(1.0, -1.0), torch.ones(2), PPOLossConfig(), 2.0)
    assert sym.loss.item() == pytest.approx((-1.2 + 0.8) / 2)  # both clipped
    assert sym.clip_count == 2


def test_all_masked_gives_zero_and_backward_works() -> None:
    logp = t64(-1.0, float("nan"), float("inf")).requires_grad_()
    out = ppo_loss(
        logp,
        t64(0.0, 0.0, 0.0),
        t64(-50.0, 0.0, 0.0),
        t64(1.0, float("nan"), 2.0),
        torch.zeros(3, dtype=torch.bool),
        PPOLossConfig(),
        0.0,
    )
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert logp.grad is not None and torch.equal(logp.grad, torch.zeros(3, dtype=torch.float64))
    assert (out.n_tokens, out.n_kept, out.n_imp_masked, out.clip_count) == (0, 0, 0, 0.0)
    assert (out.approx_kl_sum, out.imp_weight_sum, out.imp_weight_max) == (0.0, 0.0, 0.0)


def test_masked_tokens_with_garbage_do_not_leak() -> None:
    # t1 is outside the mask and holds inf/NaN; t0: u = 1, w = 1, A = 2 -> loss -2
    logp = t64(0.0, float("inf")).requires_grad_()
    out = ppo_loss(
        logp,
        t64(0.0, float("nan")),
        t64(0.0, -1e9),
        t64(2.0, float("nan")),
        t64(1.0, 0.0),
        PPOLossConfig(),
        1.0,
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-2.0)
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert out.imp_weight_max == 1.0


def test_float_mask_equals_bool_mask() -> None:
    logp, prox, behav, adv = (
        t64(-1.0, -2.0, -0.5),
        t64(-1.1, -1.9, -0.4),
        t64(-1.0, -2.2, -0.9),
        t64(0.5, -1.0, 2.0),
    )
    a = ppo_loss(logp, prox, behav, adv, torch.tensor([1.0, 0.0, 1.0]), PPOLossConfig(), 2.0)
    b = ppo_loss(logp, prox, behav, adv, torch.tensor([True, False, True]), PPOLossConfig(), 2.0)
    assert a.loss.item() == b.loss.item() and a.n_tokens == b.n_tokens == 2


def test_micro_batches_add_up_to_batch_mean() -> None:
    g = torch.Generator().manual_seed(5)
    logp = -torch.rand(20, generator=g, dtype=torch.float64)
    prox = logp + 0.2 * torch.randn(20, generator=g, dtype=torch.float64)
    behav = prox + 0.5 * torch.randn(20, generator=g, dtype=torch.float64)
    adv = torch.randn(20, generator=g, dtype=torch.float64)
    mask = torch.rand(20, generator=g) < 0.7
    denom = float(mask.sum())
    whole = ppo_loss(logp, prox, behav, adv, mask, PPOLossConfig(), denom)
    parts = [
        ppo_loss(logp[s], prox[s], behav[s], adv[s], mask[s], PPOLossConfig(), denom)
        for s in (slice(0, 7), slice(7, 20))
    ]
    assert sum(p.loss.item() for p in parts) == pytest.approx(whole.loss.item())
    assert reduce_loss_stats(parts) == pytest.approx(reduce_loss_stats([whole]))


def test_reduce_loss_stats_hand_values() -> None:
    # kept 3 + 1 = 4, clip 1 + 1 = 2 -> clipfrac 0.5; kl (0.4 + 0.2) / 4 = 0.15
    # tokens 4 + 2 = 6, w sum (4 + 8) / 6 = 2; masked 0 + 1 -> 1/6; max(2, 7) = 7
    # entropy per masked token (not per kept): (2.4 + 0.6) / 6 = 0.5
    # behav_kl (0.3 + 0.3) / 6 = 0.1; k3 (0.06 + 0.24) / 6 = 0.05;
    # ess = (sum w)^2 / (n sum w^2) = 12^2 / (6 * (5 + 70)) = 144 / 450 = 0.32
    a = PPOLossOutput(
        torch.tensor(-0.25), 4, 3, 1.0, 0.4, 4.0, 2.0, 0, entropy_sum=2.4,
        behav_kl_sum=0.3, behav_kl_k3_sum=0.06, imp_weight_sq_sum=5.0,
    )  # fmt: skip
    b = PPOLossOutput(
        torch.tensor(0.5), 2, 1, 1.0, 0.2, 8.0, 7.0, 1, entropy_sum=0.6,
        behav_kl_sum=0.3, behav_kl_k3_sum=0.24, imp_weight_sq_sum=70.0,
    )  # fmt: skip
    stats = reduce_loss_stats([a, b])
    assert stats == pytest.approx(
        {
            "loss": 0.25,
            "clipfrac": 0.5,
            "approx_kl": 0.15,
            "entropy": 0.5,
            "behav_imp_weight_mean": 2.0,
            "behav_imp_weight_max": 7.0,
            "behav_imp_weight_masked_frac": 1 / 6,
            "behav_kl": 0.1,
            "behav_kl_k3": 0.05,
            "behav_ess": 0.32,
            "n_tokens": 6.0,
        }
    )


def test_staleness_diagnostics_hand_values() -> None:
    # two loss tokens with prox - behav = +ln 2 and -ln 2: w = 2 and 0.5
    #   k1: behav - prox = -ln 2 + ln 2 = 0 -> behav_kl 0 (k1 cancels; k3 does not)
    #   k3: (2 - 1 - ln 2) + (0.5 - 1 + ln 2) = 0.5 -> behav_kl_k3 0.25
    #   ess: (2 + 0.5)^2 / (2 * (4 + 0.25)) = 6.25 / 8.5 = 0.7352941
    # a third token outside the mask holds NaN and counts for nothing
    behav = t64(-1.0, -1.0, float("nan"))
    prox = t64(-1.0 + LN(2.0), -1.0 - LN(2.0), 0.0)
    mask = torch.tensor([True, True, False])
    sums = behav_stat_sums(prox, behav, mask)
    assert sums == pytest.approx(
        {"behav_kl_sum": 0.0, "behav_kl_k3_sum": 0.5, "imp_weight_sq_sum": 4.25}, abs=1e-12
    )
    out = ppo_loss(prox, prox, behav, t64(1.0, -1.0, 0.0), mask, PPOLossConfig(), 2.0)
    stats = reduce_loss_stats([out])
    assert stats["behav_kl"] == pytest.approx(0.0, abs=1e-12)
    assert stats["behav_kl_k3"] == pytest.approx(0.25)
    assert stats["behav_ess"] == pytest.approx(0.7352941, abs=1e-7)
    # fresh data (prox == behav): no divergence, every sample counts (ess 1)
    fresh = reduce_loss_stats([ppo_loss(prox, prox, prox, t64(1.0, 1.0, 0.0), mask,
                                        PPOLossConfig(), 2.0)])  # fmt: skip
    assert (fresh["behav_kl"], fresh["behav_kl_k3"], fresh["behav_ess"]) == (0.0, 0.0, 1.0)
    # no token at all: the stats are defined (ess 1, nothing diverged)
    empty = reduce_loss_stats([])
    assert (empty["behav_kl"], empty["behav_kl_k3"], empty["behav_ess"]) == (0.0, 0.0, 1.0)


def test_stats_from_sums_is_reduce_of_the_totals() -> None:
    # what ranks do: sum the totals, then divide once (not a mean of per-rank ratios)
    a = PPOLossOutput(torch.tensor(-0.25), 4, 3, 1.0, 0.4, 4.0, 2.0, 0, entropy_sum=2.4)
    b = PPOLossOutput(torch.tensor(0.5), 2, 1, 1.0, 0.2, 8.0, 7.0, 1, entropy_sum=0.6)
    sa, sb = loss_stat_sums([a]), loss_stat_sums([b])
    summed = {k: sa[k] + sb[k] for k in sa}
    assert stats_from_sums(summed, max(2.0, 7.0)) == pytest.approx(reduce_loss_stats([a, b]))


def test_k3_approx_kl_hand_values_and_sign() -> None:
    # Two tokens drawn with equal weight from the old policy q = (0.5, 0.5); current p = (0.8, 0.2):
    #   token A: r = 0.8 / 0.5 = 1.6 -> k3 = 0.6 - ln 1.6 = 0.6 - 0.4700036 = 0.1299964
    #   token B: r = 0.2 / 0.5 = 0.4 -> k3 = -0.6 - ln 0.4 = -0.6 + 0.9162907 = 0.3162907
    #   mean = 0.2231436 = KL(q || p) = 0.5 ln(0.5 / 0.8) + 0.5 ln(0.5 / 0.2) exactly (unbiased)
    # k1 for token A alone would be ln 0.5 - ln 0.8 = -0.47 < 0; k3 is >= 0 token by token.
    logp, old = t64(LN(0.8), LN(0.2)), t64(LN(0.5), LN(0.5))
    cfg = PPOLossConfig(eps_clip_low=10.0, eps_clip_high=10.0)
    out = ppo_loss(logp, old, old, t64(1.0, 1.0), torch.ones(2), cfg, 2.0)
    assert out.approx_kl_sum / out.n_kept == pytest.approx(0.2231436, abs=1e-7)
    assert reduce_loss_stats([out])["approx_kl"] == pytest.approx(
        0.5 * LN(0.5 / 0.8) + 0.5 * LN(0.5 / 0.2)
    )
    only_a = ppo_loss(logp[:1], old[:1], old[:1], t64(1.0), torch.ones(1), cfg, 1.0)
    assert only_a.approx_kl_sum == pytest.approx(0.1299964, abs=1e-7)


def test_k3_is_nonnegative_and_zero_on_policy() -> None:
    g = torch.Generator().manual_seed(6)
    logp = -torch.rand(200, generator=g, dtype=torch.float64) * 4
    old = logp + torch.randn(200, generator=g, dtype=torch.float64)
    out = ppo_loss(logp, old, old, torch.ones(200, dtype=torch.float64), torch.ones(200),
                   PPOLossConfig(), 200.0)  # fmt: skip
    assert out.approx_kl_sum > 0.0
    for t in range(200):  # per token
        one = ppo_loss(logp[t : t + 1], old[t : t + 1], old[t : t + 1], t64(1.0), torch.ones(1),
                       PPOLossConfig(), 1.0)  # fmt: skip
        assert one.approx_kl_sum >= 0.0
    same = ppo_loss(logp, logp, logp, torch.ones(200, dtype=torch.float64), torch.ones(200),
                    PPOLossConfig(), 200.0)  # fmt: skip
    assert same.approx_kl_sum == 0.0


def test_entropy_is_summed_over_the_mask_including_capped_tokens() -> None:
    # t0 in mask, kept; t1 in mask but dropped by the cap (w = 10 > 5); t2 outside the mask
    # (entropy NaN there must not leak): entropy_sum = 1.25 + 0.75 = 2.0 over 2 masked tokens
    out = ppo_loss(
        t64(0.0, 0.0, 0.0),
        t64(0.0, 0.0, 0.0),
        t64(0.0, LN(0.1), 0.0),
        t64(1.0, 1.0, 1.0),
        t64(1.0, 1.0, 0.0),
        PPOLossConfig(),
        2.0,
        entropy=t64(1.25, 0.75, float("nan")),
    )
    assert (out.n_tokens, out.n_kept) == (2, 1)
    assert out.entropy_sum == pytest.approx(2.0)
    assert reduce_loss_stats([out])["entropy"] == pytest.approx(1.0)
    no_entropy = ppo_loss(
        t64(0.0), t64(0.0), t64(0.0), t64(1.0), torch.ones(1), PPOLossConfig(), 1.0
    )
    assert no_entropy.entropy_sum == 0.0


def test_reduce_loss_stats_empty_and_zero_tokens() -> None:
    keys = {
        "loss",
        "clipfrac",
        "approx_kl",
        "entropy",
        "behav_imp_weight_mean",
        "behav_imp_weight_max",
        "behav_imp_weight_masked_frac",
        "behav_kl",
        "behav_kl_k3",
        "behav_ess",
        "n_tokens",
    }
    empty = reduce_loss_stats([])
    # every stat 0, except the ESS: with no weight at all nothing is degenerate (1 = fresh)
    assert set(empty) == keys and all(v == (k == "behav_ess") for k, v in empty.items())
    zero = ppo_loss(t64(-1.0), t64(-1.0), t64(-1.0), t64(1.0), torch.zeros(1), PPOLossConfig(), 0.0)
    stats = reduce_loss_stats([zero, zero])
    assert all(v == (k == "behav_ess") and math.isfinite(v) for k, v in stats.items())


def test_rejects_bad_shapes_and_denominator() -> None:
    with pytest.raises(ValueError):
        ppo_loss(
            t64(0.0, 0.0),
            t64(0.0),
            t64(0.0, 0.0),
            t64(1.0, 1.0),
            torch.ones(2),
            PPOLossConfig(),
            2.0,
        )
    with pytest.raises(ValueError):
        ppo_loss(t64(0.0), t64(0.0), t64(0.0), t64(1.0), torch.ones(1), PPOLossConfig(), 0.0)
    with pytest.raises(ValueError, match="entropy"):
        ppo_loss(t64(0.0), t64(0.0), t64(0.0), t64(1.0), torch.ones(1), PPOLossConfig(), 1.0,
                 entropy=t64(0.0, 0.0))  # fmt: skip


def test_loglinear_prox_logp_hand_values() -> None:
    # current version 5 -> v_prox 5, v_theta 6
    # v = 5: alpha = 0 / 1 = 0   -> prox = behav = -1
    # v = 4: alpha = 1 / 2       -> -1 + 0.5 * (-0.5 - -1) = -0.75
    # v = 2: alpha = 3 / 4       -> -1 + 0.75 * 0.5 = -0.625
    # v = 6 (newer than current, should not happen): alpha clamped to 0 -> -2
    behav = t64(-1.0, -1.0, -1.0, -2.0)
    theta = t64(-0.5, -0.5, -0.5, -1.0).requires_grad_()
    prox = loglinear_prox_logp(behav, theta, torch.tensor([5, 4, 2, 6]), current_version=5)
    torch.testing.assert_close(prox, t64(-1.0, -0.75, -0.625, -2.0))
    assert not prox.requires_grad


def test_loglinear_prox_alpha_stays_in_unit_interval() -> None:
    behav = torch.zeros(50, dtype=torch.float64)
    theta = torch.ones(50, dtype=torch.float64)
    prox = loglinear_prox_logp(behav, theta, torch.arange(-10, 40), current_version=20)
    assert ((prox >= 0) & (prox <= 1)).all()
    assert prox[0].item() == pytest.approx(30 / 31)  # lag 30 -> alpha 30 / 31


def test_empty_input() -> None:
    logp = torch.empty(0, dtype=torch.float64, requires_grad=True)
    e = torch.empty(0, dtype=torch.float64)
    out = ppo_loss(logp, e, e, e, torch.empty(0, dtype=torch.bool), PPOLossConfig(), 0.0)
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.n_tokens == 0 and out.imp_weight_max == 0.0
