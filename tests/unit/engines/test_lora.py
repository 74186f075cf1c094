"""LoRA (`areal.engines.lora`): the torch trainer trains and publishes only the adapter, the
wire form survives the weights stream, and the torch rollout engine applies it in place, also
mid-sample, with log-probs equal to a plain forward of the merged model."""

from __future__ import annotations

import pytest
import torch

from areal.engines.base import GenRequest, SamplingParams, WeightUpdate
from areal.engines.config import LoraSpec, TrainEngineConfig
from areal.engines.lora import (
    ADAPTER_KEY,
    inject_lora,
    merged_state_dict,
    meta_of,
    set_lora_dropout,
)
from areal.engines.weights_check import WeightsMismatch
from tests.unit.engines.helpers import (
    full_logp,
    infer_engine,
    random_prompts,
    tiny_model,
    train_engine,
)
from tests.unit.engines.test_torch_train import make_seqs

pytest.importorskip("peft")

SPEC = LoraSpec(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


def lora_trainer(model_dir: str, seed: int = 0):
    eng = train_engine(model_dir, lr=1e-2, lora=SPEC, seed=seed)
    with torch.no_grad():  # a nonzero B, so the adapter changes the function from step 0
        for name, p in eng.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed + len(name)))
    return eng


def merged_model(model_dir: str, adapter: dict[str, torch.Tensor]):
    """A plain HF model with `adapter` merged in: the reference forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    meta = meta_of(adapter)
    sd = model.state_dict()
    sd.update({k: v for k, v in adapter.items() if k != ADAPTER_KEY})
    model.load_state_dict(merged_state_dict(sd, meta.alpha / meta.r), strict=False)
    return model


def test_only_the_adapter_trains_and_is_published(model_dir):
    eng = lora_trainer(model_dir)
    trainable = {n for n, p in eng.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    base = {n: p.detach().clone() for n, p in eng.model.named_parameters() if not p.requires_grad}
    before = eng.export_state_dict()
    eng.train_step(make_seqs(seed=3), 64)
    after = eng.export_state_dict()
    for n, p in eng.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base[n]), n  # the base never moves
    names = set(after) - {ADAPTER_KEY}
    # 2 layers x 3 modules x (A, B), under the plain model's module names
    assert len(names) == 12 and "model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert any(not torch.equal(before[k], after[k]) for k in names)
    meta = meta_of(after)
    assert (meta.r, meta.alpha, set(meta.target_modules)) == (4, 8.0, set(SPEC.target_modules))
    # the trainer's log-probs are those of the merged model
    seqs = make_seqs(seed=4)
    ref = merged_model(model_dir, after)
    for s, lp in zip(seqs, eng.compute_logp(seqs, 64), strict=True):
        want = full_logp(ref, s.prompt_ids.tolist(), s.output_ids.tolist())
        torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)


def test_the_adapter_survives_the_wire_in_bf16(model_dir):
    from areal.engines.weights_stream import SafetensorsSink, export_blob

    eng = lora_trainer(model_dir)
    blob = export_blob(eng, "bfloat16")
    sink = SafetensorsSink(blob.nbytes)
    for chunk in blob.chunks():
        sink.write(chunk)
    got = sink.state_dict()
    assert got[ADAPTER_KEY].dtype == torch.uint8  # the metadata is not cast
    assert meta_of(got) == eng.adapter_meta
    assert got["model.layers.1.mlp.down_proj.lora_B.weight"].dtype == torch.bfloat16
    infer_engine(model_dir).load_weights(WeightUpdate(version=1, state_dict=got))


@pytest.mark.parametrize("max_batch_size", [8, 2])
def test_a_mid_sample_adapter_switch_matches_a_forward_under_the_new_adapter(
    model_dir, max_batch_size
):
    k = 4
    first = lora_trainer(model_dir, seed=1).export_state_dict()
    second = lora_trainer(model_dir, seed=2).export_state_dict()
    ref1, ref2 = merged_model(model_dir, first), merged_model(model_dir, second)
    updates = {2: WeightUpdate(version=1, state_dict=first)}
    updates[k + 1] = WeightUpdate(version=2, state_dict=second)
    calls = []

    def poll():
        calls.append(1)
        return updates.get(len(calls))  # call 2 precedes token 1, call k + 1 token k

    prompts = random_prompts([3, 6, 2], seed=5)
    eng = infer_engine(model_dir, max_batch_size=max_batch_size)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    reqs = [GenRequest(key=f"r{i}", prompt_ids=p) for i, p in enumerate(prompts)]
    outs = eng.generate(reqs, params=params, poll_weights=poll)
    assert eng.version == 2
    if max_batch_size < len(prompts):  # the third row only starts after the second switch
        late = outs.pop()
        assert late.versions == [2] * 10 and late.n_interrupts == 0
        torch.testing.assert_close(
            torch.tensor(late.behav_logp),
            full_logp(ref2, prompts[2], late.output_ids),
            atol=1e-4,
            rtol=0,
        )
        prompts = prompts[:2]
    base = tiny_model(seed=0)
    for p, o in zip(prompts, outs, strict=True):
        assert o.versions == [0] + [1] * (k - 1) + [2] * (10 - k)
        assert o.n_interrupts == 2
        behav = torch.tensor(o.behav_logp)
        for ref, lo, hi in ((base, 0, 1), (ref1, 1, k), (ref2, k, 10)):
            # the second adapter replaces the first (from the pristine base), never adds to it
            want = full_logp(ref, p, o.output_ids)[lo:hi]
            torch.testing.assert_close(behav[lo:hi], want, atol=1e-4, rtol=0)


def test_full_weights_after_an_adapter_are_the_new_base(model_dir):
    from areal.engines.torch_train import export_state_dict

    eng = infer_engine(model_dir)
    eng.load_weights(WeightUpdate(1, lora_trainer(model_dir, seed=1).export_state_dict()))
    full = export_state_dict(tiny_model(seed=0))
    eng.load_weights(WeightUpdate(2, full))
    got = eng.model.state_dict()
    assert all(torch.equal(got[n], full[n]) for n in full)


def test_an_adapter_for_another_base_or_shape_is_refused(model_dir, tmp_path):
    other = tmp_path / "other"
    tiny_model(seed=123).save_pretrained(other)
    foreign = lora_trainer(str(other)).export_state_dict()
    eng = infer_engine(model_dir)
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    with pytest.raises(WeightsMismatch, match="another base model"):
        eng.load_weights(WeightUpdate(version=1, state_dict=foreign))
    bad = dict(lora_trainer(model_dir).export_state_dict())
    bad["model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 3)
    with pytest.raises(WeightsMismatch, match="q_proj"):
        eng.load_weights(WeightUpdate(version=1, state_dict=bad))
    nan = dict(lora_trainer(model_dir).export_state_dict())
    nan["model.layers.0.self_attn.v_proj.lora_B.weight"][0, 0] = float("nan")
    with pytest.raises(WeightsMismatch, match="NaN"):
        eng.load_weights(WeightUpdate(version=1, state_dict=nan))
    assert eng.version == 0
    assert all(torch.equal(v, before[k]) for k, v in eng.model.state_dict().items())


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), 1e38])
def test_an_adapter_with_bad_alpha_is_refused_and_the_live_weights_stay_finite(model_dir, alpha):
    from dataclasses import replace

    good = lora_trainer(model_dir).export_state_dict()
    bad = dict(good)
    bad[ADAPTER_KEY] = replace(meta_of(good), alpha=alpha).to_tensor()
    eng = infer_engine(model_dir)
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    with pytest.raises(WeightsMismatch, match="alpha"):
        eng.load_weights(WeightUpdate(version=1, state_dict=bad))
    assert eng.version == 0
    assert all(torch.equal(v, before[k]) for k, v in eng.model.state_dict().items())


def test_checkpoint_holds_the_adapter_and_final_holds_merged_and_adapter(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    eng = lora_trainer(model_dir)
    eng.train_step(make_seqs(seed=3), 64)
    eng.save_checkpoint(str(tmp_path / "ckpt.pt"))
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["model"] and all(".lora_" in k for k in state["model"])
    eng.train_step(make_seqs(seed=5), 64)
    want = eng.export_state_dict()
    resumed = lora_trainer(model_dir, seed=9)
    resumed.load_checkpoint(str(tmp_path / "ckpt.pt"))
    resumed.train_step(make_seqs(seed=5), 64)
    got = resumed.export_state_dict()
    assert all(torch.allclose(got[k].float(), want[k].float(), atol=1e-6) for k in want)
    with pytest.raises(ValueError, match="LoRA adapter"):
        train_engine(model_dir).load_checkpoint(str(tmp_path / "ckpt.pt"))

    eng.save_pretrained(str(tmp_path / "final"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final", local_files_only=True)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True),
        tmp_path / "final" / "adapter",
    ).eval()
    ref = merged_model(model_dir, want)
    prompt, output = [1, 5, 7], [3, 9, 2, 4]
    for model in (merged.eval(), peft):
        torch.testing.assert_close(
            full_logp(model, prompt, output), full_logp(ref, prompt, output), atol=1e-5, rtol=0
        )


def test_train_lora_settings_reach_the_engine_config_and_zero3_is_refused():
    from pydantic import ValidationError

    from areal.config import TrainSettings

    t = TrainSettings(lora={"r": 8, "target_modules": ["q_proj"]})
    spec = LoraSpec(**t.lora.model_dump())
    assert (spec.r, spec.alpha, spec.target_modules, spec.scaling) == (8, 32.0, ("q_proj",), 4.0)
    assert TrainSettings().lora is None  # off by default
    assert TrainSettings(engine="deepspeed", zero_stage=2, lora={}).lora is not None
    with pytest.raises(ValidationError, match="needs train.zero_stage 1 or 2"):
        TrainSettings(engine="deepspeed", zero_stage=3, lora={})
    with pytest.raises(ValueError, match="lora on deepspeed needs zero_stage 1 or 2"):
        TrainEngineConfig(kind="deepspeed", model_path="m", lr=1e-3, zero_stage=3, lora=spec)
    with pytest.raises(ValidationError):
        TrainSettings(lora={"r": 0})
    with pytest.raises(ValueError, match="nope_proj"):
        inject_lora(tiny_model(0), LoraSpec(target_modules=("nope_proj",)))
    with pytest.raises(ValueError, match="tied"):  # merging into it would change the embedding
        inject_lora(tiny_model(0), LoraSpec(target_modules=("q_proj", "lm_head")))
    with pytest.raises(ValueError, match="not a linear layer"):
        inject_lora(tiny_model(0), LoraSpec(target_modules=("embed_tokens",)))


def test_train_lora_goes_with_either_rollout_engine(tmp_path):
    from areal.config import load_settings

    (tmp_path / "config.json").write_text("{}")
    for engine in ("torch", "vllm"):
        s = load_settings(
            None, [f"model.path={tmp_path}", f"rollout.engine={engine}", "train.lora.r=8"]
        )
        assert s.train.lora is not None and s.train.lora.r == 8


def test_lora_dropout_acts_in_the_loss_forward_only(model_dir):
    eng = train_engine(model_dir, lr=1e-2, lora=LoraSpec(r=4, dropout=0.5))
    drops = [m for n, m in eng.model.named_modules() if n.endswith("lora_dropout.default")]
    assert drops and not any(m.training for m in drops)
    seqs = make_seqs(seed=4)
    first = eng.compute_logp(seqs, 64)
    eng.train_step(make_seqs(seed=3), 64)
    assert not any(m.training for m in drops)  # off again after the step
    again, twice = eng.compute_logp(seqs, 64), eng.compute_logp(seqs, 64)
    for a, b in zip(again, twice, strict=True):
        assert torch.equal(a, b)  # no dropout noise in compute_logp
    assert len(first) == len(again)
    set_lora_dropout(eng.model, True)  # what train_step turns on around its loss forwards
    noisy = [eng.fwd.logp(seqs) for _ in range(2)]
    set_lora_dropout(eng.model, False)
    assert not all(torch.equal(a, b) for a, b in zip(*noisy, strict=True))
