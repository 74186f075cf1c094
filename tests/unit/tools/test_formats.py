"""Tool-call formats: calls read out of a turn's text, malformed calls reported, results
written back (the tags format within the tiny model's character vocabulary)."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal.data.tokenizer import build_char_tokenizer, char_vocab
from areal.tools import ToolCall, ToolRunner, make_format, resolve_tools
from areal.tools.formats import (
    CALL_CLOSE,
    CALL_OPEN,
    CLOSE,
    MAX_CALL_CHARS,
    MAX_JSON_DEPTH,
    ChatFormat,
    ParsedTurn,
    TagsFormat,
)
from areal.workflows.api import ToolCallRecord

TOOLS = resolve_tools(["calc", "python"])

# --- tags --------------------------------------------------------------------------------------


def test_tags_a_call_ends_the_turn():
    f = TagsFormat()
    turn = f.parse("37*41+5 is <calc>37*41+5`")
    assert turn.calls == (ToolCall("calc", "37*41+5", text="<calc>37*41+5`"),)
    assert turn.malformed is None and not turn.is_answer
    # the decoded text may drop the stop token: the workflow says the turn stopped on it
    assert f.parse("so <calc>2*3", closed=True).calls[0].arguments == "2*3"
    # the last opening is the call; earlier text (and earlier results) is the model's
    turn = f.parse("<calc>1+1`<r>2</r> then <python>print(1)`")
    assert [(c.name, c.arguments) for c in turn.calls] == [("python", "print(1)")]


def test_tags_answers_and_malformed_calls():
    f = TagsFormat()
    assert f.parse("1522").is_answer
    assert f.parse("it is <r>3</r> so 3").is_answer  # a result tag is no call
    bad = f.parse("<calc>37*41")  # the turn ended (eos, length) inside the call
    assert (
        bad.calls == ()
        and bad.malformed == "<calc> is never closed with '`' (the turn ended first)"
    )
    assert f.parse("no call here`").malformed == "'`' ends a call but no <tool> opens one"
    unknown = f.parse("<search>cats`")  # parses; the runner says unknown_tool
    assert unknown.calls[0].name == "search"
    rec = asyncio.run(ToolRunner(TOOLS).run(unknown.calls[0]))
    assert rec.error == "unknown_tool"


def test_tags_results_stay_in_the_char_vocabulary():
    f = TagsFormat()
    assert f.render_result(ToolCallRecord("calc", "37*41", "1517")) == "<r>1517</r>"
    text = f.render_result(ToolCallRecord("python", "", "café `x` ✓\n"))
    assert text == "<r>caf? 'x' ?\n</r>"  # the close char never appears in a result
    vocab = char_vocab()
    whole = (
        "37*41+5="
        + f.call_text("calc", "37*41+5")
        + f.render_result(ToolCallRecord("calc", "37*41+5", "error: timed out after 5s"))
    )
    assert all(ch in vocab for ch in whole)
    tok = build_char_tokenizer()
    assert tok.decode(tok.encode(whole)) == whole and tok.unk_token_id not in tok.encode(whole)


def test_tags_stop_token():
    f = TagsFormat()
    tok = build_char_tokenizer()
    assert f.stop_strings() == (CLOSE,)
    assert f.stop_token_ids(tok) == (char_vocab()[CLOSE],)


# --- chat --------------------------------------------------------------------------------------


def chat_call(obj) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


def test_chat_calls():
    f = ChatFormat(TOOLS)
    text = (
        "Let me compute.\n"
        + chat_call({"name": "calc", "arguments": {"expression": "37*41"}})
        + chat_call({"name": "python", "arguments": {"code": "print(1)"}})
    )
    turn = f.parse(text)
    assert [(c.name, c.arguments, c.bad_arguments) for c in turn.calls] == [
        ("calc", "37*41", None),
        ("python", "print(1)", None),
    ]
    assert turn.calls[0].text.startswith("<tool_call>") and turn.malformed is None
    assert f.parse("The answer is 1517.").is_answer


@pytest.mark.parametrize(
    ("arguments", "expected", "bad"),
    [
        ({"expression": "1+1"}, "1+1", False),
        ({"expr": "1+1"}, "1+1", False),  # one string under another key
        ("1+1", "1+1", False),  # the model wrote a string
        ('{"expression": "1+1"}', "1+1", False),  # OpenAI style: the object as JSON text
        ({"expression": "1+1", "precision": 3}, None, True),
        ({"expression": 2}, None, True),
        ([1, 2], None, True),
    ],
)
def test_chat_arguments(arguments, expected, bad):
    call = ChatFormat(TOOLS).parse(chat_call({"name": "calc", "arguments": arguments})).calls[0]
    assert (call.bad_arguments is not None) == bad
    if bad:
        assert call.bad_arguments.startswith('calc takes {"expression": "<text>"}')
        rec = asyncio.run(ToolRunner(TOOLS).run(call))
        assert rec.error == "bad_arguments"
    else:
        assert call.arguments == expected


def test_chat_unknown_tool_keeps_the_json():
    call = ChatFormat(TOOLS).parse(chat_call({"name": "search", "arguments": {"q": "x"}})).calls[0]
    assert (call.name, call.arguments, call.bad_arguments) == ("search", '{"q": "x"}', None)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("<tool_call>{'name': 'calc'}</tool_call>", "a tool call that is not JSON"),
        ('<tool_call>{"name": "calc", "arguments": {}', "<tool_call> is never closed"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'without a "name" string'),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
        ('{"name": "calc"}</tool_call>', "</tool_call> without <tool_call>"),
    ],
)
def test_chat_malformed(text, why):
    turn = ChatFormat(TOOLS).parse(text)
    assert why in turn.malformed and not turn.is_answer


def test_chat_a_good_call_before_a_malformed_one_is_kept():
    text = chat_call({"name": "calc", "arguments": {"expression": "1"}}) + "<tool_call>{oops"
    turn = ChatFormat(TOOLS).parse(text)
    assert len(turn.calls) == 1 and "never closed" in turn.malformed


def test_chat_messages_and_schema():
    f = ChatFormat(TOOLS)
    assert f.stop_strings() == ()
    assert f.tool_message(ToolCallRecord("calc", "1+1", "2")) == {
        "role": "tool",
        "name": "calc",
        "content": "2",
    }
    names = [s["function"]["name"] for s in f.tools_schema()]
    assert names == ["calc", "python"]
    assert f.parse(f.call_text("calc", {"expression": "2*2"})).calls[0].arguments == "2*2"


def test_make_format():
    assert make_format("tags").name == "tags" and make_format("chat", TOOLS).tools == TOOLS
    with pytest.raises(ValueError, match="one of tags, chat"):
        make_format("xml")


# --- hostile text: parse never raises ----------------------------------------------------------


@pytest.mark.parametrize("open_ch", ["[", "{"])
def test_chat_deep_nesting_is_malformed_not_a_recursion_error(open_ch):
    text = f"{CALL_OPEN}{open_ch * 2000}{CALL_CLOSE}"  # about 2 KB
    turn = ChatFormat(TOOLS).parse(text)
    assert turn.calls == () and f"nested over {MAX_JSON_DEPTH} deep" in turn.malformed


def test_chat_deep_nesting_inside_arguments_json_text_is_bad_arguments():
    # OpenAI style: the arguments object as a JSON string, itself nested 2000 deep
    nested = '{"expression": ' + "[" * 2000 + "]" * 2000 + "}"
    call = ChatFormat(TOOLS).parse(chat_call({"name": "calc", "arguments": nested})).calls[0]
    assert call.bad_arguments is not None and f"over {MAX_JSON_DEPTH} deep" in call.bad_arguments


def test_chat_nesting_at_the_bound_still_parses():
    args = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)  # + the call object: the bound
    text = f'{CALL_OPEN}{{"name": "search", "arguments": {args}}}{CALL_CLOSE}'
    assert ChatFormat(TOOLS).parse(text).calls[0].name == "search"
    # brackets inside strings are text, not nesting
    text = chat_call({"name": "calc", "arguments": {"expression": "[{" * 5000}})
    assert ChatFormat(TOOLS).parse(text).calls[0].arguments == "[{" * 5000


def test_chat_an_oversized_call_is_malformed():
    body = json.dumps({"name": "python", "arguments": {"code": "x" * MAX_CALL_CHARS}})
    turn = ChatFormat(TOOLS).parse(f"{CALL_OPEN}{body}{CALL_CLOSE}")
    assert turn.calls == () and f"over {MAX_CALL_CHARS} characters" in turn.malformed


_HOSTILE = st.lists(
    st.sampled_from(
        [
            CALL_OPEN,
            CALL_CLOSE,
            "[",
            "]",
            "{",
            "}",
            '"',
            "\\",
            ":",
            ",",
            "'",
            "<",
            ">",
            CLOSE,
            '"name"',
            '"arguments"',
            '"calc"',
            '"python"',
            "<calc>",
            "<r>",
            "</r>",
            "1",
            " ",
            "\\u",
            "\ud800",
            "é",
            "null",
        ]
    )
    | st.text(max_size=8)
    | st.builds(lambda ch, n: ch * n, st.sampled_from("[{"), st.sampled_from([2, 64, 65, 2000])),
    max_size=200,
).map("".join)


_CALLISH = st.builds(  # hostile text inside a call's tags, so the JSON decoder sees it
    lambda pre, body, post: f"{pre}{CALL_OPEN}{body}{CALL_CLOSE}{post}",
    _HOSTILE,
    _HOSTILE,
    _HOSTILE,
)


@pytest.mark.parametrize("fmt", ["tags", "chat", "chat-no-tools"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text() | _HOSTILE | _CALLISH, closed=st.booleans())
def test_parse_never_raises(fmt, text, closed):
    """The module's first invariant, over arbitrary and call-shaped text."""
    if fmt == "tags":
        turn = TagsFormat().parse(text, closed=closed)
    else:
        turn = ChatFormat(TOOLS if fmt == "chat" else None).parse(text)
    assert isinstance(turn, ParsedTurn)
    assert turn.malformed is None or isinstance(turn.malformed, str)
