"""`bench/vs_trl_steps.py`: steps to a reward threshold and seconds per step, from the curves
`bench/vs_trl.py` writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path[:0] = [str(BENCH)]

from vs_trl_steps import per_step_s, steps_to  # noqa: E402


def test_steps_to_uses_the_rolling_mean_from_step_k():
    rewards = [0.0] * 5 + [1.0] * 20
    # rolling 10-step mean: 0.5 first at step 10 (5 of 10 ones), 0.8 at step 13
    assert steps_to(rewards, 0.5) == 10
    assert steps_to(rewards, 0.8) == 13
    assert steps_to([1.0] * 9, 0.5) is None  # fewer than k steps: never
    assert steps_to(rewards, 1.01) is None


def test_per_step_s_skips_the_first_steps():
    walls = [5.0] + [5.0 + 0.2 * i for i in range(1, 30)]  # a slow first step, then 0.2 s
    assert abs(per_step_s(walls) - 0.2) < 1e-9
    assert per_step_s(walls[:5]) is None


def test_report_from_curves(tmp_path):
    def curve(rewards, dt):
        return {
            "startup_s": 1.0,
            "eval": 0.5,
            "records": [
                {"step": i + 1, "wall_s": dt * (i + 1), "reward_mean": r}
                for i, r in enumerate(rewards)
            ],
        }

    curves = {
        "areal-0": curve([0.0] * 5 + [1.0] * 20, 0.1),
        "trl-0": curve([0.0] * 2 + [1.0] * 23, 0.3),
    }
    path = tmp_path / "vs_trl.json"
    path.write_text(json.dumps(curves))
    out = subprocess.run(
        [sys.executable, str(BENCH / "vs_trl_steps.py"), str(path), "--thresholds", "0.5,0.8"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "| areal-0 | 10 | 13 | 0.100 |" in out
    assert "| trl-0 | 10 | 10 | 0.300 |" in out
    assert "- areal: median steps to 0.5: 10, 0.8: 13; median s/step 0.100" in out
