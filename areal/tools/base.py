"""A tool an agent episode can call: a name, a description, and a call from the argument text
the model wrote to output text.

Invariants:
- A tool's input is one string: the text between the tags (`tags` format), or the value of its
  one string parameter, else the JSON of the arguments object (`chat` format; see `formats`).
- `fn` is a sync or an async function of that string returning `str` (or `bytes`, or anything
  `str()` renders); it fails by raising. `ToolArgumentError` says the input is unusable
  (`bad_arguments`), `ToolTimeout` that the tool gave up at its own limit (`timeout`), any other
  exception that it failed (`raised: ...`); a `ToolError` carries what the tool wrote before it
  failed (the python tool's stdout) in `output`.
- A tool that `enforces_timeout` takes `timeout_s=` and stops within it on its own (the python
  tool: the sandbox kills the program); the runner then waits a grace period longer before it
  gives up on the call. Any other tool is abandoned at its limit (a hung sync function keeps
  its daemon thread; nothing waits for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ToolError(Exception):
    """The tool ran and failed; `output` is what it produced before it failed."""

    def __init__(self, message: str, output: str | bytes = "") -> None:
        super().__init__(message)
        self.output = output


class ToolArgumentError(ToolError):
    """The argument text is not something this tool can take (`bad_arguments`)."""


class ToolTimeout(ToolError):
    """The tool stopped at its own time limit (`timeout`)."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote, as a format parsed it (`formats`)."""

    name: str
    arguments: str  # the tool's input
    bad_arguments: str | None = None  # why the arguments cannot be given to the tool at all
    text: str = ""  # the call as the model wrote it


@dataclass(frozen=True)
class Tool:
    """A callable tool (module docstring). Build one directly or with `tool(fn)`."""

    name: str
    description: str
    fn: Callable[..., Any]  # (arguments: str[, timeout_s=...]) -> str | bytes, sync or async
    parameter: str | None = "input"  # chat format: its one string parameter (None: raw JSON)
    timeout_s: float | None = None  # this tool's per-call limit, s (None: the runner's)
    enforces_timeout: bool = False  # fn takes timeout_s= and stops within it by itself

    def __post_init__(self) -> None:
        if not NAME_RE.fullmatch(self.name):
            raise ValueError(
                f"tool name {self.name!r} must be an identifier (letters, digits, _): the "
                "model writes it in its calls"
            )
        if self.parameter is not None and not NAME_RE.fullmatch(self.parameter):
            raise ValueError(f"tool {self.name!r}: parameter {self.parameter!r} is no identifier")
        if not callable(self.fn):
            raise ValueError(f"tool {self.name!r}: fn is a {type(self.fn).__name__}, no callable")

    @property
    def is_async(self) -> bool:
        fn = self.fn
        return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
        )

    async def call(self, arguments: str, *, timeout_s: float | None = None) -> Any:
        """Run the tool on `arguments` (a sync one in a daemon thread of its own); no limit,
        no classification: that is `ToolRunner.run`."""
        kwargs = {"timeout_s": timeout_s} if self.enforces_timeout else {}
        if self.is_async:
            out = await self.fn(arguments, **kwargs)
        else:
            out = await in_thread(self.fn, arguments, **kwargs)
        if inspect.isawaitable(out):  # a sync function that returned a coroutine
            out = await out
        return out

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (`apply_chat_template(tools=[...])`, OpenAI style)."""
        if self.parameter is None:
            params: dict[str, Any] = {"type": "object"}
        else:
            params = {
                "type": "object",
                "properties": {self.parameter: {"type": "string"}},
                "required": [self.parameter],
            }
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": params},
        }


def tool(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
) -> Tool:
    """A `Tool` from a plain function of one string: its name, the first line of its docstring
    and the name of its first parameter (the chat format's argument key) are the defaults."""
    params = [
        p
        for p in _signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    doc = (inspect.getdoc(fn) or "").strip().splitlines()
    return Tool(
        name=name or getattr(fn, "__name__", type(fn).__name__),
        description=description if description is not None else (doc[0] if doc else ""),
        fn=fn,
        parameter=params[0].name if params and NAME_RE.fullmatch(params[0].name) else "input",
        timeout_s=timeout_s,
    )


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature
        return inspect.Signature()


async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a daemon thread of its own. Unlike `asyncio.to_thread` (the
    loop's pool, joined at interpreter exit), a call that never returns holds no pool slot and
    never blocks the process from exiting; cancelling the await abandons the thread."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def work() -> None:
        try:
            result: tuple[bool, Any] = (True, fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - every way out is reported to the caller
            result = (False, e if isinstance(e, Exception) else ToolError(describe(e)))
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            loop.call_soon_threadsafe(settle, *result)

    threading.Thread(
        target=work, name=f"areal-tool-{getattr(fn, '__name__', 'fn')}", daemon=True
    ).start()
    return await fut


def describe(e: BaseException) -> str:
    """`Type: message`, one line."""
    msg = str(e)
    msg = " ".join(msg.split())
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__
