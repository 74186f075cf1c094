"""Token-exact tool turns: prompt ids + the model's ids + the wrapper ids of each tool result
are the chat template of the whole conversation, token for token; the model's ids are never
re-tokenized (a stream built from re-tokenized text drifts: verl #3720, #6719)."""

from __future__ import annotations

import pytest

from areal.tools.chat_ids import TemplateNotAppendOnly, template_ids, tool_turn_ids

# (what the model says, the tool results it gets back); the last turn is the answer
TURNS = [
    ('<tool_call>{"name": "calc", "arguments": {"expression": "37*41"}}</tool_call>', ["1517"]),
    (
        "Two more.\n<tool_call>a</tool_call><tool_call>b</tool_call>",
        ["error: timed out after 5s", "line 1\nline 2\n"],  # two calls in one turn
    ),
    ("Now the sum: <tool_call>c</tool_call>", ["  1522 "]),
    ("The answer is 1522.", None),
]


def hf_template(tok, messages, *, add_generation_prompt):
    """`apply_chat_template` as Hugging Face tokenizes it (the reference, not our helper)."""
    out = tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def episode(tok, eot, *, model_ids=None):
    """Build the stream by appending ids only; check it against the template at every tool turn.
    `model_ids(text)` are the ids the model samples for a turn's text (default: canonical)."""
    model_ids = model_ids or (lambda text: tok.encode(text, add_special_tokens=False))
    messages = [{"role": "user", "content": "What is 37*41+5? Use the tools."}]
    stream = template_ids(tok, messages, add_generation_prompt=True)
    assert stream == hf_template(tok, messages, add_generation_prompt=True)
    for text, results in TURNS:
        stream += model_ids(text) + [eot]  # the model's turn, ending with its stop token
        messages.append({"role": "assistant", "content": text})
        if results is None:
            break
        tools = [{"role": "tool", "content": r} for r in results]
        stream += tool_turn_ids(tok, messages, tools, end_of_turn_id=eot)
        messages += tools
        yield list(stream), list(messages)
    yield list(stream), list(messages)


@pytest.fixture(params=["smollm2", "char"])
def chat(request):
    if request.param == "smollm2":
        tok = request.getfixturevalue("smol_tokenizer")
        return tok, tok.convert_tokens_to_ids("<|im_end|>")
    tok = request.getfixturevalue("char_chat_tokenizer")
    return tok, tok.encode("\n")[0]


def test_the_stream_is_the_template_of_the_conversation(chat):
    tok, eot = chat
    checked = 0
    *tool_turns, (final, messages) = list(episode(tok, eot))
    for stream, msgs in tool_turns:  # after each tool turn: the template, next header included
        assert stream == hf_template(tok, msgs, add_generation_prompt=True)
        checked += 1
    assert checked == 3
    # after the answer, the template only closes the turn (SmolLM2: "\n" after <|im_end|>)
    whole = hf_template(tok, messages, add_generation_prompt=False)
    assert whole[: len(final)] == final and len(whole) - len(final) <= 1


def test_the_smollm2_wrapper_is_what_the_template_writes(smol_tokenizer):
    tok = smol_tokenizer
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<tool_call>x</tool_call>"},
    ]
    ids = tool_turn_ids(tok, messages, [{"role": "tool", "content": "1517"}])
    assert tok.decode(ids) == "\n<|im_start|>tool\n1517<|im_end|>\n<|im_start|>assistant\n"
    # a turn that a stop string ended before <|im_end|>: the wrapper closes it first
    ids = tool_turn_ids(tok, messages, [{"role": "tool", "content": "1"}], ended_turn=False)
    assert tok.decode(ids).startswith("<|im_end|>\n<|im_start|>tool\n1")


def non_canonical(tok, text):
    """`text`'s ids with one token split in two (a split a model can sample: both pieces are
    in the vocabulary), so decoding gives `text` back but encoding that gives other ids."""
    ids = tok.encode(text, add_special_tokens=False)
    vocab = tok.get_vocab()
    for i, piece in enumerate(tok.convert_ids_to_tokens(ids)):
        for cut in range(1, len(piece)):
            a, b = piece[:cut], piece[cut:]
            if a in vocab and b in vocab:
                return ids[:i] + [vocab[a], vocab[b]] + ids[i + 1 :]
    raise AssertionError(f"no token of {text!r} splits into two vocabulary tokens")


def test_model_ids_are_never_retokenized(smol_tokenizer):
    tok = smol_tokenizer
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    sampled = {text: non_canonical(tok, text) for text, _ in TURNS}
    for text, ids in sampled.items():  # the drift a re-tokenizing rollout would introduce
        assert tok.decode(ids) == text
        assert tok.encode(tok.decode(ids), add_special_tokens=False) != ids
    *_, (stream, messages) = list(episode(tok, eot, model_ids=sampled.__getitem__))
    *_, (canonical, _) = list(episode(tok, eot))
    # The stream holds the sampled ids where the model spoke and the template's ids elsewhere:
    # walk the canonical stream, replacing each turn's canonical ids by the sampled ones.
    expected, pos = [], 0
    for text, _ in TURNS:
        canon = tok.encode(text, add_special_tokens=False)
        at = canonical.index(canon[0], pos)
        while canonical[at : at + len(canon)] != canon:
            at = canonical.index(canon[0], at + 1)
        expected += canonical[pos:at] + sampled[text]
        pos = at + len(canon)
    expected += canonical[pos:]
    assert stream == expected
    # and re-tokenizing the decoded stream would not give what the model saw
    text = tok.decode(stream, skip_special_tokens=False)
    assert tok.encode(text, add_special_tokens=False) != stream


def test_a_template_that_rewrites_history_is_refused(char_chat_tokenizer):
    tok = char_chat_tokenizer
    # drops the content of every assistant turn but the last (as templates that strip past
    # reasoning do): adding a message changes an earlier turn
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|a|>\n"
        "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "think"}]
    with pytest.raises(TemplateNotAppendOnly, match="changes earlier turns"):
        tool_turn_ids(
            tok,
            messages,
            [{"role": "tool", "content": "1"}],
            end_of_turn_id=tok.encode("\n")[0],
            chat_template=template,
        )


def test_bad_calls(char_chat_tokenizer):
    tok = char_chat_tokenizer
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ValueError, match="does not end the assistant turn with token 2"):
        tool_turn_ids(tok, messages, [{"role": "tool", "content": "1"}])  # eos: not in it
    with pytest.raises(ValueError, match="must end with the model's assistant turn"):
        tool_turn_ids(tok, messages[:1], [{"role": "tool", "content": "1"}])
