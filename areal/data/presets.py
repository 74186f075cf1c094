"""The built-in model presets (dimensions only). A leaf without torch or transformers, so the
launcher can name a preset and find its cached warm start without importing them (seconds of
start-up on a 2-core machine); `areal.data.tiny_model` builds the models."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Qwen2Config


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
        from transformers import Qwen2Config  # here: the presets themselves import no torch

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
