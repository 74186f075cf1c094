"""Writes the warm-start data of the two JSONL examples: `math_warm.jsonl` (512 word problems)
and `code_warm.jsonl` (256 function tasks), problems of the same kinds as `math.jsonl` and
`code.jsonl` but none of their prompts, so the tiny model learns the format and some of the
skill, not the answers RL then trains on (`model.warm_start_source`).

    python examples/data/make_warm.py      # deterministic: rewrites the same two files
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 44
NAMES = ["Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Ivy"]
THINGS = ["apples", "eggs", "cups", "pens", "coins", "books"]
# function names, the RL set's among them (in other tasks): the tiny character model does not
# learn to copy a name it has never seen within a few hundred steps
FUNCTIONS = [
    "add", "sub", "mul", "neg", "sq", "inc", "first", "size", "dec", "last", "total", "top",
    "f", "g", "h", "calc", "half", "twice", "diff", "prod", "plus", "minus", "get", "head",
    "tail", "count", "big", "step", "flip", "scale",
]  # fmt: skip


def math_problem(rng: random.Random) -> tuple[str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 19), rng.randint(2, 9)
        return f"{name} has {a} {thing} and gets {b} more. How many {thing}? ", a + b
    if kind == 1:
        a = rng.randint(4, 19)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {thing} and gives away {b}. How many are left? ", a - b
    if kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 15)
        return f"{name} buys {a} bags of {b} {thing}. How many {thing}? ", a * b
    k, q = rng.randint(2, 9), rng.randint(2, 19)
    return f"{name} shares {k * q} {thing} among {k} friends. How many each? ", q


def _one_arg() -> list[tuple[str, str, Callable[[int], int]]]:
    out: list[tuple[str, str, Callable[[int], int]]] = [
        ("-x", "-x", lambda x: -x),
        ("x squared", "x * x", lambda x: x * x),
    ]
    for k in range(1, 10):
        out += [(f"x + {k}", f"x + {k}", lambda x, k=k: x + k)]
    for k in range(1, 10):
        out += [(f"x - {k}", f"x - {k}", lambda x, k=k: x - k)]
    for k in range(2, 10):
        out += [(f"x * {k}", f"x * {k}", lambda x, k=k: x * k)]
    return out


LIST_OPS: list[tuple[str, str, Callable[[list[int]], int]]] = [
    ("the first item of xs", "xs[0]", lambda xs: xs[0]),
    ("the last item of xs", "xs[-1]", lambda xs: xs[-1]),
    ("the length of xs", "len(xs)", len),
    ("the sum of xs", "sum(xs)", sum),
    ("the largest item of xs", "max(xs)", max),
]
BINOPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def code_task(rng: random.Random) -> dict[str, str]:
    """A {prompt, test, target, entry_point} record in code.jsonl's format."""
    name = rng.choice(FUNCTIONS)
    kind = rng.randrange(4)
    if kind == 0:
        op = rng.choice(list(BINOPS))
        prompt = f"Write {name}(a, b) that returns a {op} b.\n"
        target = f"def {name}(a, b):\n    return a {op} b\n"
        cases = [(rng.randint(-9, 9), rng.randint(-9, 9)) for _ in range(2)]
        test = "".join(f"assert {name}({a}, {b}) == {BINOPS[op](a, b)}\n" for a, b in cases)
    elif kind == 1:
        what, expr, fn = rng.choice(_one_arg())
        prompt = f"Write {name}(x) that returns {what}.\n"
        target = f"def {name}(x):\n    return {expr}\n"
        xs = (rng.randint(-9, 9), rng.randint(-9, 9))
        test = "".join(f"assert {name}({x}) == {fn(x)}\n" for x in xs)
    else:
        what, expr, fn_list = rng.choice(LIST_OPS)
        prompt = f"Write {name}(xs) that returns {what}.\n"
        target = f"def {name}(xs):\n    return {expr}\n"
        lists = [[rng.randint(0, 9) for _ in range(rng.randint(1, 4))] for _ in range(2)]
        test = "".join(f"assert {name}({xs}) == {fn_list(xs)}\n" for xs in lists)
    return {"prompt": prompt, "test": test, "target": target, "entry_point": name}


def _prompts(path: Path) -> set[str]:
    return {json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()}


def main() -> None:
    rng, seen = random.Random(SEED), _prompts(HERE / "math.jsonl")
    math_rows: list[dict] = []
    while len(math_rows) < 512:
        prompt, answer = math_problem(rng)
        if prompt not in seen:
            seen.add(prompt)
            math_rows.append({"id": f"warm-{len(math_rows)}", "prompt": prompt, "answer": answer})
    rng, seen = random.Random(SEED), _prompts(HERE / "code.jsonl")
    code_rows: list[dict] = []
    while len(code_rows) < 256:
        task = code_task(rng)
        if task["prompt"] not in seen:
            seen.add(task["prompt"])
            exec(task["target"] + task["test"], {})  # every test passes with its target
            code_rows.append({"task_id": f"warm/{len(code_rows)}", **task})
    for name, rows in (("math_warm.jsonl", math_rows), ("code_warm.jsonl", code_rows)):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
