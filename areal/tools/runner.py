"""Running tool calls off the event loop: a time limit, an output cap, an outcome per call.

Invariants:
- `ToolRunner.run` never raises for anything a tool or the model did (cancelling the awaiting
  task still cancels it): every call becomes a `ToolCallRecord` whose `error` is None (the tool
  answered), `"unknown_tool"`, `"bad_arguments"`, `"timeout"` or `"raised: <what>"`, and whose
  `output` is the text a workflow may feed back to the model: the tool's output, or what it
  wrote before failing followed by an `error: ...` line.
- No call blocks the loop: an async tool is awaited, a sync one runs in a daemon thread of its
  own (so N slow calls run at once), the python tool in its sandbox process.
- The time limit is the tool's `timeout_s`, else the runner's; it covers the simulated latency
  too (it stands in for a remote tool, whose wait counts). A tool that enforces its own limit
  gets `timeout_s` and `TIMEOUT_GRACE_S` more before the runner gives up on it.
- Output is text of at most `max_output_bytes` UTF-8 bytes plus a cut marker: bytes are
  decoded as UTF-8 (undecodable bytes become U+FFFD), control characters other than newline,
  tab and CR become U+FFFD, and output that is mostly not text (a NUL, or over 10% such
  characters) is replaced whole by `[binary output: N bytes]`.
- `latency_s` is the wall time of the call, the simulated wait included.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from areal.tools.base import (
    Tool,
    ToolArgumentError,
    ToolCall,
    ToolError,
    ToolTimeout,
    describe,
)
from areal.workflows.api import ToolCallRecord

TIMEOUT_GRACE_S = 10.0  # how much longer a tool that enforces its own limit may take to stop
MAX_ERROR_CHARS = 300  # of the message in `error` ("raised: ...")


class SimulatedLatency(BaseModel):
    """A wait added to every tool call, standing in for a remote tool (search, a code runner)
    in benchmarks. It is an `asyncio.sleep`: it costs no CPU and frees the episode's row."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["none", "fixed", "lognormal", "pareto"] = Field(
        "none",
        description="none; fixed (always `seconds`); lognormal (median `seconds`, shape "
        "`sigma`); pareto (minimum `seconds`, tail index `alpha`: heavier tail as alpha -> 1)",
    )
    seconds: float = Field(
        0.0, ge=0.0, description="fixed: the wait; lognormal: its median; pareto: its minimum, s"
    )
    sigma: float = Field(1.0, gt=0.0, le=5.0, description="lognormal shape (log-space std)")
    alpha: float = Field(1.5, gt=0.0, le=20.0, description="pareto tail index")
    max_s: float | None = Field(
        None,
        gt=0.0,
        description="cap on one wait, s (None: uncapped; the call's limit still applies)",
    )
    seed: int = Field(0, description="seed of the waits' random stream")

    @model_validator(mode="after")
    def _check(self) -> SimulatedLatency:
        if self.kind != "none" and self.seconds <= 0.0:
            raise ValueError(f"tool latency kind={self.kind!r} needs seconds > 0")
        return self

    def median_s(self) -> float:
        """The distribution's median, s (before `max_s`)."""
        if self.kind == "none":
            return 0.0
        if self.kind == "pareto":
            return self.seconds * 2.0 ** (1.0 / self.alpha)
        return self.seconds

    def sampler(self) -> Callable[[], float]:
        """A seeded stream of waits, s."""
        rng = random.Random(self.seed)

        def draw() -> float:
            if self.kind == "none":
                return 0.0
            if self.kind == "fixed":
                s = self.seconds
            elif self.kind == "lognormal":
                s = rng.lognormvariate(math.log(self.seconds), self.sigma)
            else:
                s = self.seconds * rng.paretovariate(self.alpha)
            return min(s, self.max_s) if self.max_s is not None else s

        return draw


