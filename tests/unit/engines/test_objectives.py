"""The objective and the normaliser of `algo.loss` / `algo.loss_norm` through the torch engine:
ppo through the registry is today's loss bit for bit, sequence-level objectives and per-sample
normalisers do not depend on the micro-batching, and a user's `pkg.mod:fn` trains."""

from __future__ import annotations

import textwrap

import pytest
import torch

from areal.algo.loss import PPOLossConfig
from areal.engines.torch_train import loss_tokens, microbatch_loss, minibatch_normaliser
from tests.unit.engines.helpers import train_engine
from tests.unit.engines.test_torch_train import (
    SHAPES,
    make_seqs,
    make_seqs_like,
    with_behav,
)


def test_ppo_through_the_registry_is_todays_loss_bit_for_bit(model_dir):
    eng = train_engine(model_dir)
    seqs = make_seqs()  # off-policy (behaviour log-probs 0): weights and clipping matter
    cfg = PPOLossConfig()
    results = []
    for denom in (loss_tokens(seqs), minibatch_normaliser(seqs, cfg)):
        eng.optimizer.zero_grad(set_to_none=True)
        out = microbatch_loss(eng.fwd, seqs, cfg, "current", 0, denom, eng.device)
        out.loss.backward()
        results.append((out, [p.grad.clone() for p in eng.model.parameters()]))
    (a, ga), (b, gb) = results
    assert torch.equal(a.loss, b.loss) and a.clip_count == b.clip_count
    assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))


@pytest.mark.parametrize(
    ("loss", "loss_norm"),
    [("gspo", "token"), ("gspo", "sequence"), ("ppo", "sequence"), ("ppo", "constant")],
)
def test_micro_batch_split_does_not_change_the_step(model_dir, loss, loss_norm):
    cfg = PPOLossConfig(loss=loss, loss_norm=loss_norm, loss_norm_tokens=10)
    a = train_engine(model_dir, lr=1e-2, loss_cfg=cfg)
    b = train_engine(model_dir, lr=1e-2, loss_cfg=cfg)
    seqs = make_seqs()  # off-policy, so GSPO's sequence ratios are not all 1
    sa = a.train_step(seqs, max_tokens_per_mb=1000)
    sb = b.train_step(make_seqs_like(seqs), max_tokens_per_mb=12)
    assert sa["n_microbatches"] == 1 and sb["n_microbatches"] > 1
    assert sa["loss"] == pytest.approx(sb["loss"], abs=1e-5)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    ("loss_norm", "expected"), [("token", -1.0), ("sequence", -1.0), ("constant", -27 / 60)]
)
def test_on_policy_losses_under_each_normaliser(model_dir, loss_norm, expected):
    # on-policy, A = 1: every token loss is -1. token: -27 / 27; sequence: mean over 6 samples
    # of their mean -1; constant (Dr. GRPO, L = 10): -27 / (6 samples * 10) = -0.45
    assert sum(t for _, t in SHAPES) == 27 and len(SHAPES) == 6
    cfg = PPOLossConfig(loss_norm=loss_norm, loss_norm_tokens=10)
    eng = train_engine(model_dir, loss_cfg=cfg, n_minibatches=1)
    stats = eng.train_step(with_behav(eng, make_seqs()), max_tokens_per_mb=20)
    assert stats["loss"] == pytest.approx(expected, abs=1e-4)


def test_a_user_loss_trains_through_the_engine(model_dir, tmp_path, monkeypatch):
    (tmp_path / "my_engine_loss.py").write_text(
        textwrap.dedent(
            """
            def reinforce(inp, cfg):
                # -A * logp over loss tokens, divided by the normaliser
                return -(inp.adv * inp.logp * inp.mask).sum() / inp.loss_denominator
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    eng = train_engine(model_dir, lr=1e-2, loss_cfg=PPOLossConfig(loss="my_engine_loss:reinforce"))
    seqs = with_behav(eng, make_seqs())
    before = torch.cat(eng.compute_logp(seqs, 64)).sum()
    stats = eng.train_step(seqs, max_tokens_per_mb=20)
    assert torch.cat(eng.compute_logp(seqs, 64)).sum() > before  # A = 1 raises log-probs
    assert stats["n_tokens"] == 27 and stats["clipfrac"] == 0.0
