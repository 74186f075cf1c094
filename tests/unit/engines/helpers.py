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
