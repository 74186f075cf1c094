"""A custom reward for `reward.fn: examples.custom_reward:close_answer`.

A reward is a plain module-level function, text in, float out: reward workers import it by name
and call it in a process pool (so it must be picklable: defined at the top level of a module),
with a per-sample timeout. It must not raise on any completion; anything it returns besides a
float in [0, 1] is the reward as it is.
"""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


def close_answer(completion: str, answer: str) -> float:
    """1.0 for the exact answer; 0.5 / 0.25 for one that is off by 1 / 2 (a shaped reward:
    near misses give RL a gradient toward the right digit); 0.0 otherwise or for no number."""
    found = _INT.search(completion.split("\n", 1)[0])
    if found is None:
        return 0.0
    miss = abs(int(found.group()) - int(answer))
    return {0: 1.0, 1: 0.5, 2: 0.25}.get(miss, 0.0)
