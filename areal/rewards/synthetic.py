"""Rewards for the built-in synthetic tasks (`areal.data.tasks`).

Invariants:
- A completion ends at its first end-of-sequence: the first newline or the first literal
  `<eos>` (what a decode without `skip_special_tokens` shows). Text after it never counts.
- Pure, text in, float out, exactly 0.0 or 1.0; never raise.
"""

from __future__ import annotations

import re

EOS_TEXT = "<eos>"
RESULT_CLOSE = "</r>"  # ends a tool result in the `tags` format (`areal.tools.formats`)
_INT_RE = re.compile(r"-?\d+")


def cut_completion(completion: str) -> str:
    """The completion up to (not including) its first newline or `<eos>`, stripped."""
    for stop in (EOS_TEXT, "\n"):
        completion = completion.split(stop, 1)[0]
    return completion.strip()


def arithmetic_reward(completion: str, answer: str) -> float:
    """1.0 iff the cut completion is exactly the answer (`"68"` for `"23+45="`)."""
    return 1.0 if cut_completion(completion) == answer.strip() else 0.0


def running_sum_reward(completion: str, answer: str) -> float:
    """1.0 iff the last integer of the cut completion equals the answer (the final total);
    the intermediate running sums are the model's scratchpad and are not checked."""
    numbers = _INT_RE.findall(cut_completion(completion))
    if not numbers:
        return 0.0
    try:
        return 1.0 if int(numbers[-1]) == int(answer.strip()) else 0.0
    except ValueError:
        return 0.0


def tool_arithmetic_reward(completion: str, answer: str) -> float:
    """1.0 iff what follows the last tool result (`</r>`), cut at its first end of sequence, is
    exactly the answer; with no result, the cut completion is: `"<calc>37*41+5<r>1522</r>1522"`
    scores 1.0 against `"1522"`. The call and the result are not checked, only the answer the
    model gave after them (a result it wrote itself, without the tool, is no help to it). The
    tail is taken before the cut: a tool's result may hold a newline."""
    tail = completion.rsplit(RESULT_CLOSE, 1)[-1]
    return 1.0 if cut_completion(tail) == answer.strip() else 0.0
