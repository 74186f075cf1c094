"""Behaviour-weight rules (`areal.algo.behav_weight`) against hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from areal.algo.behav_weight import behav_weights, m2po_drop
from areal.algo.loss import PPOLossConfig, ppo_loss

LN = math.log


def t64(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


# Two sequences: seq 0 has tokens with w = 2, 8 (log w = ln 2, ln 8); seq 1 has w = 0.5, 1, and a
# non-loss token holding NaN. behav = 0 everywhere, so prox = log w.
PROX = t64(LN(2.0), LN(8.0), LN(0.5), 0.0, float("nan"))
BEHAV = t64(0.0, 0.0, 0.0, 0.0, 0.0)
MASK = torch.tensor([True, True, True, True, False])
SEQ = torch.tensor([0, 0, 1, 1, 1])


def rule(**kw):
    return behav_weights(PROX, BEHAV, MASK, SEQ, **kw)


def test_token_mask_is_areal_cap() -> None:
    # cap 5: w = 8 is dropped, the rest keep their own weight; the NaN token weighs 1, kept
    r = rule(level="token", mode="mask", high=5.0)
    assert r.weight.tolist() == pytest.approx([2.0, 1.0, 0.5, 1.0, 1.0])
    assert r.dropped.tolist() == [False, True, False, False, False]


def test_token_truncate_is_tis_with_a_floor() -> None:
    # clamp into [0.6, 5]: 2 -> 2, 8 -> 5, 0.5 -> 0.6, 1 -> 1; nothing dropped
    r = rule(level="token", mode="truncate", low=0.6, high=5.0)
    assert r.weight.tolist() == pytest.approx([2.0, 5.0, 0.6, 1.0, 1.0])
    assert not r.dropped.any()


def test_sequence_level_uses_the_product() -> None:
    # seq 0: 2 * 8 = 16 > 5 -> both tokens dropped; seq 1: 0.5 * 1 = 0.5 inside -> weight 0.5
    r = rule(level="sequence", mode="mask", high=5.0)
    assert r.dropped.tolist() == [True, True, False, False, False]
    assert r.weight.tolist() == pytest.approx([1.0, 1.0, 0.5, 0.5, 1.0])
    # truncated instead: seq 0 carries 5 on each token
    t = rule(level="sequence", mode="truncate", high=5.0)
    assert t.weight.tolist() == pytest.approx([5.0, 5.0, 0.5, 0.5, 1.0])


def test_geometric_level_uses_the_mean_log_weight() -> None:
    # seq 0: exp((ln 2 + ln 8) / 2) = sqrt(16) = 4 <= 5: kept at 4; seq 1: sqrt(0.5) = 0.7071
    r = rule(level="geometric", mode="mask", high=5.0)
    assert not r.dropped.any()
    assert r.weight.tolist() == pytest.approx([4.0, 4.0, 0.5**0.5, 0.5**0.5, 1.0])
    # a floor of 0.8 masks seq 1 (0.7071 < 0.8), and only the loss tokens of it
    f = rule(level="geometric", mode="mask", low=0.8, high=5.0)
    assert f.dropped.tolist() == [False, False, True, True, False]


def test_m2po_drops_the_fewest_largest_second_moments() -> None:
    # (log w)^2: ln2^2 = 0.4805, ln8^2 = 4.3241, ln0.5^2 = 0.4805, 0; mean = 1.3213 > tau 0.5
    # drop ln 8 (largest): (0.4805 + 0.4805 + 0) / 3 = 0.3203 <= 0.5 -> stop after one
    log_w = t64(LN(2.0), LN(8.0), LN(0.5), 0.0, 0.0)
    cand = torch.tensor([True, True, True, True, False])
    assert m2po_drop(log_w, cand, tau=0.5).tolist() == [False, True, False, False, False]
    # tau 0.3: one more must go (0.4805, a tie: either), then (0.4805 + 0) / 2 = 0.24 <= 0.3
    assert int(m2po_drop(log_w, cand, tau=0.3).sum()) == 2
    # already within: nothing dropped; no candidates: nothing dropped
    assert not m2po_drop(log_w, cand, tau=2.0).any()
    assert not m2po_drop(log_w, torch.zeros(5, dtype=torch.bool), tau=0.1).any()
    # after the rule: no cap, M2PO alone
    r = rule(level="token", mode="mask", high=None, m2po_tau=0.5)
    assert r.dropped.tolist() == [False, True, False, False, False]


def test_fresh_data_weighs_one_and_bad_settings_fail() -> None:
    fresh = behav_weights(BEHAV, BEHAV, MASK, SEQ, level="sequence", low=0.5, high=2.0)
    assert fresh.weight.tolist() == [1.0] * 5 and not fresh.dropped.any()
    with pytest.raises(ValueError, match="low < high"):
        rule(low=2.0, high=1.5)
    with pytest.raises(ValueError, match="unknown behaviour-weight level"):
        rule(level="batch")  # type: ignore[arg-type]


def test_ppo_loss_takes_the_rule_and_reports_raw_weights() -> None:
    # adv 1 everywhere, logp = prox (ratio 1, no clip): loss_t = -w_t; denominator 4 loss tokens
    # sequence mask cap 5: seq 0 dropped, seq 1 weighs 0.5 each -> loss = -(0.5 + 0.5) / 4
    cfg = PPOLossConfig(behav_imp_weight_level="sequence", behav_imp_weight_cap=5.0)
    adv = t64(1.0, 1.0, 1.0, 1.0, 0.0)
    out = ppo_loss(PROX, PROX, BEHAV, adv, MASK, cfg, 4.0, seq_ids=SEQ)
    assert out.loss.item() == pytest.approx(-0.25)
    assert (out.n_tokens, out.n_kept, out.n_imp_masked) == (4, 2, 2)
    # the imp-weight stats stay the raw token weights: sum 2 + 8 + 0.5 + 1, max 8
    assert (out.imp_weight_sum, out.imp_weight_max) == pytest.approx((11.5, 8.0))
    # the default rule is AReaL's token cap: only w = 8 goes -> -(2 + 0.5 + 1) / 4
    default = ppo_loss(PROX, PROX, BEHAV, adv, MASK, PPOLossConfig(), 4.0, seq_ids=SEQ)
    assert default.loss.item() == pytest.approx(-3.5 / 4)
