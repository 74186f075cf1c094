"""Tool-call formats: reading the calls out of a model turn's text, writing a result back.

`tags` (the built-in tiny model, one token per character): the model writes `<calc>37*41` and
then the close character `CLOSE` (a backtick); that single character is a stop token of the
run, so generation ends right at the end of the call (the engines stop on single tokens only).
The result is appended as `<r>1517</r>`. A whole turn: "37*41+5=<calc>37*41+5`<r>1522</r>1522".

`chat` (Hermes / Qwen2 style): the assistant text holds `<tool_call>{"name": "calc",
"arguments": {"expression": "37*41"}}</tool_call>` (one or more); the turn ends with the chat
template's end-of-turn token as any other turn; each result goes back as a `tool` message that
the model's chat template renders (`chat_ids.tool_turn_ids`).

Invariants:
- `parse(text)` never raises: it returns the calls of the turn (none: the turn is an answer)
  or why the turn holds a call that cannot be read (`malformed`: no closing tag, bad JSON, no
  name, an opening without a call), which a workflow ends with `bad_tool_call` or feeds back.
- Bounded work: a call's JSON text over `MAX_CALL_CHARS` characters or nested over
  `MAX_JSON_DEPTH` deep (`[`/`{` outside strings, counted in linear time before decoding) is
  malformed, naming the bound; so is an OpenAI-style arguments string past them
  (`bad_arguments`). No text reaches the recursive decoder deeper than the bound.
- Parsing needs no tool list: an unknown name parses, and the runner reports `unknown_tool`.
- `chat`: a call's `arguments` is the value of the tool's one string parameter when the object
  (or a JSON string of it, OpenAI style) has just that key, or one string value under another
  key; the string itself when the model wrote a plain string; else the object's JSON. For a
  tool with a parameter any other object is `bad_arguments`.
- `tags`: the close character never appears in what `render_result` writes, and with
  `ascii_only` every character it writes is printable ASCII (the tiny model's vocabulary).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from areal.tools.base import Tool, ToolCall
from areal.workflows.api import ToolCallRecord


@dataclass(frozen=True)
class ParsedTurn:
    calls: tuple[ToolCall, ...] = ()
    malformed: str | None = None  # why a call in the turn cannot be read; None: all read

    @property
    def is_answer(self) -> bool:
        """No call and nothing malformed: the episode's final answer."""
        return not self.calls and self.malformed is None


class ToolFormat(Protocol):
    name: str

    def stop_strings(self) -> tuple[str, ...]: ...

    def parse(self, text: str) -> ParsedTurn: ...


# --- tags -----------------------------------------------------------------------------------

CLOSE = "`"  # ends a call; the run's stop token
RESULT_OPEN, RESULT_CLOSE = "<r>", "</r>"
_OPEN_RE = re.compile(r"<([A-Za-z_][A-Za-z0-9_]*)>")
_PRINTABLE = set(string.printable) - {"\x0b", "\x0c"}


