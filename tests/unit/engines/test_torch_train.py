"""TorchTrainEngine: packed log-probs, PPO steps, export into the inference engine, checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from areal.algo.loss import PPOLossConfig
from areal.engines.base import GenRequest, SamplingParams, TrainSeq, WeightUpdate
from areal.engines.config import TrainEngineConfig
from areal.engines.torch_infer import weights_from_safetensors
from areal.engines.torch_train import TorchTrainEngine
from tests.unit.engines.helpers import (
    full_entropy,
    full_logp,
    infer_engine,
    random_prompts,
    train_engine,
)

SHAPES = [(3, 5), (7, 2), (1, 9), (4, 4), (2, 1), (5, 6)]  # (prompt, output) lengths


def make_seqs(shapes=SHAPES, seed: int = 1, adv: float = 1.0) -> list[TrainSeq]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, t in shapes:
        out.append(
            TrainSeq(
                prompt_ids=torch.randint(1, 32, (p,), generator=g),
                output_ids=torch.randint(1, 32, (t,), generator=g),
                behav_logp=torch.zeros(t),
                versions=torch.zeros(t, dtype=torch.long),
                adv=adv,
            )
        )
    return out


def with_behav(engine: TorchTrainEngine, seqs: list[TrainSeq]) -> list[TrainSeq]:
    """On-policy samples: behaviour log-probs = current log-probs."""
    for s, lp in zip(seqs, engine.compute_logp(seqs, 1), strict=True):
        s.behav_logp = lp.clone()
    return seqs


@pytest.mark.parametrize(
    "packing,attn",
    [("ffd", "varlen"), ("ffd", "sdpa"), ("ffd", "eager"), ("fixed", "varlen"), ("fixed", "sdpa")],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logp_equals_each_sequence_alone(model_dir, ref_model, packing, attn, temperature):
    eng = train_engine(
        model_dir,
        packing=packing,
        fixed_mb_size=4,
        temperature=temperature,
        attn_implementation=attn,
    )
    seqs = make_seqs()
    logps = eng.compute_logp(seqs, max_tokens_per_mb=30)  # several sequences per micro-batch
    for s, lp in zip(seqs, logps, strict=True):
        expected = full_logp(ref_model, s.prompt_ids.tolist(), s.output_ids.tolist(), temperature)
        torch.testing.assert_close(lp, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("share_prompts", [False, True])
def test_varlen_attention_really_splits_segments(model_dir, monkeypatch, share_prompts):
    from areal.engines import varlen_attn

    seen = []
    orig = varlen_attn.varlen_sdpa_forward

    def spy(*args, **kwargs):
        seen.append((kwargs.get("areal_seg_lens"), kwargs.get("areal_blocks")))
        return orig(*args, **kwargs)

    eng = train_engine(model_dir, share_prompts=share_prompts)
    monkeypatch.setitem(
        __import__("transformers").AttentionInterface._global_mapping, varlen_attn.NAME, spy
    )
    eng.compute_logp(make_seqs(), 1000)
    assert len(seen) == 2  # one packed row (FFD order: longest first), two layers
    by_length = sorted(SHAPES, key=lambda pt: -sum(pt))
    if share_prompts:  # distinct prompts: one block of one completion each
        assert seen[0] == (None, [(p, (t,)) for p, t in by_length])
    else:
        assert seen[0] == ([p + t for p, t in by_length], None)


def grouped_seqs(n_groups: int = 3, g: int = 4, seed: int = 5) -> list[TrainSeq]:
    """GRPO-shaped: `n_groups` prompts, each with `g` completions of different lengths (one
    empty), advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n_groups):
        prompt = torch.randint(1, 32, (3 + 2 * k,), generator=gen)
        for i in range(g):
            t = (k + i) % 5  # 0..4 tokens
            out.append(
                TrainSeq(
                    prompt_ids=prompt.clone(),
                    output_ids=torch.randint(1, 32, (t,), generator=gen),
                    behav_logp=torch.zeros(t),
                    versions=torch.zeros(t, dtype=torch.long),
                    adv=float(i % 3 - 1),
                )
            )
    return out


