"""Character tokenizer: exact round trips, fixed special ids, no implicit special tokens."""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from areal.data.tokenizer import build_char_tokenizer, char_vocab, load_tokenizer

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
