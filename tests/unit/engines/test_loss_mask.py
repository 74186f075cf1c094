"""The loss mask of multi-turn episodes in the torch train engine, on real generated episodes
(the tiny Qwen2, the torch inference engine, environment tokens appended between turns):
environment tokens get exactly zero gradient, whatever log-probs they carry; the loss is the
decoupled-PPO loss over model tokens only, divided by the number of model tokens (checked
against a plain loop); every stat is over model tokens; and the trainer's recomputed log-probs
of model tokens equal the behaviour log-probs of the same weights."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from areal.algo.loss import PPOLossConfig
from areal.bus.codec import decode, encode
from areal.core.intake import Group
from areal.engines.base import TrainSeq
from areal.engines.torch_train import check_seqs, loss_tokens, microbatch_loss
from areal.services.batches import to_train_seqs
from schemas import Sample, ScoredSample
from tests.unit.engines.helpers import (
    episode_sample,
    full_entropy,
    full_logp,
    generate_episodes,
    infer_engine,
    random_prompts,
    train_engine,
)

PROMPT_LENS = [3, 6, 2, 5]
REWARDS = [1.0, 0.0, 0.25, 0.5]  # GRPO advantages all non-zero: every model token has a gradient
TEMPERATURE = 0.7
CFG = PPOLossConfig()


def wire_seqs(prompts, episodes) -> list[TrainSeq]:
    """The episodes as the trainer gets them: `Sample`s through the codec, a scored group,
    `to_train_seqs`."""
    group: Group[None] = Group(task_id="run-t0", task_seq=0)
    for i, (p, ep) in enumerate(zip(prompts, episodes, strict=True)):
        s = episode_sample(p, ep, sample_idx=i, group_size=len(prompts))
        group.samples[i] = ScoredSample(sample=decode(encode(s), Sample), reward=REWARDS[i])
    return to_train_seqs([group], [REWARDS])  # GRPO advantages (the default)


@pytest.fixture(scope="module")
def episodes(model_dir):
    prompts = random_prompts(PROMPT_LENS, seed=5)
    engine = infer_engine(model_dir, max_batch_size=8, seed=3)
    eps = generate_episodes(engine, prompts, turns=3, max_new_tokens=5, temperature=TEMPERATURE)
    return prompts, eps


@pytest.fixture
def seqs(episodes) -> list[TrainSeq]:
    return wire_seqs(*episodes)  # fresh objects: a train step fills their prox_logp


def unmasked(seqs: list[TrainSeq]) -> list[TrainSeq]:
    return [replace(s, loss_mask=None) for s in seqs]


def test_the_wire_carries_the_episode_into_the_train_seqs(episodes, seqs):
    prompts, eps = episodes
    for s, ep in zip(seqs, eps, strict=True):
        want = [seg.trained for seg in ep.segments for _ in seg.ids]
        assert s.loss_mask is not None and s.loss_mask.tolist() == want
        assert not all(want) and any(want)
        env = ~s.loss_mask
        assert (s.versions[env] == -1).all() and (s.behav_logp[env] == 0.0).all()
        assert (s.versions[~env] == 0).all() and (s.behav_logp[~env] < 0).all()
    assert s.n_loss_tokens() == int(s.loss_mask.sum()) < len(s.output_ids)


def test_recomputed_logp_of_model_tokens_equals_the_behaviour_logp(model_dir, ref_model, seqs):
    """Same weights (version 0) as the generation: the trainer's log-probs of the model tokens
    are the ones recorded while generating, and it returns log-probs of every output token
    (environment tokens too: a plain forward's)."""
    eng = train_engine(model_dir, temperature=TEMPERATURE)
    lps = eng.compute_logp(seqs, 16)  # several micro-batches
    worst = 0.0
    for s, lp in zip(seqs, lps, strict=True):
        assert lp.shape == s.output_ids.shape
        m = s.loss_mask
        worst = max(worst, float((lp[m] - s.behav_logp[m]).abs().max()))
        plain = full_logp(ref_model, s.prompt_ids.tolist(), s.output_ids.tolist(), TEMPERATURE)
        torch.testing.assert_close(lp, plain, atol=1e-5, rtol=0)
    print(f"torch engine: max |recomputed - behav| over model tokens {worst:.2e}")
    assert worst <= 1e-5


def _logits_grad(eng, seqs: list[TrainSeq]) -> torch.Tensor:
    """d(loss)/d(logits) `[K, V]` of one micro-batch of `seqs` (rows: their output tokens in
    order); on-policy (prox = this forward), so no model token is clipped out of the gradient."""
    captured: list[torch.Tensor] = []

    def keep(_module, _inputs, out):
        out.retain_grad()
        captured.append(out)

    handle = eng.model.lm_head.register_forward_hook(keep)
    try:
        out = microbatch_loss(eng.fwd, seqs, CFG, "current", 0, loss_tokens(seqs), eng.device)
        out.loss.backward()
    finally:
        handle.remove()
    (logits,) = captured
    return logits.grad[0]  # [K, V]


def test_environment_tokens_get_exactly_zero_gradient(model_dir, seqs):
    eng = train_engine(model_dir, temperature=TEMPERATURE)
    mask = torch.cat([s.loss_mask for s in seqs])  # [K]
    grad = _logits_grad(eng, seqs)
    assert (grad[~mask] == 0).all()  # exactly: not one bit of gradient
    assert (grad[mask].abs().sum(-1) > 0).all()  # every model token has one
    # without the mask (what the engine did before), the same tokens do get gradient
    eng.optimizer.zero_grad(set_to_none=True)
    grad_all = _logits_grad(eng, unmasked(seqs))
    assert (grad_all[~mask].abs().sum(-1) > 0).all()


def _param_grads(eng, seqs: list[TrainSeq]) -> dict[str, torch.Tensor]:
    eng.optimizer.zero_grad(set_to_none=True)
    out = microbatch_loss(eng.fwd, seqs, CFG, "current", 0, loss_tokens(seqs), eng.device)
    out.loss.backward()
    return {n: p.grad.clone() for n, p in eng.model.named_parameters() if p.grad is not None}


def _env_poked(seqs: list[TrainSeq], value: float, versions: int = 10**6) -> list[TrainSeq]:
    """Copies whose environment tokens carry `value` as behaviour log-prob and a bogus version."""
    out = []
    for s in seqs:
        env = ~s.loss_mask if s.loss_mask is not None else torch.zeros_like(s.versions, dtype=bool)
        env = env | (s.versions == -1)
        behav, vers = s.behav_logp.clone(), s.versions.clone()
        behav[env], vers[env] = value, versions
        out.append(replace(s, behav_logp=behav, versions=vers))
    return out


def test_what_environment_tokens_carry_changes_no_gradient(model_dir, seqs):
    eng = train_engine(model_dir, temperature=TEMPERATURE)
    base = _param_grads(eng, seqs)
    for value in (-3.0, -1e4, math.nan, math.inf):
        poked = _param_grads(eng, _env_poked(seqs, value))
        assert base.keys() == poked.keys()
        assert all(torch.equal(base[k], poked[k]) for k in base), value
    # the control: without the mask the environment tokens' log-probs do move the gradient
    a = _param_grads(eng, unmasked(seqs))
    b = _param_grads(eng, _env_poked(unmasked(seqs), -3.0, versions=0))
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_the_loss_is_the_mean_over_model_tokens_of_a_plain_loop(model_dir, ref_model, seqs):
    """ppo loss per model token t of a sample with advantage A (DESIGN section 5):
    u = exp(logp - prox), w = exp(prox - behav) (dropped above the cap 5),
    loss_t = -w * min(u * A, clip(u, 0.8, 1.2) * A); loss = sum over model tokens / their
    number. Environment tokens are in neither sum. Entropy is the mean over model tokens."""
    eng = train_engine(model_dir, temperature=TEMPERATURE)
    g = torch.Generator().manual_seed(1)
    total, n_model, ent_sum, clipped, kept = 0.0, 0, 0.0, 0, 0
    for s in seqs:
        prompt, out = s.prompt_ids.tolist(), s.output_ids.tolist()
        logp = full_logp(ref_model, prompt, out, TEMPERATURE)
        ent = full_entropy(ref_model, prompt, out, TEMPERATURE)
        s.prox_logp = logp + 0.4 * torch.randn(len(out), generator=g)
        s.behav_logp = torch.where(s.loss_mask, s.prox_logp - 0.3 * torch.rand(len(out)), 0.0)
        for t in range(len(out)):
            if not s.loss_mask[t]:
                continue
            n_model += 1
            ent_sum += float(ent[t])
            u = math.exp(float(logp[t]) - float(s.prox_logp[t]))
            w = math.exp(float(s.prox_logp[t]) - float(s.behav_logp[t]))
            if w > 5.0:
                continue
            kept += 1
            clip_u = min(max(u, 0.8), 1.2)
            total += -w * min(u * s.adv, clip_u * s.adv)
            clipped += int(-clip_u * s.adv > -u * s.adv)
    assert n_model == sum(s.n_loss_tokens() for s in seqs) == loss_tokens(seqs)
    out = microbatch_loss(eng.fwd, seqs, CFG, "recompute", 0, loss_tokens(seqs), eng.device)
    assert float(out.loss.detach()) == pytest.approx(total / n_model, abs=1e-5)
    assert out.n_tokens == n_model and out.n_kept == kept
    assert out.clip_count == clipped > 0  # the clipped branch took part
    assert out.entropy_sum / out.n_tokens == pytest.approx(ent_sum / n_model, abs=1e-5)


def test_a_train_step_reports_model_tokens_only(model_dir, ref_model, seqs):
    """One on-policy step (prox = the step's own forward): loss = -mean over model tokens of
    w * A, entropy over model tokens, n_tokens = model tokens; the forward still covers every
    token (`tokens`)."""
    eng = train_engine(model_dir, temperature=TEMPERATURE)
    n_model = sum(s.n_loss_tokens() for s in seqs)
    expected_loss, ent = 0.0, []
    for s in seqs:
        prompt, out = s.prompt_ids.tolist(), s.output_ids.tolist()
        logp = full_logp(ref_model, prompt, out, TEMPERATURE)[s.loss_mask]
        w = torch.exp(logp - s.behav_logp[s.loss_mask])  # ~1: the same weights generated them
        expected_loss += float((-w * s.adv).sum()) / n_model
        ent.append(full_entropy(ref_model, prompt, out, TEMPERATURE)[s.loss_mask])
    stats = eng.train_step(seqs, max_tokens_per_mb=16)
    assert stats["n_tokens"] == n_model
    assert stats["tokens"] == sum(len(s.prompt_ids) + len(s.output_ids) for s in seqs)
    assert stats["loss"] == pytest.approx(expected_loss, abs=1e-5)
    assert stats["entropy"] == pytest.approx(float(torch.cat(ent).mean()), abs=1e-5)
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert stats["behav_imp_weight_mean"] == pytest.approx(1.0, abs=1e-5)


def test_a_mask_of_the_wrong_shape_is_refused(seqs):
    bad = replace(seqs[0], loss_mask=seqs[0].loss_mask[:-1])
    with pytest.raises(ValueError, match="loss_mask"):
        check_seqs([bad])


def test_single_turn_seqs_train_as_before(model_dir, seqs):
    """A mask of all ones is no mask: the same stats and the same weights as None."""
    a = train_engine(model_dir, temperature=TEMPERATURE, lr=1e-2)
    b = train_engine(model_dir, temperature=TEMPERATURE, lr=1e-2)
    plain = unmasked(seqs)
    ones = [replace(s, loss_mask=torch.ones(len(s.output_ids), dtype=torch.bool)) for s in plain]
    sa, sb = a.train_step(plain, 16), b.train_step(ones, 16)
    assert {k: v for k, v in sa.items() if k != "time_s"} == {
        k: v for k, v in sb.items() if k != "time_s"
    }
    assert a.export_safetensors() == b.export_safetensors()
