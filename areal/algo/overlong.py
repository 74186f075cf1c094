"""DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), as a reward term.

Invariants:
- With L = max_new_tokens and C = buffer: 0 for a completion of at most L - C tokens, then a
  linear ramp to -penalty at L tokens; a completion cut at the limit (finish reason "length")
  gets -penalty whatever its length. Never positive, never below -penalty.
- buffer 0 penalises only cut completions; buffer >= L ramps over the whole range.
"""

from __future__ import annotations


def overlong_penalty(
    n_tokens: int, finish_reason: str, *, max_new_tokens: int, buffer: int, penalty: float
) -> float:
    """The reward term for a completion of `n_tokens` tokens (see the module invariants)."""
    if finish_reason == "length":
        return -penalty
    start = max_new_tokens - buffer
    if buffer <= 0 or n_tokens <= start:
        return 0.0
    return -penalty * min(1.0, (n_tokens - start) / buffer)
