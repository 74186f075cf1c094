"""Tools by name: the built-ins (`calc`, `python`) and user tools as `pkg.mod:attr`.

Invariants:
- `resolve_tools(specs)` fails at start-up with a `ToolSpecError` (a ValueError) that names the
  spec and the fix; it returns only valid `Tool`s, under distinct names.
- A spec is a built-in name, `pkg.mod:attr`, or `name=pkg.mod:attr` (the tool under another
  name). `attr` is a `Tool`, or a function (sync or async) of one string returning text, made
  a tool by `tool(fn)`: its name, its docstring's first line as the description.
- `pkg.mod` is looked up like a reward module: installed packages and PYTHONPATH first, then
  the current working directory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from areal.tools.base import NAME_RE, Tool, tool
from areal.tools.calc import calc_tool
from areal.tools.python import python_tool
from areal.user_code import load_user_attr

BUILTIN_TOOLS: dict[str, Callable[[], Tool]] = {"calc": calc_tool, "python": python_tool}


class ToolSpecError(ValueError):
    pass


def resolve_tools(specs: Iterable[str]) -> dict[str, Tool]:
    """name -> Tool for each spec, in order (module invariants)."""
    out: dict[str, Tool] = {}
    for spec in specs:
        t = resolve_tool(spec)
        if t.name in out:
            raise ToolSpecError(
                f"tool spec {spec!r}: a tool named {t.name!r} is already listed; give one of "
                f"them another name with 'name=pkg.module:attr'"
            )
        out[t.name] = t
    return out


def resolve_tool(spec: str) -> Tool:
    if not isinstance(spec, str) or not spec.strip():
        raise ToolSpecError(f"tool spec {spec!r}: write a built-in name or 'pkg.module:attr'")
    spec = spec.strip()
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]()
    name, eq, target = spec.partition("=")
    if not eq:
        name, target = "", spec
    elif not NAME_RE.fullmatch(name.strip()):
        raise ToolSpecError(
            f"tool spec {spec!r}: {name.strip()!r} before '=' is not a tool name (letters, "
            "digits, _)"
        )
    name = name.strip()
    if target.strip() in BUILTIN_TOOLS:
        return _renamed(BUILTIN_TOOLS[target.strip()](), name, spec)
    mod_name, colon, attr = target.strip().partition(":")
    if not colon or not mod_name or not attr:
        raise ToolSpecError(
            f"unknown tool {spec!r}: use one of {sorted(BUILTIN_TOOLS)} or 'pkg.module:function' "
            "for your own (a function of the argument string returning text, or a Tool)"
        )
    try:
        obj: Any = load_user_attr(mod_name, attr, f"tool spec {spec!r}")
    except ValueError as e:
        raise ToolSpecError(str(e)) from None
    if isinstance(obj, Tool):
        return _renamed(obj, name, spec)
    if isinstance(obj, type) or not callable(obj):
        raise ToolSpecError(
            f"tool spec {spec!r}: {attr!r} is a {type(obj).__name__}; point it at a function "
            "(arguments: str) -> str (sync or async) or an areal.tools.Tool"
        )
    try:
        return tool(obj, name=name or None)
    except ValueError as e:
        raise ToolSpecError(
            f"tool spec {spec!r}: {e}; name it with 'name=pkg.module:attr'"
        ) from None


def _renamed(t: Tool, name: str, spec: str) -> Tool:
    if not name or name == t.name:
        return t
    try:
        return dataclasses.replace(t, name=name)
    except ValueError as e:
        raise ToolSpecError(f"tool spec {spec!r}: {e}") from None
