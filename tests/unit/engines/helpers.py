"""Shared helpers for the engine tests: a tiny random Qwen2 and an independent log-prob."""

from __future__ import annotations

import torch


def tiny_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )


def tiny_model(seed: int):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_config()).eval()


def full_logp(
    model, prompt: list[int], output: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """log_softmax(logits / T) of each output token from one plain forward over prompt + output."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [T, V], position p predicts p + 1
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 32, (n,), generator=g).tolist() for n in lengths]


def full_entropy(model, prompt: list[int], output: list[int], temperature: float = 1.0):
    """Entropy (nats) of softmax(logits / T) at each output position, from one plain forward."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [T, V]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return -(logprobs.exp() * logprobs).sum(dim=-1)  # [T]


def infer_engine(model_dir: str, **kw):
    """A TorchInferenceEngine on `model_dir`; `kw` are InferenceEngineConfig fields."""
    from areal.engines.config import InferenceEngineConfig
    from areal.engines.torch_infer import TorchInferenceEngine

    return TorchInferenceEngine(InferenceEngineConfig(kind="torch", model_path=model_dir, **kw))


def train_engine(model_dir: str, **kw):
    """A TorchTrainEngine on `model_dir`; `kw` are TrainEngineConfig fields (lr 1e-4 unless
    given)."""
    from areal.engines.config import TrainEngineConfig
    from areal.engines.torch_train import TorchTrainEngine

    kw.setdefault("lr", 1e-4)
    return TorchTrainEngine(TrainEngineConfig(kind="torch", model_path=model_dir, **kw))


def generate_episodes(
    engine, prompts: list[list[int]], *, turns: int = 3, max_new_tokens: int = 5, temperature=1.0
):
    """Multi-turn episodes of `prompts` on a real inference engine: each turn generates from
    the prompt and the episode so far (all episodes decode together), then the environment
    answers with a few fixed tokens (what a tool's output would be, never trained). Returns
    one `Episode` per prompt."""
    from areal.engines.base import GenRequest, SamplingParams
    from areal.workflows.api import Episode, Generation, Segment

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    episodes = [Episode(segments=[], finish_reason="stop", n_turns=turns) for _ in prompts]
    for turn in range(turns):
        reqs = [
            GenRequest(f"e{i}#{turn}", p + [t for s in ep.segments for t in s.ids])
            for i, (p, ep) in enumerate(zip(prompts, episodes, strict=True))
        ]
        outs = engine.generate(reqs, params=params)
        for i, (ep, out) in enumerate(zip(episodes, outs, strict=True)):
            gen = Generation(out.output_ids, out.behav_logp, out.versions, out.finish_reason)
            ep.segments.append(Segment.model(gen))
            if turn < turns - 1:  # the environment answers between turns
                ep.segments.append(Segment.env([3 + i, 7, 11 + turn, 2][: 2 + turn]))
    return episodes


def episode_sample(prompt: list[int], ep, *, sample_idx: int = 0, group_size: int = 1):
    """The `Sample` a rollout publishes for an episode: the segments' tokens in order, model
    tokens with their log-probs and versions, environment tokens with 0.0 / -1 and mask 0."""
    from areal.bus.codec import pack
    from schemas import Sample

    segs = ep.segments
    mask = [int(s.trained) for s in segs for _ in s.ids]
    return Sample(
        task_id="run-t0",
        task_seq=0,
        sample_idx=sample_idx,
        group_size=group_size,
        prompt_ids=pack(prompt, "int32"),
        output_ids=pack([t for s in segs for t in s.ids], "int32"),
        behav_logp=pack([x for s in segs for x in s.behav_logp], "float32"),
        versions=pack([v for s in segs for v in s.versions], "int32"),
        loss_mask=None if all(mask) else pack(mask, "uint8"),
        finish_reason=ep.finish_reason,
        n_turns=ep.n_turns,
    )
