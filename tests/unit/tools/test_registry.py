"""resolve_tools: built-ins by name, user tools as pkg.mod:attr, one clear error per bad spec."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from areal.tools import Tool, ToolCall, ToolRunner, ToolSpecError, resolve_tools

USER_TOOLS = '''
import asyncio
from areal.tools import Tool

def shout(text: str) -> str:
    """Shout the text back.

    More words."""
    return text.upper() + "!"

async def lookup(query):
    await asyncio.sleep(0)
    return f"found {query}"

def _wrapped(text):
    return text[::-1]

reverse = Tool(name="reverse", description="Reverse the text", fn=_wrapped)
NOT_CALLABLE = 3

class Klass:
    def __call__(self, text):
        return text
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(USER_TOOLS)
    (tmp_path / "broken_tools.py").write_text("raise RuntimeError('half-installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_tools"


def test_builtins():
    tools = resolve_tools(["calc", "python"])
    assert list(tools) == ["calc", "python"]
    assert tools["calc"].parameter == "expression" and tools["python"].parameter == "code"
    assert tools["python"].enforces_timeout and not tools["calc"].enforces_timeout


def test_user_functions_and_tools(user_module):
    tools = resolve_tools(["my_tools:shout", "my_tools:lookup", "my_tools:reverse"])
    assert list(tools) == ["shout", "lookup", "reverse"]
    shout, lookup = tools["shout"], tools["lookup"]
    assert (shout.description, shout.parameter, shout.is_async) == (
        "Shout the text back.",
        "text",
        False,
    )
    assert (lookup.parameter, lookup.is_async) == ("query", True)
    assert shout.schema()["function"]["parameters"]["required"] == ["text"]

    async def calls():
        r = ToolRunner(tools)
        return [
            (await r.run(ToolCall(n, a))).output
            for n, a in [("shout", "hi"), ("lookup", "x"), ("reverse", "abc")]
        ]

    assert asyncio.run(calls()) == ["HI!", "found x", "cba"]


def test_renamed(user_module):
    tools = resolve_tools(["yell=my_tools:shout", "maths=calc", "calc"])
    assert list(tools) == ["yell", "maths", "calc"]
    assert isinstance(tools["yell"], Tool) and tools["yell"].fn(" a") == " A!"


def test_a_module_in_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_tools.py").write_text("def echo(s):\n    return s\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".")])
    assert list(resolve_tools(["cwd_tools:echo"])) == ["echo"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("calculator", "unknown tool 'calculator': use one of ['calc', 'python']"),
        ("", "write a built-in name or 'pkg.module:attr'"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("broken_tools:f", "importing module 'broken_tools' raised RuntimeError: half-installed"),
        ("my_tools:nope", "has no attribute 'nope'"),
        ("my_tools:NOT_CALLABLE", "'NOT_CALLABLE' is a int; point it at a function"),
        ("my_tools:Klass", "'Klass' is a type"),
        ("bad name=my_tools:shout", "'bad name' before '=' is not a tool name"),
        ("my_tools:", "unknown tool 'my_tools:'"),
    ],
)
def test_bad_specs_name_the_spec_and_the_fix(user_module, spec, message):
    with pytest.raises(ToolSpecError) as e:
        resolve_tools([spec])
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)


def test_duplicate_names(user_module):
    with pytest.raises(ToolSpecError, match="already listed; give one of them another name"):
        resolve_tools(["calc", "calc"])


def test_tool_names_are_identifiers():
    with pytest.raises(ValueError, match="must be an identifier"):
        Tool(name="my tool", description="", fn=str)
    with pytest.raises(ValueError, match="no callable"):
        Tool(name="t", description="", fn=textwrap)
