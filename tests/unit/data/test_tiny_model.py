"""Tiny model: a loadable Hugging Face directory, deterministic in its seed."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from areal.data.tiny_model import TINY_PRESET, build_tiny_model


def test_preset_is_a_config_factory():
    config = TINY_PRESET(vocab_size=104)
    assert isinstance(config, Qwen2Config)
    assert config.vocab_size == 104 and config.tie_word_embeddings
    assert config.hidden_size % config.num_attention_heads == 0
    assert config.num_attention_heads % config.num_key_value_heads == 0


def test_build_writes_a_loadable_model_dir(tmp_path):
    out = build_tiny_model(tmp_path / "m", seed=0)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id == 2
    assert model.config.pad_token_id == tok.pad_token_id == 0
    ids = torch.tensor([tok.encode("12+3=")])
    logits = model(ids).logits  # [1, T, V]
    assert logits.shape == (1, 5, len(tok))


def test_build_is_deterministic_in_seed(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=1) / "model.safetensors"
    b = build_tiny_model(tmp_path / "b", seed=1) / "model.safetensors"
    c = build_tiny_model(tmp_path / "c", seed=2) / "model.safetensors"
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
