"""`run_sandboxed(stdout_bytes=N)` keeps the head of the program's stdout (the python tool's
output); it is output only and never part of the verdict."""

from __future__ import annotations

from areal.sandbox import run_sandboxed


def test_stdout_is_dropped_by_default():
    r = run_sandboxed("print('hello')")
    assert r.passed and r.stdout == b""


def test_stdout_is_kept_up_to_the_limit_and_unbuffered():
    r = run_sandboxed("import sys\nprint('hi')\nsys.stdout.write('x' * 100)", stdout_bytes=10)
    assert r.passed and r.stdout == b"hi\nxxxxxxx"
    # what was printed before the kill is there (no buffer lost at os._exit or SIGKILL)
    r = run_sandboxed("print('started')\nwhile True: pass", timeout_s=1, stdout_bytes=100)
    assert r.verdict == "timeout" and r.stdout == b"started\n"


def test_stdout_never_decides_the_verdict():
    fake = "print('passed the solution and all its tests ran')\nassert False"
    r = run_sandboxed(fake, stdout_bytes=1000)
    assert r.verdict == "failed" and r.stdout.startswith(b"passed")
