"""The python tool runs the model's code in the code sandbox: its stdout and a final
expression's repr come back; errors, refusals and its time limit become records.

Each call is a sandboxed python process (~0.1-0.3 s). Timeouts here are the sandbox's own
limits for the programs that hang, not speed assertions."""

from __future__ import annotations

import asyncio
import textwrap

from areal.tools import ToolCall, ToolRunner, resolve_tools
from areal.tools.python import run_python, with_final_repr


def run(code: str, **kw) -> object:
    r = ToolRunner(resolve_tools(["python"]), **kw)
    return asyncio.run(r.run(ToolCall("python", textwrap.dedent(code))))


def test_stdout_and_the_final_expression():
    rec = run(
        """
        x = 6 * 7
        print("hi")
        x
        """
    )
    assert (rec.output, rec.error) == ("hi\n42\n", None)
    assert run("print('only this')\nNone").output == "only this\n"  # None: nothing shown
    assert run("y = 1").output == ""


def test_the_final_expression_rewrite_keeps_line_numbers():
    code = "a = 1\nb = [a,\n     2]  # two\nb + [3]  # three"
    rewritten = with_final_repr(code)
    assert rewritten.splitlines()[:3] == code.splitlines()[:3]
    assert run_python(code) == b"[1, 2, 3]\n"
    assert with_final_repr("def f(:\n") == "def f(:\n"  # not Python: the sandbox reports it
    assert with_final_repr("x = 1") == "x = 1"


def test_an_exception_names_its_line_and_keeps_the_output_before_it():
    rec = run("print('before')\nundefined_name")
    assert rec.error == "raised: NameError: name 'undefined_name' is not defined (line 2)"
    assert rec.output == "before\nerror: NameError: name 'undefined_name' is not defined (line 2)"
    assert run("def f(:\n  pass").error == "raised: SyntaxError: invalid syntax (line 1)"
    assert run("import sys; sys.exit(3)").error.startswith("raised: SystemExit(3)")


def test_the_time_limit_kills_the_program():
    rec = run("print('started', flush=True)\nwhile True: pass", timeout_s=1.0)
    assert rec.error == "timeout"
    assert rec.output == "started\nerror: timed out after 1s"


def test_no_network():
    rec = run(
        """
        import socket
        socket.create_connection(("1.1.1.1", 53), timeout=2)
        """
    )
    assert rec.error.startswith("raised: refused: socket.")


def test_no_host_files():
    rec = run("print(open('/etc/hostname').read())")
    assert rec.error.startswith("raised: refused: open '/etc/hostname'")


def test_huge_output_is_capped():
    rec = run("print('x' * 100_000)", max_output_bytes=100)
    assert rec.error is None
    assert rec.output.startswith("x" * 100 + "\n[... ")
    assert rec.output.endswith(" more bytes cut]")


def test_binary_output():
    rec = run("import sys\nsys.stdout.buffer.write(bytes(range(256)) * 4)\nNone")
    assert rec.output == "[binary output: 1024 bytes]"


def test_calls_run_concurrently_in_their_own_sandboxes():
    # Each program writes a file in its work dir and lists it: each sees only its own (a
    # fresh dir per run; the sandbox's own tests cover the rest of its isolation).
    code = """
    import os
    open("mine", "w").write("x")
    sorted(os.listdir("."))
    """
    r = ToolRunner(resolve_tools(["python"]))

    async def many():
        return await asyncio.gather(
            *(r.run(ToolCall("python", textwrap.dedent(code))) for _ in range(3))
        )

    recs = asyncio.run(many())
    assert [rec.output for rec in recs] == ["['mine']\n"] * 3
