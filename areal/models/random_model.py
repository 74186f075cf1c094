"""Randomly initialised models of real architectures (Qwen2, Llama, Mistral) with a real
tokenizer: what tests and benchmarks use to run every engine path against a real vocabulary
and chat template without downloading weights.

Invariants:
- `build_random_model(out_dir, ...)` writes a complete HF dir (config, generation config,
  safetensors, the tokenizer of `tokenizer_dir` as `load_tokenizer` reads it) that loads with
  `AutoModelForCausalLM.from_pretrained` and `areal.data.tokenizer.load_tokenizer`.
- The config's `vocab_size` is `len(tokenizer)`, and its bos/eos/pad ids (and the generation
  config's) are the tokenizer's; a tokenizer without a pad token pads with eos.
- Deterministic in `seed`: same arguments, same weights; other torch users see no RNG change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from areal.data.tokenizer import load_tokenizer

__all__ = ["ARCHS", "build_random_model"]

ARCHS = ("qwen2", "llama", "mistral")


def build_random_model(
    out_dir: str | Path,
    *,
    arch: Literal["qwen2", "llama", "mistral"] = "qwen2",
    tokenizer_dir: str | Path,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a random `arch` model (tied embeddings; `head_dim` None = hidden_size // heads,
    `intermediate_size` None = 2 * hidden_size) with the tokenizer of `tokenizer_dir` to
    `out_dir` (created if missing). Returns `out_dir` as a Path."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    configs = {"qwen2": Qwen2Config, "llama": LlamaConfig, "mistral": MistralConfig}
    if arch not in configs:
        raise ValueError(f"arch must be one of {list(ARCHS)}, got {arch!r}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim is None and hidden_size % heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be a multiple of heads ({heads}), or pass head_dim"
        )
    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {tokenizer_dir} has no eos token; pick another dir")
    pad_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    ids = {
        "pad_token_id": pad_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    config = configs[arch](
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden_size // heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        use_cache=True,
        **ids,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, value in ids.items():
        setattr(model.generation_config, name, value)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
