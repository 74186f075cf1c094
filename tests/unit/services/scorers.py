"""User scorers for the reward-service tests (importable by the spawned pool processes)."""

from __future__ import annotations

import time


def picky(completion: str, answer: str) -> float:
    """1 if right; raises on 'boom'; hangs on 'hang'."""
    if completion == "boom":
        raise ValueError("scorer exploded")
    if completion == "hang":
        time.sleep(60)
    return float(completion.strip() == answer.strip())
