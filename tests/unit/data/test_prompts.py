"""Prompt rendering (chat template, system prompt, template, format) and stop token ids."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from areal.data.prompts import FORMAT_INSTRUCTIONS, PromptBuilder, PromptSettings, stop_token_ids
from areal.data.tasks import TaskItem
from areal.data.tokenizer import build_char_tokenizer

# A ChatML template like SmolLM2's and Qwen2's, on the character tokenizer (no files needed).
CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _chat_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = CHATML
    return tok


ITEM = TaskItem(0, "2+3=", "5", {"topic": "sums"})


def test_plain_defaults_leave_the_tiny_models_prompts_unchanged():
    tok = build_char_tokenizer()
    b = PromptBuilder(PromptSettings(), tok)
    assert b.text(ITEM) == "2+3="
    assert b.ids(ITEM) == tok.encode("2+3=", add_special_tokens=False)


def test_chat_template_system_prompt_template_and_format():
    s = PromptSettings(system_prompt="Be brief.", template="Q ({topic}): {prompt}", format="boxed")
    text = PromptBuilder(s, _chat_tokenizer()).text(ITEM)
    user = f"Q (sums): 2+3=\n\n{FORMAT_INSTRUCTIONS['boxed']}"
    assert text == f"<|system|>Be brief.\n<|user|>{user}\n<|assistant|>"


def test_chat_template_off_and_required():
    assert (
        PromptBuilder(PromptSettings(chat_template="off"), _chat_tokenizer()).text(ITEM) == "2+3="
    )
    with pytest.raises(ValueError, match="has no chat template"):
        PromptBuilder(PromptSettings(chat_template="on"), build_char_tokenizer())
    with pytest.raises(ValueError, match="system_prompt is set but no chat template"):
        PromptBuilder(PromptSettings(system_prompt="x"), build_char_tokenizer())


def test_template_errors_are_clear():
    with pytest.raises(ValidationError, match="no \\{prompt\\} placeholder"):
        PromptSettings(template="Solve it")
    with pytest.raises(ValidationError, match="not a valid format string"):
        PromptSettings(template="{prompt")
    b = PromptBuilder(PromptSettings(template="{prompt} {missing}"), build_char_tokenizer())
    with pytest.raises(ValueError, match="uses \\{missing\\}, which this task does not have"):
        b.text(ITEM)


def test_stop_ids_eos_generation_config_and_extra(tmp_path):
    tok = build_char_tokenizer()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    ids = stop_token_ids(tok, tmp_path, ["\n"])
    assert ids == (tok.eos_token_id, 5, tok.convert_tokens_to_ids("\n"))
    assert stop_token_ids(tok, tmp_path / "absent") == (tok.eos_token_id,)


def test_multi_token_stop_string_fails_with_its_pieces(tmp_path):
    with pytest.raises(ValueError, match="is 2 tokens"):
        stop_token_ids(build_char_tokenizer(), tmp_path, ["ab"])
