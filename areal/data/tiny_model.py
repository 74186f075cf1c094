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

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase, Qwen2Config

from areal.data.tokenizer import build_char_tokenizer


@dataclass(frozen=True)
class TinyPreset:
    """Model dimensions. Calling the preset gives a `Qwen2Config` for a vocabulary size.
    Frozen and plain, so `asdict(preset)` is a stable part of cache keys."""

    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __call__(
        self, vocab_size: int, pad_token_id: int = 0, bos_token_id: int = 1, eos_token_id: int = 2
    ) -> Qwen2Config:
        return Qwen2Config(
            vocab_size=vocab_size,
            tie_word_embeddings=True,
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            use_cache=True,
            **asdict(self),
        )

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


TINY_PRESET = TinyPreset()
# ~8x the tiny preset's compute per token (4 layers of width 256, ~3.2M parameters): closer to a
# real LLM's balance of model compute against per-sample messaging, for benchmarks on a CPU.
SMALL_PRESET = TinyPreset(
    hidden_size=256, num_hidden_layers=4, intermediate_size=768, max_position_embeddings=512
)
PRESETS: dict[str, TinyPreset] = {"tiny": TINY_PRESET, "small": SMALL_PRESET}


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
