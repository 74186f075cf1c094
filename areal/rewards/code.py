"""Code-execution reward: the completion's Python code, then assert-based tests, in a sandbox.

Invariants:
- The code is the completion's last ```python block if any, else its first plain ``` block,
  else the whole text. `answer` is the tests; an `answer` holding the line `CODE_TESTS_MARKER`
  is `preamble + marker line + tests` (the preamble supplies what the code may assume, such as
  the prompt's imports). Only the first marker line splits; without one, all of it is tests.
  `build_program` shows the order they run in: preamble, code, tests.
- `humaneval_answer(problem)` is such an answer for a HumanEval problem: the preamble is its
  `prompt`'s code before the entry point's `def` (the imports, and the helpers a few prompts
  define: `poly`, `encode_cyclic`, ...); the tests are that same code again, then its `test`,
  then `check(<entry_point>)`. So a completion that restates the function without the prompt's
  imports (`List` in an annotation) still runs, and the tests call their own helpers: a
  completion that redefines `encode_cyclic` as the identity (with `decode_cyclic` to match)
  changes nothing they call. Without such a `def` line, the preamble is the prompt's leading
  import lines.
- Reward 1.0 iff the sandbox's harness reports that the code and every test ran
  (`areal/sandbox/run.py`): the exit status decides nothing, so exiting before the tests,
  killing the harness or printing a success line scores 0. The tests compare plain data only
  (`areal/sandbox/harness.py`): an object whose `__eq__` always says yes, or a subclass of int,
  str, list, ... returned by the code or compared by the tests scores 0.
- `code_reward_detail` never raises for bad, hostile or hanging code: it returns the reward and
  `{"verdict", "reason", "isolation"}`. `code_reward` returns 0.0 for a wrong answer, an
  exception or a timeout, and raises `SandboxViolation` (an Exception, so the scoring API gives
  reward 0 with the reason in `verifier["error"]`) for a hostile run: a refused operation
  (network, files outside its dir, signals, exec, introspection), an exit or a death before the
  tests reported. A sandbox that cannot be set up raises its OSError the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from areal.sandbox import (
    DEFAULT_MEMORY_BYTES,
    DEFAULT_TIMEOUT_S,
    MAX_FILE_BYTES,
    SandboxResult,
    run_sandboxed,
)

__all__ = [
    "CODE_TESTS_MARKER",
    "DEFAULT_MEMORY_BYTES",
    "DEFAULT_TIMEOUT_S",
    "MAX_FILE_BYTES",
    "CodeResult",
    "SandboxViolation",
    "build_program",
    "code_reward",
    "code_reward_detail",
    "extract_code",
    "humaneval_answer",
    "run_code",
    "split_answer",
]

CODE_TESTS_MARKER = "# --- areal: tests ---"
_MARKER_LINE_RE = re.compile(rf"^{re.escape(CODE_TESTS_MARKER)}[ \t]*(?:\r?\n|\Z)", re.MULTILINE)
_BLOCK_RE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


class SandboxViolation(Exception):
    """A hostile run (see the module): reward 0, and the reason for `verifier["error"]`."""


@dataclass(frozen=True)
class CodeResult:
    passed: bool
    returncode: int | None  # the harness's exit status; None when killed for the timeout
    timed_out: bool
    stderr_tail: str  # last ~2 KB of stderr (tracebacks), for debugging and dead-letter reasons
    verdict: str = ""  # passed | failed | violation | timeout
    reason: str = ""  # one line: why


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


def split_answer(answer: str) -> tuple[str, str]:
    """`(preamble, tests)` of an answer (see the module invariants)."""
    marker = _MARKER_LINE_RE.search(answer)
    if marker is None:
        return "", answer
    return answer[: marker.start()], answer[marker.end() :]


def build_program(code: str, answer: str) -> str:
    """`code` and `answer` as one program, in the order the sandbox runs them (it compiles the
    three parts apart, so an unclosed string in the code cannot swallow the tests)."""
    marker = _MARKER_LINE_RE.search(answer)
    if marker is None:
        return f"{code}\n\n{answer}\n"
    preamble, tests = split_answer(answer)
    return f"{preamble}\n\n{code}\n\n{tests}\n"


def humaneval_answer(problem: dict[str, str]) -> str:
    """The `answer` for a HumanEval problem (`prompt`, `test`, `entry_point`): its prompt's code
    before the entry point as the preamble, that code and its `check` called on the entry point
    as the tests (see the module invariants)."""
    context = _prompt_context(problem["prompt"], problem["entry_point"])
    preamble = f"{context}\n" if context else ""
    tests = f"{problem['test']}\ncheck({problem['entry_point']})\n"
    if context:
        tests = f"{context}\n\n\n{tests}"
    return f"{preamble}{CODE_TESTS_MARKER}\n{tests}"


def _prompt_context(prompt: str, entry_point: str) -> str:
    """The prompt's code before `def <entry_point>(`; without that line, its leading imports."""
    lines = prompt.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"def {entry_point}("):
            return "\n".join(lines[:i]).strip()
    imports = []
    for line in lines:
        if line.startswith(("import ", "from ")):
            imports.append(line)
        elif line.strip():
            break
    return "\n".join(imports)


def run_code(
    program: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    *,
    tests: str = "",
    preamble: str = "",
) -> CodeResult:
    """Run `preamble`, `program` (untrusted), then `tests` in the sandbox; passed iff the harness
    reports that all of it ran (see `areal/sandbox/run.py`)."""
    r = run_sandboxed(program, tests, preamble, timeout_s=timeout_s, memory_bytes=memory_bytes)
    return _code_result(r)


def _code_result(r: SandboxResult) -> CodeResult:
    timed_out = r.verdict == "timeout"
    return CodeResult(
        passed=r.passed,
        returncode=None if timed_out else r.returncode,
        timed_out=timed_out,
        stderr_tail=r.stderr_tail,
        verdict=r.verdict,
        reason=r.reason,
    )


def code_reward_detail(
    completion: str, answer: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[float, dict[str, str]]:
    """The reward and why: `{"verdict", "reason", "isolation"}`; never raises for the code."""
    preamble, tests = split_answer(answer)
    r = run_sandboxed(extract_code(completion), tests, preamble, timeout_s=timeout_s)
    detail = {"verdict": r.verdict, "reason": r.reason, "isolation": r.isolation}
    return (1.0 if r.passed else 0.0), detail


def code_reward(completion: str, answer: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 iff the completion's code and every test of `answer` ran; raises `SandboxViolation`
    for a hostile run (see the module invariants)."""
    reward, detail = code_reward_detail(completion, answer, timeout_s)
    if detail["verdict"] == "violation":
        raise SandboxViolation(detail["reason"])
    return reward
