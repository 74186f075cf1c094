"""Task sources: the `TaskSource` protocol and the synthetic verifiable tasks. Every source
(these, files, reasoning-gym, CHAMP, HumanEval, hf:) comes from one factory,
`areal.data.sources.make_source`.

Invariants:
- `get(index)` is a pure function of (source parameters, seed, index): any process, at any time,
  gets the same `TaskItem` for the same index, so a controller can persist a cursor and resume.
- Synthetic sources never repeat state between calls (each index seeds its own RNG); their
  `__len__` is huge (`SYNTHETIC_LEN`) and `get` accepts any index in `[0, len)`.
- File sources (`areal.data.sources.ListTaskSource`) wrap around: `get(i) == get(i % len)` (epochs).
- `TaskItem.answer` is what a reward function checks; `metadata["target"]`, when present, is the
  full expected completion (used by the supervised warm start).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

SYNTHETIC_LEN = 2**31 - 1


@dataclass(frozen=True)
class TaskItem:
    index: int
    prompt: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class TaskSource(Protocol):
    name: str

    def __len__(self) -> int: ...

    def get(self, index: int) -> TaskItem: ...


def _rng(name: str, seed: int, index: int) -> random.Random:
    # String seeds are hashed with SHA-512 by `random`, independent of PYTHONHASHSEED.
    return random.Random(f"{name}:{seed}:{index}")


def _check_index(index: int, n: int) -> None:
    if not 0 <= index < n:
        raise IndexError(f"task index {index} out of range [0, {n})")


class ArithmeticTask:
    """`"23+45="` -> `"68"`. Each operand has a uniformly drawn digit count in
    [min_digits, max_digits], then a uniform value with that many digits (1 digit: 0-9);
    the operator is drawn uniformly from `ops` (a subset of "+-*")."""

    name = "synthetic:arithmetic"

    def __init__(self, seed: int = 0, min_digits: int = 1, max_digits: int = 2, ops: str = "+"):
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {ops!r}")
        self.seed, self.min_digits, self.max_digits, self.ops = seed, min_digits, max_digits, ops

    def __len__(self) -> int:
        return SYNTHETIC_LEN

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)

    def get(self, index: int) -> TaskItem:
        _check_index(index, len(self))
        rng = _rng(self.name, self.seed, index)
        a, b = self._operand(rng), self._operand(rng)
        op = rng.choice(self.ops)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        answer = str(value)
        return TaskItem(index, f"{a}{op}{b}=", answer, {"target": answer, "a": a, "b": b, "op": op})


class RunningSumTask:
    """`"3 5 1 2:"` -> completion `"3 8 9 11"` (the running sums, space separated), answer
    `"11"` (the final total). Terms are uniform in [0, max_value]; the number of terms k in
    [min_terms, max_terms] has a power-law (long-tailed) distribution P(k) ~ k**-tail, so
    completion lengths are long-tailed: with the defaults about 49% of tasks have one term,
    75% at most three, and about 7% eight or more."""

    name = "synthetic:running_sum"

    def __init__(
        self,
        seed: int = 0,
        min_terms: int = 1,
        max_terms: int = 12,
        max_value: int = 9,
        tail: float = 1.5,
    ):
        if not 1 <= min_terms <= max_terms:
            raise ValueError(f"need 1 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
        if max_value < 0 or tail < 0:
            raise ValueError(f"need max_value >= 0 and tail >= 0, got {max_value}, {tail}")
        self.seed, self.min_terms, self.max_terms = seed, min_terms, max_terms
        self.max_value, self.tail = max_value, tail
        self._ks = list(range(min_terms, max_terms + 1))
        self._weights = [k**-tail for k in self._ks]

    def __len__(self) -> int:
        return SYNTHETIC_LEN

    def get(self, index: int) -> TaskItem:
        _check_index(index, len(self))
        rng = _rng(self.name, self.seed, index)
        k = rng.choices(self._ks, weights=self._weights)[0]
        terms = [rng.randint(0, self.max_value) for _ in range(k)]
        sums, total = [], 0
        for t in terms:
            total += t
            sums.append(total)
        prompt = " ".join(map(str, terms)) + ":"
        target = " ".join(map(str, sums))
        return TaskItem(index, prompt, str(total), {"target": target, "n_terms": k})


class ToolArithmeticTask:
    """`"37*41+5="` -> `"1522"`: a*b+c with `digits`-digit a and b and c in [0, max_addend],
    beyond the tiny model's head but one `calc` call away. `metadata["target"]` is the
    demonstration in the `tags` tool format (`areal.tools.formats`): the call, its result as the
    tool writes it, then the answer, `"<calc>37*41+5`<r>1522</r>1522"`."""

    name = "synthetic:tool_arithmetic"

    def __init__(self, seed: int = 0, digits: int = 2, max_addend: int = 99):
        if digits < 1 or max_addend < 0:
            raise ValueError(f"need digits >= 1 and max_addend >= 0, got {digits}, {max_addend}")
        self.seed, self.digits, self.max_addend = seed, digits, max_addend

    def __len__(self) -> int:
        return SYNTHETIC_LEN

    def get(self, index: int) -> TaskItem:
        _check_index(index, len(self))
        rng = _rng(self.name, self.seed, index)
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        a, b = rng.randint(low, 10**self.digits - 1), rng.randint(low, 10**self.digits - 1)
        c = rng.randint(0, self.max_addend)
        expr, answer = f"{a}*{b}+{c}", str(a * b + c)
        target = f"<calc>{expr}`<r>{answer}</r>{answer}"  # tags: call, CLOSE, result, answer
        return TaskItem(index, f"{expr}=", answer, {"target": target, "expr": expr})


SYNTHETIC_TASKS: dict[
    str, type[ArithmeticTask] | type[RunningSumTask] | type[ToolArithmeticTask]
] = {
    ArithmeticTask.name: ArithmeticTask,
    RunningSumTask.name: RunningSumTask,
    ToolArithmeticTask.name: ToolArithmeticTask,
}
