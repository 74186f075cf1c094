"""The `python` tool: the model's code, run in the code sandbox (`areal.sandbox`).

Invariants:
- The code runs exactly as the `code` reward's solutions do: its own process, the sandbox's
  isolation (namespaces when the machine allows: no network, no host files, no other process;
  else the audit hook), its CPU, memory, file and process limits, and a wall-clock limit: the
  call's `timeout_s`, after which the sandbox kills the program (`ToolTimeout`).
- The output is what the program printed, then, as in a REPL, the `repr` of the value of a
  final expression statement unless it is None (`x = 6*7; x` prints `42`). The last statement
  is rewritten only when it is an expression; every other line keeps its number.
- A program that raises fails the call (`ToolError`: `NameError: ... (line 3)`), as does one the
  sandbox refused (network, files, exec) or one that exited early; what it printed before comes
  with the error (`ToolError.output`).
"""

from __future__ import annotations

import ast
from typing import Literal

from areal.sandbox import DEFAULT_MEMORY_BYTES, Isolation, run_sandboxed
from areal.tools.base import Tool, ToolError, ToolTimeout

DEFAULT_TIMEOUT_S = 10.0
STDOUT_BYTES = 1 << 16  # kept of the program's stdout (the runner caps what the model sees)
_LAST = "__areal_last__"


def python_tool(
    *,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    isolation: Literal["auto"] | Isolation = "auto",
    timeout_s: float | None = None,
) -> Tool:
    """The tool; `timeout_s` None takes the runner's per-call limit."""

    def run(code: str, *, timeout_s: float | None = None) -> bytes:
        return run_python(
            code,
            timeout_s=timeout_s or DEFAULT_TIMEOUT_S,
            memory_bytes=memory_bytes,
            isolation=isolation,
        )

    return Tool(
        name="python",
        description="Run Python code in a sandbox (no network, no files outside its own "
        "directory) and return what it prints, and the value of a final expression",
        fn=run,
        parameter="code",
        timeout_s=timeout_s,
        enforces_timeout=True,
    )


def run_python(
    code: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    isolation: Literal["auto"] | Isolation = "auto",
) -> bytes:
    """Run `code` in the sandbox; its stdout (module invariants), else `ToolError`."""
    r = run_sandboxed(
        with_final_repr(code),
        timeout_s=timeout_s,
        memory_bytes=memory_bytes,
        isolation=isolation,
        stdout_bytes=STDOUT_BYTES,
    )
    if r.verdict == "passed":
        return r.stdout
    if r.verdict == "timeout":
        raise ToolTimeout(r.reason, output=r.stdout)
    raise ToolError(_as_a_tool(r.reason), output=r.stdout)


def _as_a_tool(reason: str) -> str:
    """The sandbox's reason, worded for code that is not a solution under tests."""
    for old, new in (
        ("the solution raised ", ""),
        (" of the solution)", ")"),
        (" before the tests ran", ""),
        (" before the tests reported", ""),
    ):
        reason = reason.replace(old, new)
    return reason


def with_final_repr(code: str) -> str:
    """`code` whose last statement, if it is an expression, also prints its repr (not None)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return code  # the sandbox reports it, with its line
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    lines = code.splitlines(keepends=True)
    start = last.lineno - 1
    # col_offset counts UTF-8 bytes
    head_line = lines[start].encode()[: last.col_offset].decode("utf-8", errors="replace")
    segment = ast.get_source_segment(code, last)
    if segment is None:
        return code
    prefix = "".join(lines[:start]) + head_line
    return f"{prefix}{_LAST} = ({segment}\n)\nif {_LAST} is not None:\n    print(repr({_LAST}))\n"
