"""Code-execution reward: run the completion's Python code plus assert-based tests in a sandbox.

Invariants:
- The program is the completion's code (the last ```python block if any, else the first plain
  ``` block, else the whole text) followed by `answer` (the tests): `code + "\n\n" + answer`.
  Reward 1.0 iff it exits 0.
- An `answer` holding the line `CODE_TESTS_MARKER` is `preamble + marker line + tests`: the
  program is then `preamble`, the code, then `tests` (the preamble supplies what the code may
  assume, such as the prompt's imports). Only the first marker line splits; without one, the
  whole `answer` is tests.
- `humaneval_answer(problem)` is such an answer for a HumanEval problem: the preamble is the
  import lines (`import ...` / `from ...`) at the top of its `prompt` (before the first other
  non-blank line), the tests are its `test` followed by `check(<entry_point>)`. So a completion
  that restates the function without the prompt's imports (`List` in an annotation) still runs.
- The child runs `python -I` (no user site, no PYTHON* variables, no cwd on sys.path) in a fresh
  temporary directory (removed afterwards), with a minimal environment (PATH, LANG, HOME=tmp:
  nothing from the parent's environment such as tokens or keys), address-space, CPU-time,
  file-size and core-dump limits, and its own session so a timeout kills the whole process
  group (children included). The program dies with the process that runs it (SIGKILL
  included: PR_SET_PDEATHSIG), so a killed reward worker leaves no program running; a
  descendant that left the program's session is not covered.
- `code_reward` never raises for bad, hostile or hanging code; it returns 0.0.

This is a resource sandbox, not a security boundary: code still sees the filesystem and the
network with the worker's permissions. Run reward workers in a container for untrusted code.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from areal.proc import die_with_parent

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_BYTES = 1 << 30
MAX_FILE_BYTES = 16 << 20
CODE_TESTS_MARKER = "# --- areal: tests ---"
_MARKER_LINE_RE = re.compile(rf"^{re.escape(CODE_TESTS_MARKER)}[ \t]*(?:\r?\n|\Z)", re.MULTILINE)
_BLOCK_RE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class CodeResult:
    passed: bool
    returncode: int | None  # None when killed for the timeout
    timed_out: bool
    stderr_tail: str  # last ~2 KB of stderr, for debugging and dead-letter reasons


def extract_code(completion: str) -> str:
    """The code a completion proposes: the last ```python / ```py block, else the first
    fenced block of any language, else the whole completion."""
    blocks = _BLOCK_RE.findall(completion)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    if blocks:
        return blocks[0][1]
    return completion


def build_program(code: str, answer: str) -> str:
    """The program run for `code` and `answer` (see the module invariants)."""
    marker = _MARKER_LINE_RE.search(answer)
    if marker is None:
        return f"{code}\n\n{answer}\n"
    preamble, tests = answer[: marker.start()], answer[marker.end() :]
    return f"{preamble}\n\n{code}\n\n{tests}\n"


def humaneval_answer(problem: dict[str, str]) -> str:
    """The `answer` for a HumanEval problem (`prompt`, `test`, `entry_point`): its prompt's
    leading imports as the preamble, its `check` called on the entry point as the tests."""
    imports = []
    for line in problem["prompt"].splitlines():
        if line.startswith(("import ", "from ")):
            imports.append(line)
        elif line.strip():
            break
    preamble = "".join(f"{line}\n" for line in imports)
    tests = f"{problem['test']}\ncheck({problem['entry_point']})\n"
    return f"{preamble}{CODE_TESTS_MARKER}\n{tests}"


def _limits(timeout_s: float, memory_bytes: int, parent_pid: int) -> None:
    # Runs in the child between fork and exec: only async-signal-safe-ish calls, no imports.
    # The program dies with the scoring process, even if that is SIGKILLed mid-run.
    die_with_parent(signal.SIGKILL, parent_pid)
    cpu = max(1, int(timeout_s) + 1)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `pid` to exit WITHOUT reaping it; True if it exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.01)
    return False


def run_code(
    program: str, timeout_s: float = DEFAULT_TIMEOUT_S, memory_bytes: int = DEFAULT_MEMORY_BYTES
) -> CodeResult:
    """Run `program` in the sandbox described in the module docstring."""
    parent = os.getpid()
    with tempfile.TemporaryDirectory(prefix="areal-code-") as tmp:
        script = Path(tmp) / "program.py"
        script.write_text(program, encoding="utf-8")
        stderr_path = Path(tmp) / "stderr.txt"
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp}
        with open(stderr_path, "wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-I", str(script)],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                preexec_fn=lambda: _limits(timeout_s, memory_bytes, parent),
                start_new_session=True,
                close_fds=True,
            )
            try:
                timed_out = not _wait_unreaped(proc.pid, timeout_s)
            finally:
                # The leader is alive or an unreaped zombie, so its process group id cannot have
                # been reused: killing the group reaches exactly the program and its children.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with open(stderr_path, "rb") as f:
            f.seek(max(0, stderr_path.stat().st_size - 2048))
            tail = f.read().decode("utf-8", errors="replace")
    code = None if timed_out else proc.returncode
    return CodeResult(passed=code == 0, returncode=code, timed_out=timed_out, stderr_tail=tail)


def code_reward(completion: str, answer: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 iff the completion's code, between the preamble and the tests of `answer`, exits with
    status 0."""
    program = build_program(extract_code(completion), answer)
    try:
        return 1.0 if run_code(program, timeout_s=timeout_s).passed else 0.0
    except Exception:  # sandbox setup failures (e.g. out of fds) must not kill a reward worker
        return 0.0