class TagsFormat:
    """`<name>arguments` + CLOSE; the result as `<r>output</r>` (module docstring)."""

    name = "tags"

    def __init__(self, *, ascii_only: bool = True) -> None:
        self.ascii_only = ascii_only

    def stop_strings(self) -> tuple[str, ...]:
        """Add these to the run's stop tokens (`prompt.stop`): each is one token."""
        return (CLOSE,)

    def stop_token_ids(self, tokenizer: Any) -> tuple[int, ...]:
        """The ids of `stop_strings()`; ValueError when one is not a single token."""
        ids = tokenizer.encode(CLOSE, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(
                f"the tags tool format ends a call with {CLOSE!r}, which is {len(ids)} tokens in "
                "this tokenizer: use the chat format for this model"
            )
        return (ids[0],)

    def parse(self, text: str, *, closed: bool = False) -> ParsedTurn:
        """The call the turn ends with. `closed`: generation stopped on CLOSE (pass it when the
        decoded text drops stop tokens; a text that ends with CLOSE says so itself)."""
        if text.endswith(CLOSE):
            closed, text = True, text[: -len(CLOSE)]
        opens = list(_OPEN_RE.finditer(text))
        opens = [m for m in opens if m.group(1) != RESULT_OPEN[1:-1]]
        if not closed:  # an answer, unless a call was opened and the turn ended inside it
            if opens:
                return ParsedTurn(
                    malformed=f"<{opens[-1].group(1)}> is never closed with {CLOSE!r} (the turn "
                    "ended first)"
                )
            return ParsedTurn()
        if not opens:
            return ParsedTurn(malformed=f"{CLOSE!r} ends a call but no <tool> opens one")
        m = opens[-1]
        call = ToolCall(name=m.group(1), arguments=text[m.end() :], text=text[m.start() :] + CLOSE)
        return ParsedTurn(calls=(call,))

    def call_text(self, name: str, arguments: str) -> str:
        """A call as the model writes it (for demonstrations and warm starts)."""
        return f"<{name}>{arguments}{CLOSE}"

    def render_result(self, record: ToolCallRecord) -> str:
        """The environment text appended after the call: `<r>output</r>`."""
        return f"{RESULT_OPEN}{self.clean(record.output)}{RESULT_CLOSE}"

    def clean(self, text: str) -> str:
        text = text.replace(CLOSE, "'")
        if self.ascii_only:
            text = "".join(ch if ch in _PRINTABLE else "?" for ch in text)
        return text


# --- chat -----------------------------------------------------------------------------------

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_JSON_DEPTH = 64  # of `[`/`{` nesting in a call's JSON; Python's decoder recurses per level
MAX_CALL_CHARS = 1 << 20  # of one call's JSON text (between the tags)
_JSON_SPECIAL_RE = re.compile(r'[\[\]{}"\\]')


class ChatFormat:
    """Hermes / Qwen2 `<tool_call>` JSON calls; results as `tool` messages (module docstring)."""

    name = "chat"

    def __init__(self, tools: Mapping[str, Tool] | None = None) -> None:
        self.tools = dict(tools or {})

    def stop_strings(self) -> tuple[str, ...]:
        return ()  # the turn ends with the chat template's end-of-turn token, as any turn

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = text.find(CALL_OPEN, pos)
            if start < 0:
                stray = text.find(CALL_CLOSE, pos)
                if stray >= 0:
                    return ParsedTurn(tuple(calls), f"{CALL_CLOSE} without {CALL_OPEN}")
                return ParsedTurn(tuple(calls))
            end = text.find(CALL_CLOSE, start + len(CALL_OPEN))
            if end < 0:
                return ParsedTurn(tuple(calls), f"{CALL_OPEN} is never closed with {CALL_CLOSE}")
            body = text[start + len(CALL_OPEN) : end]
            call, why = self._call(body, text[start : end + len(CALL_CLOSE)])
            if call is None:
                return ParsedTurn(tuple(calls), why)
            calls.append(call)
            pos = end + len(CALL_CLOSE)

    def _call(self, body: str, raw: str) -> tuple[ToolCall | None, str]:
        try:
            obj = _bounded_json(body)
        except JsonTooBig as e:
            return None, f"a tool call whose JSON is {e}"
        except ValueError as e:
            return None, f"a tool call that is not JSON ({e})"
        if not isinstance(obj, dict):
            return None, "a tool call must be a JSON object with a name and arguments"
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return None, 'a tool call without a "name" string'
        args = obj.get("arguments", obj.get("parameters", {}))
        text, bad = self._arguments(name, args)
        return ToolCall(name=name, arguments=text, bad_arguments=bad, text=raw), ""

    def _arguments(self, name: str, args: Any) -> tuple[str, str | None]:
        t = self.tools.get(name)
        if isinstance(args, str):
            if t is None or t.parameter is None or not args.lstrip().startswith("{"):
                return args, None
            try:  # OpenAI style: the arguments object as a JSON string
                args = _bounded_json(args)
            except JsonTooBig as e:
                return args, f"{name}: its arguments as JSON text are {e}"
            except ValueError:
                return args, None
        as_json = json.dumps(args, ensure_ascii=False)
        if t is None or t.parameter is None:
            return as_json, None
        if isinstance(args, dict):
            strings = [v for v in args.values() if isinstance(v, str)]
            if isinstance(args.get(t.parameter), str) and len(args) == 1:
                return args[t.parameter], None
            if len(args) == 1 and len(strings) == 1:
                return strings[0], None
        return as_json, f'{name} takes {{"{t.parameter}": "<text>"}}, got {_short(as_json)}'

    def call_text(self, name: str, arguments: Mapping[str, Any] | str) -> str:
        return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"

    def tool_message(self, record: ToolCallRecord) -> dict[str, str]:
        """The message that carries a result, for the chat template."""
        return {"role": "tool", "name": record.name, "content": record.output}

    def tools_schema(self) -> list[dict[str, Any]]:
        """The tools as `apply_chat_template(..., tools=...)` takes them."""
        return [t.schema() for t in self.tools.values()]


FORMATS = ("tags", "chat")


def make_format(name: str, tools: Mapping[str, Tool] | None = None) -> TagsFormat | ChatFormat:
    if name == "tags":
        return TagsFormat()
    if name == "chat":
        return ChatFormat(tools)
    raise ValueError(f"unknown tool-call format {name!r}: one of {', '.join(FORMATS)}")


class JsonTooBig(ValueError):
    """JSON text past `MAX_CALL_CHARS` or `MAX_JSON_DEPTH`, refused before decoding."""


def json_depth(text: str, *, stop_over: int | None = None) -> int:
    """The deepest `[`/`{` nesting of `text` outside JSON strings, in one linear pass (an
    upper bound for text that is not JSON); past `stop_over` it returns at once."""
    depth = deepest = 0
    in_string = False
    escaped_at = -1  # the index of the character a backslash in a string escapes
    for m in _JSON_SPECIAL_RE.finditer(text):
        ch, i = m.group(), m.start()
        if in_string:
            if i == escaped_at:
                continue
            if ch == "\\":
                escaped_at = i + 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if stop_over is not None and deepest > stop_over:
                return deepest
        elif ch in "]}":
            depth = max(0, depth - 1)
    return deepest


def _bounded_json(text: str) -> Any:
    """`json.loads(text)` within the bounds: `JsonTooBig` past them (checked first, in linear
    time), `ValueError` for text that is not JSON, never a RecursionError."""
    if len(text) > MAX_CALL_CHARS:
        raise JsonTooBig(f"over {MAX_CALL_CHARS} characters ({len(text)})")
    if json_depth(text, stop_over=MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise JsonTooBig(f"nested over {MAX_JSON_DEPTH} deep")
    try:
        return json.loads(text)
    except RecursionError:  # a deep stack already; the bound keeps this from happening
        raise JsonTooBig(f"nested too deep to decode here (bound {MAX_JSON_DEPTH})") from None


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "CLOSE",
    "FORMATS",
    "ChatFormat",
    "ParsedTurn",
    "TagsFormat",
    "ToolFormat",
    "make_format",
]