class ToolRunner:
    """Runs the calls of any number of episodes at once (module invariants)."""

    def __init__(
        self,
        tools: Mapping[str, Tool],
        *,
        timeout_s: float = 30.0,
        max_output_bytes: int = 4096,
        latency: SimulatedLatency | None = None,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        if timeout_s <= 0 or max_output_bytes <= 0:
            raise ValueError("tool runner: timeout_s and max_output_bytes must be > 0")
        self.tools = dict(tools)
        self.timeout_s = timeout_s
        self.max_output_bytes = max_output_bytes
        self.latency = latency or SimulatedLatency()
        self._draw = self.latency.sampler()
        self._sleep = sleep

    async def run(self, call: ToolCall, *, turn: int = 0) -> ToolCallRecord:
        start = time.monotonic()

        def record(output: Any, error: str | None = None) -> ToolCallRecord:
            return ToolCallRecord(
                name=call.name,
                arguments=call.arguments,
                output=output,
                error=error,
                latency_s=time.monotonic() - start,
                turn=turn,
            )

        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return record(f"error: unknown tool {call.name!r} (tools: {known})", "unknown_tool")
        if call.bad_arguments is not None:
            return record(f"error: bad arguments: {call.bad_arguments}", "bad_arguments")
        limit = tool.timeout_s if tool.timeout_s is not None else self.timeout_s
        wait = self._draw()
        try:
            out = await asyncio.wait_for(
                self._call(tool, call.arguments, wait, limit),
                limit + TIMEOUT_GRACE_S if tool.enforces_timeout else limit,
            )
        except (asyncio.TimeoutError, ToolTimeout) as e:
            partial = e.output if isinstance(e, ToolTimeout) else ""
            return record(self._with_error(partial, f"timed out after {limit:g}s"), "timeout")
        except ToolArgumentError as e:
            return record(self._with_error(e.output, f"bad arguments: {e}"), "bad_arguments")
        except ToolError as e:
            return record(self._with_error(e.output, str(e)), "raised: " + _clip(str(e)))
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a tool's failure is an outcome
            what = describe(e)
            return record(self._with_error("", what), "raised: " + _clip(what))
        return record(self.text(out))

    async def _call(self, tool: Tool, arguments: str, wait: float, limit: float) -> Any:
        if wait > 0:  # the remote tool's latency, within the call's limit
            await self._sleep(min(wait, limit))
            if wait >= limit:
                raise ToolTimeout("the simulated latency outlasted the limit")
        return await tool.call(arguments, timeout_s=limit - wait)

    def text(self, out: Any) -> str:
        """`out` as text the model can read, within `max_output_bytes` (module invariants)."""
        return cap_bytes(as_text(out), self.max_output_bytes)

    def _with_error(self, partial: Any, message: str) -> str:
        head = as_text(partial) if partial else ""
        line = "error: " + " ".join(message.split())
        room = max(0, self.max_output_bytes - len(line.encode()) - 1)
        head = cap_bytes(head, room) if head else ""
        return f"{head.rstrip(chr(10))}\n{line}" if head else cap_bytes(line, self.max_output_bytes)


_KEPT_CONTROLS = {"\n", "\t", "\r"}
_CONTROLS = {ord(c): "\ufffd" for c in [*map(chr, range(32)), "\x7f"] if c not in _KEPT_CONTROLS}


def as_text(out: Any) -> str:
    """Tool output as text: bytes decoded as UTF-8, control characters replaced, binary data
    (a NUL, or over 10% replaced or control characters) summarised (module invariants)."""
    if out is None:
        return ""
    raw_len = len(out) if isinstance(out, (bytes, bytearray)) else None
    if isinstance(out, (bytes, bytearray)):
        text = bytes(out).decode("utf-8", errors="replace")
    else:
        text = out if isinstance(out, str) else str(out)
    bad = sum(1 for ch in text if ch == "\ufffd" or ord(ch) in _CONTROLS)
    if "\x00" in text or bad > max(4, len(text) // 10):
        n = raw_len if raw_len is not None else len(text.encode("utf-8", "replace"))
        return f"[binary output: {n} bytes]"
    return text.translate(_CONTROLS) if bad else text


def cap_bytes(text: str, max_bytes: int) -> str:
    """`text` cut to at most `max_bytes` UTF-8 bytes (on a character boundary) plus a marker
    saying how many bytes were cut."""
    raw = text.encode("utf-8", errors="replace")
    if len(raw) <= max_bytes:
        return text
    head = raw[:max_bytes].decode("utf-8", errors="ignore")
    return f"{head}\n[... {len(raw) - len(head.encode())} more bytes cut]"


def _clip(message: str) -> str:
    line = " ".join(message.split())
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."
