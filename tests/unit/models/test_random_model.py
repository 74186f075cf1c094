"""Random Qwen2 / Llama / Mistral models with a real tokenizer (SmolLM2's): config ids and sizes
match the tokenizer, the tokenizer is loaded as shipped, weights are deterministic in the seed."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal.data.tokenizer import file_pipeline, load_tokenizer, loaded_pipeline
from areal.models import build_random_model

CLASSES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
def test_config_matches_the_real_tokenizer(random_dirs, smol_dir, arch):
    path = random_dirs[arch]
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == CLASSES[arch] and model.config.model_type == arch
    assert model.config.vocab_size == len(tok) == 49152
    assert (
        tok.eos_token == "<|im_end|>"
        and tok.chat_template == load_tokenizer(smol_dir).chat_template
    )
    for cfg in (model.config, model.generation_config):
        assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
            tok.bos_token_id,
            tok.eos_token_id,
            tok.pad_token_id,
        )
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    # the tokenizer runs exactly what tokenizer.json says, whatever config.json's model_type
    assert loaded_pipeline(tok) == file_pipeline(path) == file_pipeline(smol_dir)


def test_auto_tokenizer_would_swap_the_class_for_qwen2(random_dirs):
    # Why load_tokenizer exists (issue 17): for a qwen2 config, transformers >= 5 ignores
    # tokenizer_config.json and builds Qwen2Tokenizer with its own pipeline.
    path = random_dirs["qwen2"]
    auto = AutoTokenizer.from_pretrained(str(path))
    if type(auto).__name__ != "Qwen2Tokenizer":
        pytest.skip(f"this transformers loads {type(auto).__name__}: the override is gone")
    assert loaded_pipeline(auto) != file_pipeline(path)
    assert type(load_tokenizer(path)).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")


def test_same_seed_same_weights_other_seed_differs(smol_dir, tmp_path):
    def weights(name, seed):
        path = build_random_model(tmp_path / name, arch="llama", tokenizer_dir=smol_dir, seed=seed)
        return load_file(path / "model.safetensors")

    a, b, c = weights("a", 7), weights("b", 7), weights("c", 8)
    assert a.keys() == b.keys() == c.keys()
    assert all((a[k] == b[k]).all() for k in a)
    assert not (
        a["model.layers.0.self_attn.q_proj.weight"] == c["model.layers.0.self_attn.q_proj.weight"]
    ).all()


def test_head_dim_and_sizes(smol_dir, tmp_path):
    path = build_random_model(
        tmp_path / "m",
        arch="qwen2",
        tokenizer_dir=smol_dir,
        hidden_size=48,
        layers=1,
        heads=6,
        kv_heads=3,
        head_dim=16,
        intermediate_size=80,
    )
    config = json.loads((path / "config.json").read_text())
    assert (config["head_dim"], config["num_key_value_heads"], config["intermediate_size"]) == (
        16,
        3,
        80,
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (3 * 16, 48)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, "arch must be one of"),
        ({"heads": 4, "kv_heads": 3}, "multiple of kv_heads"),
        ({"hidden_size": 50, "heads": 4}, "multiple of heads"),
    ],
)
def test_bad_arguments_name_the_fix(smol_dir, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_random_model(tmp_path / "m", tokenizer_dir=smol_dir, **kwargs)
