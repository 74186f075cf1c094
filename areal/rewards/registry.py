"""Reward-function registry: built-in scorers by name, user scorers as `module:function`.

Invariants:
- A reward function is `(completion: str, answer: str) -> float`, pure and picklable (a
  module-level function), so reward workers can run it in a process pool.
- `get_reward_fn` fails fast, at start-up, with a ValueError that names the spec and the fix;
  it never returns something that is not callable, and an exception raised while importing the
  user's module (a syntax error, a failing top-level statement) becomes that ValueError too.
- Where `module:function` is looked up: the installed packages and `PYTHONPATH` first, then the
  current working directory (`CWD_RULE`). `areal run` and its workers share one working
  directory, so a `my_reward.py` next to the YAML you run from works without `PYTHONPATH=.`; a
  worker on another host needs the module in its own working directory or on its path.
"""

from __future__ import annotations

from collections.abc import Callable

from areal.rewards.code import code_reward
from areal.rewards.math import math_reward
from areal.rewards.synthetic import (
    arithmetic_reward,
    running_sum_reward,
    tool_arithmetic_reward,
)
from areal.user_code import load_user_attr

RewardFn = Callable[[str, str], float]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "arithmetic": arithmetic_reward,
    "running_sum": running_sum_reward,
    "tool_arithmetic": tool_arithmetic_reward,
    "math": math_reward,
    "code": code_reward,
}


_DEFAULT_FOR_TASK = {
    "synthetic:arithmetic": "arithmetic",
    "synthetic:running_sum": "running_sum",
    "synthetic:tool_arithmetic": "tool_arithmetic",
}


def get_reward_fn(name: str) -> RewardFn:
    """A built-in name (`arithmetic`, `running_sum`, `tool_arithmetic`, `math`, `code`) or
    `package.module:function` (the module is looked up by `CWD_RULE`, in every process that
    scores)."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        raise ValueError(
            f"unknown reward function {name!r}: use one of {sorted(BUILTIN_REWARDS)} "
            "or 'package.module:function' for your own (completion, answer) -> float"
        )
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward spec {name!r} must look like 'package.module:function'")
    fn = load_user_attr(module_name, attr, f"reward spec {name!r}")
    if not callable(fn):
        raise ValueError(
            f"reward spec {name!r}: {attr!r} is a {type(fn).__name__}, not a callable; "
            "point it at a function (completion: str, answer: str) -> float"
        )
    return fn  # type: ignore[return-value]


def default_reward_for(task_spec: str) -> str:
    """The reward name that matches a task spec: the synthetic tasks have their own scorer,
    `humaneval[:file]` is `code`, everything else (reasoning_gym generators, CHAMP, .jsonl /
    .parquet files) defaults to `math`."""
    if task_spec in _DEFAULT_FOR_TASK:
        return _DEFAULT_FOR_TASK[task_spec]
    if task_spec.partition(":")[0] == "humaneval":
        return "code"
    if task_spec.startswith("synthetic:"):
        raise ValueError(
            f"no default reward for unknown synthetic task {task_spec!r}; "
            f"known tasks: {sorted(_DEFAULT_FOR_TASK)}"
        )
    return "math"
