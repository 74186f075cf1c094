"""The built-in tiny model: a Qwen2-architecture causal LM over the character tokenizer.

Invariants:
- Same architecture family as real Qwen2/Qwen2.5 checkpoints, so every engine path (KV cache,
  weight loading by name, tied embeddings) is exercised exactly as with a real model.
- `build_tiny_model(out_dir, seed)` is deterministic in `seed` (same weights, same bytes of
  safetensors) and writes a complete Hugging Face model directory: `config.json`,
  `generation_config.json`, `model.safetensors`, tokenizer files. It loads with
  `AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`.
- `vocab_size` equals the tokenizer's size; pad/bos/eos ids in the config match the tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase, Qwen2Config

from areal.data.presets import PRESETS, SMALL_PRESET, TINY_PRESET, TinyPreset
from areal.data.tokenizer import build_char_tokenizer

__all__ = [
    "PRESETS",
    "SMALL_PRESET",
    "TINY_PRESET",
    "TinyPreset",
    "build_tiny_model",
    "tiny_config",
]


def tiny_config(
    tokenizer: PreTrainedTokenizerBase, preset: TinyPreset = TINY_PRESET
) -> Qwen2Config:
    """The preset's config sized for `tokenizer` (special-token ids taken from it)."""
    return preset(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_tiny_model(out_dir: str | Path, seed: int = 0, preset: TinyPreset = TINY_PRESET) -> Path:
    """Write a randomly initialised tiny model (weights from `seed`) plus the character
    tokenizer to `out_dir` (created if missing). Returns `out_dir` as a Path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    config = tiny_config(tokenizer, preset)
    # The generator only affects this model's init: other torch users see no RNG change.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
