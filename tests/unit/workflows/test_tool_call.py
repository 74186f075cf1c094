"""The `tool_call` workflow over a scripted generator (the model's turns are given, the tools
and the char tokenizer are real): the stream is the model's ids and the results' ids appended,
the mask marks the results, and every way an episode ends has its finish reason."""

from __future__ import annotations

import pytest

from areal.bus.codec import pack
from areal.config import ConfigError
from areal.data.tokenizer import build_char_tokenizer
from areal.workflows.api import ENV_VERSION, Generation
from areal.workflows.context import WorkflowContext
from areal.workflows.tool_call import ToolCall
from schemas import Task

TOK = build_char_tokenizer()
CLOSE_ID = TOK.encode("`", add_special_tokens=False)[0]


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class Scripted:
    """Each `generate` returns the next scripted turn (its text, ended by a stop or not)."""

    def __init__(self, turns: list[tuple[str, str]]) -> None:
        self.turns, self.contexts, self.caps = list(turns), [], []

    async def generate(self, context: list[int], *, max_new_tokens: int | None = None):
        self.contexts.append(list(context))
        self.caps.append(max_new_tokens)
        text, finish = self.turns.pop(0)
        out = ids(text) + ([CLOSE_ID] if text.endswith("<") is False and finish == "call" else [])
        if finish == "call":
            finish = "stop"
        if max_new_tokens is not None and len(out) > max_new_tokens:
            out, finish = out[:max_new_tokens], "length"
        n = len(out)
        return Generation(out, [-0.5] * n, [3] * n, finish)


def ctx(**kw) -> WorkflowContext:
    defaults = dict(
        decode=lambda xs: TOK.decode([x for x in xs if x != CLOSE_ID]),
        encode=ids,
        max_new_tokens=32,
        max_turns=4,
        stop_token_ids=(CLOSE_ID,),
        tokenizer=TOK,
    )
    return WorkflowContext(**(defaults | kw))


def task() -> Task:
    prompt = "37*41+5="
    return Task(
        task_id="t-1",
        seq=1,
        dataset_index=1,
        prompt=prompt,
        prompt_ids=pack(ids(prompt), "int32"),
        answer="1522",
        group_size=1,
        admitted_version=0,
    )


async def test_a_call_then_an_answer_appends_the_result_ids():
    gen = Scripted([("<calc>37*41+5", "call"), ("1522", "stop")])
    ep = await ToolCall(ctx()).arun_episode(gen, task(), 0)
    assert ep.finish_reason == "stop" and ep.n_turns == 2
    model1, env, model2 = ep.segments
    assert model1.trained and model1.ids == ids("<calc>37*41+5") + [CLOSE_ID]
    assert not env.trained and env.ids == ids("<r>1522</r>") and env.text == "<r>1522</r>"
    assert env.versions == [ENV_VERSION] * len(env.ids) and set(env.behav_logp) == {0.0}
    assert model2.ids == ids("1522")
    # the second turn saw exactly the stream so far: prompt, the call, the result
    assert gen.contexts[1] == ids("37*41+5=") + model1.ids + env.ids
    (call,) = ep.tool_calls
    assert (call.name, call.arguments, call.output, call.error) == ("calc", "37*41+5", "1522", None)


@pytest.mark.parametrize(
    ("turns", "kw", "finish"),
    [
        ([("<calc>1+1", "call")] * 2, {"max_turns": 2}, "max_turns"),
        ([("<calc>1+", "stop")], {}, "bad_tool_call"),  # opened, never closed
        ([("<calc>1/0", "call")], {"on_tool_error": "end"}, "tool_error"),
        ([("<nope>1", "call")], {"on_tool_error": "end"}, "tool_error"),  # unknown tool
        ([("<calc>" + "9" * 30, "call")], {"max_episode_tokens": 20}, "max_episode_tokens"),
        ([("<calc>" + "9" * 30, "call")], {}, "bad_tool_call"),  # cut by the turn cap
        ([("<calc>99*99", "call")], {"max_episode_tokens": 14}, "max_episode_tokens"),  # result
        ([("1" * 40, "length")], {"max_episode_tokens": 10}, "max_episode_tokens"),
        ([("1" * 40, "length")], {}, "length"),  # the turn's own cap
    ],
)
async def test_every_way_an_episode_ends_is_named(turns, kw, finish):
    wf_kw = {k: kw.pop(k) for k in ("on_tool_error",) if k in kw}
    gen = Scripted(turns)
    ep = await ToolCall(ctx(**kw), **wf_kw).arun_episode(gen, task(), 0)
    assert ep.finish_reason == finish
    assert ep.n_tokens <= ctx(**kw).episode_budget()


async def test_a_tool_error_is_fed_back_by_default():
    gen = Scripted([("<calc>1/0", "call"), ("?", "stop")])
    ep = await ToolCall(ctx()).arun_episode(gen, task(), 0)
    assert ep.finish_reason == "stop" and ep.tool_calls[0].error is not None
    assert ep.segments[1].text.startswith("<r>") and "error" in ep.segments[1].text


def test_the_tags_format_needs_its_close_character_as_a_stop_token():
    with pytest.raises(ConfigError, match=r'prompt.stop: \["`"\]'):
        ToolCall(ctx(stop_token_ids=()))
    with pytest.raises(ConfigError, match="tools"):
        ToolCall(ctx(), tools=["no.such.module:fn"])
