"""`bench/_vs_trl_report.py`: a repeat that never reaches a reward counts as the slowest in the
median time to it (not left out, which would favour the system that missed), and the per-repeat
comparison says who got there first."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path[:0] = [str(BENCH)]

from _rl import RunResult  # noqa: E402
from _vs_trl_report import paired_lines, summary_lines, ttt_median  # noqa: E402


def run(name: str, rewards: list[float], step_s: float = 1.0) -> RunResult:
    records = [
        {"step": i + 1, "wall_s": (i + 1) * step_s, "reward_mean": r, "samples": 8, "tokens": 8}
        for i, r in enumerate(rewards)
    ]
    return RunResult(name, Path("."), [], 0, 0.0, records=records)


def reaches_at(step: int, n: int = 30) -> list[float]:
    """Rewards whose rolling 10-step mean first reaches 1.0 at `step` (0 never)."""
    return [0.0 if step == 0 or i + 1 <= step - 10 else 1.0 for i in range(n)]


def test_a_run_that_never_got_there_counts_as_the_slowest():
    rs = [run(f"a-{i}", reaches_at(s)) for i, s in enumerate([12, 14, 0])]
    assert ttt_median(rs, 1.0) == 14.0  # not 13.0, the median of the two that got there
    assert ttt_median(rs[:1] + [run("x", reaches_at(0)), run("y", reaches_at(0))], 1.0) is None


def test_per_repeat_ratios_and_wins():
    runs = {
        "areal": [run("areal-0", reaches_at(12)), run("areal-1", reaches_at(0))],
        "trl": [run("trl-0", reaches_at(18)), run("trl-1", reaches_at(20))],
    }
    (line,) = paired_lines(runs, 1.0)
    assert "1.50x, areal n/r" in line and "areal first in 1 of 2" in line
    lines = summary_lines({k: v[:1] for k, v in runs.items()}, {}, (1.0,))
    assert lines[0] == "- time to reward 1.0: areal 12.0 s, TRL 18.0 s: areal 1.50x"
