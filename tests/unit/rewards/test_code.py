"""Code sandbox: pass, fail, crash, timeout, infinite loop, memory, env isolation."""

from __future__ import annotations

import os
import time

import pytest

from areal.rewards.code import (
    SandboxViolation,
    code_reward,
    code_reward_detail,
    extract_code,
    run_code,
)

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"


def test_passing_code_in_a_python_block():
    completion = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert code_reward(completion, TESTS) == 1.0


def test_plain_code_without_a_block():
    assert code_reward("def add(a, b):\n    return a + b\n", TESTS) == 1.0


def test_failing_assertion_and_syntax_error():
    assert code_reward("def add(a, b):\n    return a - b\n", TESTS) == 0.0
    assert code_reward("def add(a, b) return a + b", TESTS) == 0.0
    assert code_reward("", TESTS) == 0.0


def test_exit_status_decides_nothing():
    # exiting before the tests ran is a hack, not a pass: the verdict comes from the harness
    with pytest.raises(SandboxViolation):
        code_reward("import sys\nsys.exit(0)", "assert False")
    assert code_reward_detail("import sys\nsys.exit(3)", "")[0] == 0.0


def test_infinite_loop_times_out_quickly():
    start = time.monotonic()
    result = run_code("while True:\n    pass\n", timeout_s=1.0)
    assert result.timed_out and not result.passed and result.returncode is None
    assert time.monotonic() - start < 60.0  # a hang guard: the CPU limit ends it
    assert code_reward("import time\ntime.sleep(60)", "", timeout_s=0.5) == 0.0


def test_memory_limit():
    result = run_code("x = bytearray(4 << 30)\n", memory_bytes=512 << 20)
    assert not result.passed and "MemoryError" in result.stderr_tail


def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("AREAL_SECRET_TOKEN", "hunter2")
    program = "import os\nassert 'AREAL_SECRET_TOKEN' not in os.environ, dict(os.environ)\n"
    assert run_code(program).passed


def test_runs_in_a_temp_dir_that_is_removed():
    result = run_code("import os\nprint(os.getcwd())\nraise SystemExit(os.getcwd())")
    cwd = result.stderr_tail.strip()
    assert "areal-code-" in cwd and not os.path.exists(cwd)


def test_extract_code_prefers_the_last_python_block():
    text = "```\nfirst\n```\n```python\nold\n```\n```py\nnew\n```"
    assert extract_code(text) == "new\n"
    assert extract_code("```js\nx\n```") == "x\n"
    assert extract_code("plain") == "plain"
