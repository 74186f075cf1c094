"""Character-level tokenizer in Hugging Face format, for the built-in tiny model.

Invariants:
- One token per character. Ids 0-3 are `<pad>`, `<bos>`, `<eos>`, `<unk>`; then digits, ASCII
  letters, space, newline, punctuation, and the remaining ASCII whitespace (tab, CR, VT, FF).
  The order is fixed forever (a saved model's embedding rows depend on it): extend only by
  appending.
- `decode(encode(text)) == text` for every printable-ASCII text, before and after a
  `save_pretrained` / `load_tokenizer` round trip (also inside a model dir whose config.json
  names an architecture; see the last invariant). Characters outside the vocab
  become `<unk>`. Text that spells a special token (`"<eos>"`) encodes as its characters
  (`split_special_tokens=True`, saved in tokenizer_config.json).
- Encoding never adds special tokens: there is no post-processor, so `tok(text)["input_ids"]`
  and `tok.encode(text)` (whatever `add_special_tokens` says) are exactly the characters of
  `text`. Prompts are encoded as-is (no BOS); a completion ends with `eos_token_id`.
- `load_tokenizer(dir)` loads the tokenizer the directory ships, never one implied by the model:
  when the dir has a `tokenizer.json`, that file IS the tokenizer, and it is loaded with the
  generic fast class (`PreTrainedTokenizerFast`), so its normalizer, pre-tokenizer, model,
  post-processor and decoder are the file's verbatim (`loaded_pipeline(tok) ==
  file_pipeline(dir)`); special tokens and the chat template come from
  `tokenizer_config.json` / `chat_template.jinja` as usual. Only a dir without a
  `tokenizer.json` (slow, e.g. sentencepiece-only, tokenizers) goes through `AutoTokenizer`.
  Why: transformers >= 5 picks the class from `config.json`'s `model_type` (qwen2 ->
  `Qwen2Tokenizer`, overriding `tokenizer_config.json`) and that class rebuilds the pipeline
  from its own defaults; on the char tokenizer of a Qwen2-architecture model it dropped every
  space ("9 4 3:" encoded as "943:", issue 17).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)

# Everything `string.printable` has, in a fixed, readable order.
_CHARS: tuple[str, ...] = tuple(
    string.digits
    + string.ascii_lowercase
    + string.ascii_uppercase
    + " \n"
    + string.punctuation
    + "\t\r\x0b\x0c"
)


def char_vocab() -> dict[str, int]:
    """Token -> id. Special tokens first (pad=0, bos=1, eos=2, unk=3), then characters."""
    tokens = list(SPECIAL_TOKENS) + list(_CHARS)
    assert len(set(tokens)) == len(tokens), "duplicate characters in the char vocab"
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer (no files needed; same result every call)."""
    backend = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK))
    # Split before the model sees anything: every character (newlines included) is its own
    # "word", so WordLevel maps it to one id; nothing is normalised or stripped.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins the per-token strings with no separator (WordLevel's default adds spaces).
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        # Text that merely spells "<eos>" is five characters, never the special token: special
        # ids come only from code (e.g. appending eos_token_id), so any text round-trips.
        split_special_tokens=True,
        model_max_length=1 << 20,
    )
    tok.padding_side = "right"
    return tok


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer a local model directory ships (never touches the network).

    A `tokenizer.json` is loaded verbatim with `PreTrainedTokenizerFast` (module Invariants);
    a directory without one goes through `AutoTokenizer`."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory {path} does not exist; build one with "
            "areal.data.tiny_model.build_tiny_model or point to a Hugging Face model dir"
        )
    if (path / TOKENIZER_FILE).is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    # AutoTokenizer imports torch (through the model configs): only here, so a worker that just
    # tokenizes a tokenizer.json (the controller) starts without torch
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


TOKENIZER_FILE = "tokenizer.json"
_PIPELINE_PARTS = ("normalizer", "pre_tokenizer", "model", "post_processor", "decoder")


def file_pipeline(path: str | Path) -> dict[str, Any]:
    """The tokenization pipeline stored in `path/tokenizer.json` (normalizer, pre-tokenizer,
    model, post-processor, decoder), as JSON data."""
    raw = json.loads(Tokenizer.from_file(str(Path(path) / TOKENIZER_FILE)).to_str())
    return {part: raw.get(part) for part in _PIPELINE_PARTS}


def loaded_pipeline(tok: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The pipeline a loaded fast tokenizer actually runs, comparable with `file_pipeline`."""
    raw = json.loads(tok.backend_tokenizer.to_str())
    return {part: raw.get(part) for part in _PIPELINE_PARTS}
