"""Reward-function registry: built-in scorers by name, user scorers as `module:function`.

Invariants:
- A reward function is `(completion: str, answer: str) -> float`, pure and picklable (a
  module-level function), so reward workers can run it in a process pool.
- `get_reward_fn` fails fast, at start-up, with a ValueError that names the spec and the fix;
  it never returns something that is not callable.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from areal.rewards.code import code_reward
from areal.rewards.math import math_reward
from areal.rewards.synthetic import arithmetic_reward, running_sum_reward

RewardFn = Callable[[str, str], float]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "arithmetic": arithmetic_reward,
    "running_sum": running_sum_reward,
    "math": math_reward,
    "code": code_reward,
}

_DEFAULT_FOR_TASK = {
    "synthetic:arithmetic": "arithmetic",
    "synthetic:running_sum": "running_sum",
}


def get_reward_fn(name: str) -> RewardFn:
    """A built-in name (`arithmetic`, `running_sum`, `math`, `code`) or `package.module:function`
    (the module must be importable in the reward worker's environment)."""
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
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"reward spec {name!r}: cannot import module {module_name!r} ({e}); "
            "install it or add its directory to PYTHONPATH for the reward workers"
        ) from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(
                f"reward spec {name!r}: module {module_name!r} has no attribute {attr!r}; "
                "check the function name after the ':'"
            )
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(
            f"reward spec {name!r}: {attr!r} is a {type(fn).__name__}, not a callable; "
            "point it at a function (completion: str, answer: str) -> float"
        )
    return fn  # type: ignore[return-value]


def default_reward_for(task_spec: str) -> str:
    """The reward name that matches a task spec: the synthetic tasks have their own scorer,
    dataset files (.jsonl / .parquet) default to `math`."""
    if task_spec in _DEFAULT_FOR_TASK:
        return _DEFAULT_FOR_TASK[task_spec]
    if task_spec.startswith("synthetic:"):
        raise ValueError(
            f"no default reward for unknown synthetic task {task_spec!r}; "
            f"known tasks: {sorted(_DEFAULT_FOR_TASK)}"
        )
    return "math"
