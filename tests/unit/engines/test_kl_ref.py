"""KL to a frozen reference on the torch engine: no reference model unless `kl_coef` > 0; the
reference holds the initial weights, so the KL is exactly 0 before the first update and grows
once the policy moves; `kl_ref` is in the step stats."""

from __future__ import annotations

import pytest
import torch

from areal.algo.loss import PPOLossConfig
from areal.engines.torch_train import microbatch_loss, minibatch_normaliser
from tests.unit.engines.helpers import train_engine
from tests.unit.engines.test_torch_train import make_seqs


def test_no_reference_model_when_kl_is_off(model_dir):
    eng = train_engine(model_dir)
    assert eng.ref_fwd is None


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_to_the_reference_is_exactly_zero_before_the_first_update(model_dir, estimator):
    cfg = PPOLossConfig(kl_coef=0.5, kl_estimator=estimator)
    eng = train_engine(model_dir, lr=5e-2, loss_cfg=cfg, n_minibatches=1)
    assert eng.ref_fwd is not None
    assert not any(p.requires_grad for p in eng.ref_fwd.model.parameters())
    seqs = make_seqs()
    out = microbatch_loss(
        eng.fwd,
        seqs,
        cfg,
        "current",
        0,
        minibatch_normaliser(seqs, cfg),
        eng.device,
        ref_fwd=eng.ref_fwd,
    )
    assert out.kl_ref_sum == 0.0  # exactly: same weights, same forward
    stats = eng.train_step(make_seqs(), max_tokens_per_mb=20)
    assert stats["kl_ref"] == 0.0  # step 1 is computed on the weights before its update
    stats = eng.train_step(make_seqs(), max_tokens_per_mb=20)
    assert stats["kl_ref"] != 0.0
    if estimator != "k1":
        assert stats["kl_ref"] > 0.0


def test_the_reference_stays_frozen(model_dir):
    cfg = PPOLossConfig(kl_coef=0.5)
    eng = train_engine(model_dir, lr=5e-2, loss_cfg=cfg)
    before = [p.detach().clone() for p in eng.ref_fwd.model.parameters()]
    eng.train_step(make_seqs(), max_tokens_per_mb=20)
    after = list(eng.ref_fwd.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    moved = any(
        not torch.equal(p, q)
        for p, q in zip(eng.model.parameters(), eng.ref_fwd.model.parameters(), strict=True)
    )
    assert moved
