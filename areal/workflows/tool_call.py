"""`tool_call`: the model answers, or calls a tool and goes on after its result, turn by turn.

`rollout.workflow_kwargs`:
- `tools`: tool specs (`calc`, `python`, `pkg.mod:fn`, `name=pkg.mod:fn`; `areal.tools`);
- `format`: `tags` (the built-in char-level model: `<calc>37*41` + a backtick, which must be a
  stop token of the run: `prompt.stop: ["`"]`) or `chat` (`<tool_call>{json}</tool_call>`,
  results as `tool` messages through the model's chat template);
- `tool_timeout_s`, `max_output_bytes`: per call; `max_concurrent_calls`: calls running at once
  in this worker (the python tool starts a sandbox process per call);
- `latency`: a simulated wait per call (`areal.tools.SimulatedLatency`: none | fixed |
  lognormal | pareto), standing in for remote tools in benchmarks;
- `on_bad_call`: `end` (finish reason `bad_tool_call`) or `feedback` (the reason goes back as
  the result and the episode goes on); `on_tool_error`: `feedback` (default: the error text is
  the result) or `end` (finish reason `tool_error`).

Invariants (besides the API's): the stream is built by appending ids only (the model's own
ids; the result's ids: `encode(render_result)` for tags, the chat template's wrapper for chat,
`areal.tools.chat_ids`); an episode stops at `max_turns` model turns (a call in the last turn
ends it with `max_turns`) and never holds more than the episode budget after its prompt (a turn
is capped to the room left; a result that does not fit ends it with `max_episode_tokens`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from areal.config import ConfigError
from areal.tools import resolve_tools
from areal.tools.chat_ids import tool_turn_ids
from areal.tools.formats import CLOSE, ChatFormat, ParsedTurn, TagsFormat, make_format
from areal.tools.runner import SimulatedLatency, ToolRunner
from areal.workflows.api import Episode, Generation, Generator, Segment, ToolCallRecord
from areal.workflows.context import WorkflowContext
from schemas import Task


class ToolCall:
    def __init__(
        self,
        ctx: WorkflowContext,
        *,
        tools: list[str] | tuple[str, ...] = ("calc",),
        format: Literal["tags", "chat"] = "tags",  # noqa: A002 - the setting's name
        tool_timeout_s: float = 30.0,
        max_output_bytes: int = 4096,
        max_concurrent_calls: int = 8,
        latency: dict[str, Any] | None = None,
        on_bad_call: Literal["end", "feedback"] = "end",
        on_tool_error: Literal["end", "feedback"] = "feedback",
    ) -> None:
        self.ctx = ctx
        try:
            self.tools = resolve_tools(list(tools))
        except ValueError as e:
            raise ConfigError(f"config error: rollout.workflow_kwargs.tools: {e}") from None
        if format not in ("tags", "chat"):
            raise ConfigError(
                f"config error: rollout.workflow_kwargs.format={format!r}: tags or chat"
            )
        for name, value in (("on_bad_call", on_bad_call), ("on_tool_error", on_tool_error)):
            if value not in ("end", "feedback"):
                raise ConfigError(
                    f"config error: rollout.workflow_kwargs.{name}={value!r}: end or feedback"
                )
        self.fmt = make_format(format, self.tools)
        self.on_bad_call, self.on_tool_error = on_bad_call, on_tool_error
        self.runner = ToolRunner(
            self.tools,
            timeout_s=tool_timeout_s,
            max_output_bytes=max_output_bytes,
            latency=SimulatedLatency.model_validate(latency) if latency else None,
        )
        self._slots = asyncio.Semaphore(max_concurrent_calls)
        self._close_id: int | None = None
        if isinstance(self.fmt, TagsFormat):
            (self._close_id,) = self.fmt.stop_token_ids(ctx.tokenizer) if ctx.tokenizer else (-1,)
            if self._close_id not in ctx.stop_token_ids:
                raise ConfigError(
                    f"config error: the tags tool format ends a call with {CLOSE!r}, which is "
                    f'not a stop token of this run: set prompt.stop: ["{CLOSE}"] (with any '
                    "other stop strings the run has)"
                )
        elif ctx.tokenizer is None or not getattr(ctx.tokenizer, "chat_template", None):
            raise ConfigError(
                "config error: rollout.workflow_kwargs.format=chat needs a model whose "
                "tokenizer has a chat template; use format: tags for the built-in model"
            )

    async def arun_episode(self, gen: Generator, task: Task, sample_idx: int) -> Episode:
        ctx = self.ctx
        ids = task.prompt_ids.to_list()
        budget = ctx.episode_budget()
        segments: list[Segment] = []
        calls: list[ToolCallRecord] = []
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
        used = interrupts = reprefill = turns = 0
        finish = "length"
        while True:
            room = budget - used
            if room <= 0:
                finish = "max_episode_tokens"
                break
            cap = min(ctx.max_new_tokens, room)
            out = await gen.generate(ids, max_new_tokens=cap)
            turns += 1
            interrupts += out.n_interrupts
            reprefill += out.n_reprefill_tokens
            text = ctx.decode(out.output_ids)
            segments.append(Segment.model(out, text))
            ids, used = ids + out.output_ids, used + len(out.output_ids)
            parsed = self._parse(text, out)
            if out.finish_reason == "length" and cap < ctx.max_new_tokens and not parsed.calls:
                finish = "max_episode_tokens"  # cut by the episode's budget, not the turn's
                break
            if parsed.is_answer:
                finish = out.finish_reason
                break
            if turns >= ctx.max_turns:
                finish = "max_turns"
                break
            if parsed.malformed is not None and self.on_bad_call == "end":
                finish = "bad_tool_call"
                break
            records = await self._run_calls(parsed, turns - 1)
            calls += records
            if self.on_tool_error == "end" and any(r.error is not None for r in records):
                finish = "tool_error"
                break
            env_ids, env_text = self._result_ids(records, messages, text, out)
            if used + len(env_ids) > budget:
                finish = "max_episode_tokens"
                break
            segments.append(Segment.env(env_ids, env_text))
            ids, used = ids + env_ids, used + len(env_ids)
        return Episode(
            segments=segments,
            finish_reason=finish,
            tool_calls=calls,
            n_turns=turns,
            n_interrupts=interrupts,
            n_reprefill_tokens=reprefill,
        )

    def _parse(self, text: str, out: Generation) -> ParsedTurn:
        if isinstance(self.fmt, TagsFormat):
            closed = (
                out.finish_reason == "stop"
                and bool(out.output_ids)
                and out.output_ids[-1] == self._close_id
            )
            return self.fmt.parse(text, closed=closed)
        return self.fmt.parse(text)

    async def _run_calls(self, parsed: ParsedTurn, turn: int) -> list[ToolCallRecord]:
        if parsed.malformed is not None:  # fed back: the reason is the result
            return [
                ToolCallRecord("?", "", f"error: {parsed.malformed}", "bad_tool_call", 0.0, turn)
            ]

        async def one(call: Any) -> ToolCallRecord:
            async with self._slots:
                return await self.runner.run(call, turn=turn)

        return list(await asyncio.gather(*(one(c) for c in parsed.calls)))

    def _result_ids(
        self,
        records: list[ToolCallRecord],
        messages: list[dict[str, Any]],
        text: str,
        out: Generation,
    ) -> tuple[list[int], str]:
        """The environment's ids for `records`, appended to the stream (never re-tokenized)."""
        if isinstance(self.fmt, TagsFormat):
            env_text = "".join(self.fmt.render_result(r) for r in records)
            return self.ctx.encode(env_text), env_text
        assert isinstance(self.fmt, ChatFormat)
        messages.append({"role": "assistant", "content": text})
        tool_msgs = [self.fmt.tool_message(r) for r in records]
        ended = out.finish_reason == "stop"
        env_ids = tool_turn_ids(self.ctx.tokenizer, messages, tool_msgs, ended_turn=ended)
        messages.extend(tool_msgs)
        return env_ids, self.ctx.decode(env_ids)