def test_shared_prompts_give_each_sequence_alone(model_dir, ref_model):
    """A group's prompt runs once per row: log-probs are each sequence's own, and a PPO step
    lands on the same weights as without sharing, while the row is shorter."""
    temperature = 0.7
    shared = train_engine(model_dir, lr=1e-2, temperature=temperature, n_minibatches=2)
    plain = train_engine(
        model_dir, lr=1e-2, temperature=temperature, n_minibatches=2, share_prompts=False
    )
    seqs = grouped_seqs()
    for s, lp in zip(seqs, shared.compute_logp(seqs, 1000), strict=True):
        expected = full_logp(ref_model, s.prompt_ids.tolist(), s.output_ids.tolist(), temperature)
        torch.testing.assert_close(lp, expected, atol=1e-5, rtol=0)
    a = shared.train_step(with_behav(shared, grouped_seqs()), max_tokens_per_mb=1000)
    b = plain.train_step(with_behav(plain, grouped_seqs()), max_tokens_per_mb=1000)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    # Adam's first step is ~lr * sign(grad): a gradient entry near 0 that differs by rounding
    # moves its weight by a fraction of lr (1e-2); 1e-4 still catches any wrong gradient
    for pa, pb in zip(shared.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_explicit_block_mask_path_equals_builtin(model_dir, attn):
    eng = train_engine(model_dir, attn_implementation=attn)
    seqs = make_seqs()
    builtin = eng.compute_logp(seqs, 64)
    eng.fwd.builtin_packed = False  # the path taken on transformers < 5
    explicit = eng.compute_logp(seqs, 64)
    for a, b in zip(builtin, explicit, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("prox_logp", ["recompute", "loglinear"])
@pytest.mark.parametrize("decoupled", [True, False])
def test_positive_adv_raises_logp(model_dir, prox_logp, decoupled):
    eng = train_engine(
        model_dir,
        lr=1e-2,
        prox_logp=prox_logp,
        loss_cfg=PPOLossConfig(decoupled=decoupled),
        n_minibatches=2,
    )
    seqs = with_behav(eng, make_seqs())
    before = torch.cat(eng.compute_logp(seqs, 64)).sum()
    stats = eng.train_step(seqs, max_tokens_per_mb=20)
    after = torch.cat(eng.compute_logp(seqs, 64)).sum()
    assert after > before
    assert eng.version == 1
    assert stats["n_tokens"] == sum(t for _, t in SHAPES)
    assert stats["tokens"] == sum(p + t for p, t in SHAPES)
    assert stats["padding_frac"] == 0.0
    assert stats["n_microbatches"] >= 2
    assert stats["loss"] == pytest.approx(-1.0, abs=0.05)  # ~on-policy, adv 1: -mean(ratio * A)
    for key in ("grad_norm", "lr", "time_s", "clipfrac", "behav_imp_weight_mean"):
        assert key in stats
    assert stats["approx_kl"] >= 0.0  # k3 is >= 0 token by token
    assert 0.0 < stats["entropy"] <= math.log(32)  # vocab 32: at most the uniform entropy


@pytest.mark.parametrize("packing", ["ffd", "fixed"])
def test_train_step_entropy_and_k3_kl_are_those_of_the_forward(model_dir, ref_model, packing):
    """One minibatch, on-policy: ``entropy`` is the mean over all output tokens of the entropy of
    softmax(logits / T) under the pre-step weights, and k3 ``approx_kl`` against the recomputed
    proximal policy (= those same weights) is 0."""
    temperature = 0.7
    eng = train_engine(
        model_dir, lr=1e-2, temperature=temperature, packing=packing, fixed_mb_size=4
    )
    seqs = with_behav(eng, make_seqs())
    expected = torch.cat(
        [
            full_entropy(ref_model, s.prompt_ids.tolist(), s.output_ids.tolist(), temperature)
            for s in seqs
        ]
    ).mean()
    stats = eng.train_step(seqs, max_tokens_per_mb=20)
    assert stats["entropy"] == pytest.approx(float(expected), abs=1e-5)
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert stats["clipfrac"] == 0.0


def test_config_of_another_kind_is_refused(model_dir):
    with pytest.raises(ValueError, match="kind 'torch'"):
        TorchTrainEngine(TrainEngineConfig(kind="deepspeed", model_path=model_dir, lr=1e-3))


def test_negative_adv_lowers_logp_and_fixed_packing_reports_padding(model_dir):
    eng = train_engine(model_dir, lr=1e-2, packing="fixed", fixed_mb_size=3)
    seqs = with_behav(eng, make_seqs(adv=-1.0))
    before = torch.cat(eng.compute_logp(seqs, 64)).sum()
    stats = eng.train_step(seqs, max_tokens_per_mb=20)
    assert torch.cat(eng.compute_logp(seqs, 64)).sum() < before
    assert stats["n_microbatches"] == 2 and 0.0 < stats["padding_frac"] < 1.0


def test_micro_batch_split_does_not_change_the_step(model_dir):
    """Gradient accumulation over micro-batches = one big batch (same denominator)."""
    a = train_engine(model_dir, lr=1e-2)
    b = train_engine(model_dir, lr=1e-2)
    seqs = with_behav(a, make_seqs())
    sa = a.train_step(seqs, max_tokens_per_mb=1000)
    sb = b.train_step(make_seqs_like(seqs), max_tokens_per_mb=12)
    assert sa["n_microbatches"] == 1 and sb["n_microbatches"] > 1
    assert sa["loss"] == pytest.approx(sb["loss"], abs=1e-5)
    assert sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=1e-4)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=1e-4)  # the accumulated grads


