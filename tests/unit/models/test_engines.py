"""The torch engines on real architectures: the imported SmolLM2 (Llama) and random Qwen2 /
Llama / Mistral models with SmolLM2's tokenizer, built through `areal.engines.factory`.

Each case runs one `generate` (stop ids = the tokenizer's eos), checks that the trainer's
log-probs of those samples equal the rollout's behaviour log-probs (same weights, float32: a
packing or attention bug shows up as a mismatch), runs one `train_step` and hands the new
weights back to the inference engine, as the trainer and rollout workers do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from areal.data.tokenizer import load_tokenizer
from areal.engines.base import GenRequest, SamplingParams, TrainSeq, WeightUpdate
from areal.engines.config import InferenceEngineConfig, TrainEngineConfig
from areal.engines.factory import make_inference_engine, make_train_engine
from areal.engines.torch_infer import weights_from_safetensors

QUESTIONS = ("What is 2+3?", "What is the capital of France?")


def chat_prompts(tok) -> list[list[int]]:
    out = []
    for q in QUESTIONS:
        enc = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return out


def generate_then_train(model_dir: Path, attn_implementation: str = "varlen") -> dict:
    tok = load_tokenizer(model_dir)
    prompts = chat_prompts(tok)
    infer = make_inference_engine(
        InferenceEngineConfig(kind="torch", model_path=str(model_dir), max_batch_size=4)
    )
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    outs = infer.generate([GenRequest(f"q{i}", p) for i, p in enumerate(prompts)], params=params)
    for o in outs:
        assert 1 <= len(o.output_ids) <= 12 and len(o.behav_logp) == len(o.output_ids)
        assert o.versions == [0] * len(o.output_ids)
        assert all(lp <= 0.0 for lp in o.behav_logp)
        assert (o.finish_reason == "stop") == (o.output_ids[-1] == tok.eos_token_id)

    train = make_train_engine(
        TrainEngineConfig(
            kind="torch",
            model_path=str(model_dir),
            lr=1e-4,
            attn_implementation=attn_implementation,
        )
    )
    seqs = [
        TrainSeq(
            prompt_ids=torch.tensor(p),
            output_ids=torch.tensor(o.output_ids),
            behav_logp=torch.tensor(o.behav_logp),
            versions=torch.tensor(o.versions),
            adv=adv,
        )
        for p, o, adv in zip(prompts, outs, (1.0, -1.0), strict=True)
    ]
    # Both sequences are packed into one row: each must see only its own tokens.
    for lp, o in zip(train.compute_logp(seqs, max_tokens_per_mb=4096), outs, strict=True):
        torch.testing.assert_close(lp, torch.tensor(o.behav_logp), atol=1e-4, rtol=0)
    before = {k: v.clone() for k, v in train.model.state_dict().items()}
    stats = train.train_step(seqs, max_tokens_per_mb=4096)
    assert train.version == 1 and stats["n_microbatches"] == 1.0
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    changed = [k for k, v in train.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "train_step changed no weight"

    infer.load_weights(WeightUpdate(1, weights_from_safetensors(train.export_safetensors())))
    after = infer.generate([GenRequest("again", prompts[0])], params=params)[0]
    assert infer.version == 1 and set(after.versions) == {1}
    return {"tok": tok, "outs": outs}


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
def test_random_models_generate_and_train(random_dirs, arch):
    generate_then_train(random_dirs[arch])


def test_random_mistral_with_sdpa_attention(random_dirs):
    # HF's own sdpa path keeps packed sequences apart too (block-diagonal mask from the
    # restarting position ids): the same checks hold with it.
    generate_then_train(random_dirs["mistral"], attn_implementation="sdpa")


# ~25-40 s on a 2-core CPU: a 135M-parameter forward/backward and AdamW step in float32.
@pytest.mark.slow
def test_imported_smollm2_generates_answers_and_trains(smol_dir):
    got = generate_then_train(smol_dir)
    tok, outs = got["tok"], got["outs"]
    # A real instruct model answers these greedily in a few tokens and ends with <|im_end|>.
    assert [o.finish_reason for o in outs] == ["stop", "stop"]
    answers = [tok.decode(o.output_ids, skip_special_tokens=True) for o in outs]
    assert "5" in answers[0] and "Paris" in answers[1], answers
