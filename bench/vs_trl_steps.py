"""Split bench/vs_trl.py's time to reward into steps to reward x seconds per step.

Reads the per-step curves a vs_trl run wrote (`bench/results/vs_trl.json`, or `_long`) and
prints, per run and as medians per system, the step at which the rolling 10-step mean reward
first reaches each threshold, and the trainer's median seconds per step (after the first 10
steps, so start-up waits do not count). Learning per step and speed per step then read apart.

    python bench/vs_trl_steps.py [bench/results/vs_trl.json] [--thresholds 0.4,0.5,0.6,0.65]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

from _common import median_missed_last  # noqa: E402
from _rl import rolling  # noqa: E402


def steps_to(rewards: list[float], target: float, k: int = 10) -> int | None:
    """1-based step at which the rolling k-step mean first reaches `target` (step >= k)."""
    for i, m in enumerate(rolling(rewards, k)):
        if m >= target and i + 1 >= k:
            return i + 1
    return None


def per_step_s(walls: list[float], skip: int = 10) -> float | None:
    d = [b - a for a, b in zip(walls[skip:], walls[skip + 1 :], strict=False)]
    return statistics.median(d) if d else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="?", type=Path, default=_HERE / "results" / "vs_trl.json")
    ap.add_argument("--thresholds", default="0.4,0.5,0.6,0.65")
    args = ap.parse_args()
    ts = [float(x) for x in args.thresholds.split(",")]
    curves = json.loads(args.json.read_text())
    by_system: dict[str, list[tuple[list[int | None], float | None]]] = {}
    print("| run | " + " | ".join(f"steps→{t}" for t in ts) + " | s/step |")
    print("|---|" + "---|" * (len(ts) + 1))
    for name, c in curves.items():
        recs = c["records"]
        rewards = [float(r["reward_mean"]) for r in recs]
        steps = [steps_to(rewards, t) for t in ts]
        sps = per_step_s([float(r["wall_s"]) for r in recs])
        by_system.setdefault(name.rsplit("-", 1)[0], []).append((steps, sps))
        cells = ["n/r" if s is None else str(s) for s in steps]
        print(f"| {name} | " + " | ".join(cells) + f" | {sps:.3f} |")
    print()
    for system, rows in by_system.items():
        meds = []
        for j in range(len(ts)):
            steps = [r[0][j] for r in rows]  # a miss counts as slower than any that got there
            m = median_missed_last(steps)
            meds.append(("n/r" if m is None else f"{m:g}") + ("*" if None in steps else ""))
        sps = statistics.median([r[1] for r in rows if r[1] is not None])
        print(
            f"- {system}: median steps to "
            + ", ".join(f"{t}: {m}" for t, m in zip(ts, meds, strict=True))
            + f"; median s/step {sps:.3f} (n={len(rows)}; * = some runs never reached it: "
            "counted as slower than any that did)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