def test_first_minibatch_proximal_policy_is_its_own_forward(model_dir):
    """`train_step` recomputes prox_logp only for the minibatches after the first: the first
    one's proximal policy is the weights before any update, which its own training forward
    already evaluates. The loss and gradient equal those of a separately recomputed prox."""
    from areal.engines.torch_train import microbatch_loss

    eng = train_engine(model_dir, lr=1e-2)
    cfg = PPOLossConfig(decoupled=True)
    seqs = make_seqs()  # off-policy: behaviour log-probs 0, so the behaviour weights matter
    for s, lp in zip(seqs, eng.compute_logp(seqs, 64), strict=True):
        s.prox_logp = lp
    denom = float(sum(len(s.output_ids) for s in seqs))
    grads = []
    for mode in ("recompute", "current"):
        eng.optimizer.zero_grad(set_to_none=True)
        out = microbatch_loss(eng.fwd, seqs, cfg, mode, eng.version, denom, eng.device)
        out.loss.backward()
        grads.append((out.loss.detach(), [p.grad.clone() for p in eng.model.parameters()]))
    (loss_r, grad_r), (loss_c, grad_c) = grads
    torch.testing.assert_close(loss_c, loss_r, atol=1e-6, rtol=1e-5)
    for gc, gr in zip(grad_c, grad_r, strict=True):
        torch.testing.assert_close(gc, gr, atol=1e-6, rtol=1e-4)
    # and train_step runs the extra no-grad forward over the later minibatch only
    eng2 = train_engine(model_dir, n_minibatches=2)
    counted: list[int] = []
    real = eng2.compute_logp
    eng2.compute_logp = lambda ss, n: counted.append(len(ss)) or real(ss, n)
    eng2.train_step(make_seqs(), 64)
    assert counted == [len(SHAPES) - len(SHAPES) // 2]


def make_seqs_like(seqs: list[TrainSeq]) -> list[TrainSeq]:
    return [
        TrainSeq(s.prompt_ids, s.output_ids, s.behav_logp.clone(), s.versions, s.adv) for s in seqs
    ]


def test_export_round_trip_into_inference_engine(model_dir, tmp_path):
    train = train_engine(model_dir, lr=1e-2)
    train.train_step(with_behav(train, make_seqs()), 64)
    blob = train.export_safetensors()
    state = weights_from_safetensors(blob)
    assert set(state) == set(train.model.state_dict())

    infer = infer_engine(model_dir)
    infer.load_weights(WeightUpdate(version=train.version, state_dict=state))
    assert infer.version == 1
    prompt = random_prompts([4])[0]
    out = infer.generate([GenRequest("a", prompt)], params=SamplingParams(max_new_tokens=6))[0]
    seq = TrainSeq(
        torch.tensor(prompt), torch.tensor(out.output_ids), torch.zeros(6), torch.zeros(6), 0.0
    )
    torch.testing.assert_close(
        train.compute_logp([seq], 64)[0], torch.tensor(out.behav_logp), atol=1e-4, rtol=0
    )


def test_save_pretrained_is_loadable_and_keeps_tokenizer_files(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    train = train_engine(model_dir, lr=1e-2)
    train.train_step(with_behav(train, make_seqs()), 64)
    dst = tmp_path / "hf"
    train.save_pretrained(str(dst))
    train.save_pretrained(str(dst))  # overwrite in place
    assert json.loads((dst / "tokenizer_config.json").read_text()) == {}
    assert "areal_varlen" not in (dst / "config.json").read_text()  # loadable without our attention
    reloaded = AutoModelForCausalLM.from_pretrained(dst, local_files_only=True).eval()
    s = make_seqs()[0]
    expected = full_logp(reloaded, s.prompt_ids.tolist(), s.output_ids.tolist())
    torch.testing.assert_close(train.compute_logp([s], 64)[0], expected, atol=1e-5, rtol=0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_checkpoint_round_trip_resumes_identically(model_dir, tmp_path):
    ckpt = str(tmp_path / "ckpt" / "state.pt")
    a = train_engine(model_dir, lr=1e-2)
    a.train_step(with_behav(a, make_seqs()), 64)
    a.save_checkpoint(ckpt)
    seqs2 = make_seqs(seed=2, adv=-0.5)
    with_behav(a, seqs2)
    sa = a.train_step(make_seqs_like(seqs2), 64)

    b = train_engine(model_dir, lr=1e-2)
    b.load_checkpoint(ckpt)
    assert b.version == 1
    sb = b.train_step(make_seqs_like(seqs2), 64)  # needs the restored Adam moments to match
    assert a.version == b.version == 2
    assert sa["loss"] == pytest.approx(sb["loss"], abs=1e-6)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-7, rtol=0)
    assert [p.name for p in Path(ckpt).parent.iterdir()] == ["state.pt"]


def test_snapshot_written_after_more_training_is_the_snapshot_time_state(model_dir, tmp_path):
    """The trainer writes checkpoints in the background while the next step trains: what lands
    must be the state at snapshot time, not the live tensors."""
    ckpt = str(tmp_path / "state.pt")
    a = train_engine(model_dir, lr=1e-2)
    a.train_step(with_behav(a, make_seqs()), 64)
    snap = a.snapshot_checkpoint()
    at_snapshot = [p.detach().clone() for p in a.model.parameters()]
    a.train_step(with_behav(a, make_seqs(seed=2, adv=-0.5)), 64)  # moves params and Adam moments
    a.write_checkpoint(snap, ckpt)

    b = train_engine(model_dir, lr=1e-2)
    b.load_checkpoint(ckpt)
    assert b.version == 1 and a.version == 2
    for pb, p0 in zip(b.model.parameters(), at_snapshot, strict=True):
        torch.testing.assert_close(pb, p0, atol=0, rtol=0)
    step_a = a.optimizer.state_dict()["state"][0]["step"]
    step_b = b.optimizer.state_dict()["state"][0]["step"]
    assert float(step_b) == float(step_a) - 1  # the Adam moments are the snapshot's too


def test_missing_checkpoint_is_a_clear_error(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train_engine(model_dir).load_checkpoint(str(tmp_path / "nope.pt"))


def test_the_staleness_aware_step_scales_the_lr_by_the_data_lag(model_dir):
    # algo.lr_lag_decay 0.5: a step at engine version 0 on fresh data steps at lr; two steps
    # later, data generated at version 0 (lag 2 on every token) steps at lr / (1 + 0.5 * 2)
    eng = train_engine(model_dir, lr=1e-2, loss_cfg=PPOLossConfig(lr_lag_decay=0.5))
    assert eng.train_step(with_behav(eng, make_seqs()), 64)["lr"] == pytest.approx(1e-2)
    eng.train_step(with_behav(eng, make_seqs()), 64)
    stale = with_behav(eng, make_seqs())  # versions stay 0: two versions old now
    assert eng.version == 2
    assert eng.train_step(stale, 64)["lr"] == pytest.approx(1e-2 / 2)
    # off (the default): the configured lr whatever the lag
    plain = train_engine(model_dir, lr=1e-2)
    plain.version = 3
    assert plain.train_step(with_behav(plain, make_seqs()), 64)["lr"] == pytest.approx(1e-2)
