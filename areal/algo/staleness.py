"""The staleness rule (AReaL eq. 3 and the intake check), shared by controller and trainer.

Notation (DESIGN section 4): B = tasks per training step (``batch_size``), η = ``max_staleness``,
i = latest published policy version (``version``). For admission the caller passes the number
of training steps whose weights are published: the same, except after a trainer restart rolled
the version forward past versions whose steps it redoes (``TrainerState.published_steps``).

Invariants:
- Admission: a task may be admitted only while ``outstanding + 1 <= (i + η + 1) * B``, where
  ``outstanding`` counts admitted tasks minus those dropped or filtered (they return their slot).
  η = 0 is synchronous RL: at most ``(i + 1) * B`` tasks ever exist for version i.
- Intake: a sample is trained on only if its oldest token was generated at a version
  ``>= i - η``; a sample's staleness is measured from its oldest token, never its newest.
- Staleness is never negative (a token newer than ``i`` counts as lag 0).
- All functions are pure and total on valid input; invalid arguments raise ``ValueError``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

__all__ = [
    "admissible_count",
    "admission_capacity",
    "can_admit",
    "is_fresh",
    "sample_staleness",
    "staleness_histogram",
]


def _check(max_staleness: int, batch_size: int) -> None:
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")


def admission_capacity(version: int, max_staleness: int, batch_size: int) -> int:
    """Most tasks that may be outstanding at policy ``version``: ``(i + η + 1) * B``."""
    _check(max_staleness, batch_size)
    return (version + max_staleness + 1) * batch_size


def can_admit(outstanding: int, version: int, max_staleness: int, batch_size: int) -> bool:
    """True iff one more task fits: ``outstanding + 1 <= (i + η + 1) * B``."""
    return outstanding + 1 <= admission_capacity(version, max_staleness, batch_size)


def admissible_count(outstanding: int, version: int, max_staleness: int, batch_size: int) -> int:
    """How many more tasks may be admitted right now (never negative)."""
    return max(0, admission_capacity(version, max_staleness, batch_size) - outstanding)


def sample_staleness(current_version: int, min_token_version: int) -> int:
    """Lag of a sample, measured from its oldest token: ``max(0, i - v_min)``."""
    return max(0, current_version - min_token_version)


def is_fresh(current_version: int, min_token_version: int, max_staleness: int) -> bool:
    """Intake check: True iff ``v_min >= i - η`` (staleness exactly η is still fresh)."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return min_token_version >= current_version - max_staleness


def staleness_histogram(current_version: int, versions: Iterable[int]) -> dict[int, int]:
    """Map lag -> count for per-token or per-sample versions, sorted by lag."""
    counts = Counter(sample_staleness(current_version, v) for v in versions)
    return dict(sorted(counts.items()))
