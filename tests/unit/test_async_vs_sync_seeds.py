"""`bench/async_vs_sync_seeds.py`: per-seed time-to-target ratios against the fastest sync mode,
pooled over the reports `bench/async_vs_sync.py` writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path[:0] = [str(BENCH)]

from async_vs_sync_seeds import read_table, replay_bound  # noqa: E402

COLS = "| mode | wall s | samples/s | t→target s | eval reward |"


def pool(*reports: Path) -> str:
    """What `bench/async_vs_sync_seeds.py` prints for these reports."""
    cmd = [sys.executable, str(BENCH / "async_vs_sync_seeds.py"), *map(str, reports)]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def report(seed: int, rows: list[str]) -> str:
    return "\n".join(
        [
            "# Asynchronous vs synchronous RL",
            "",
            f"- command: `python bench/async_vs_sync.py --seed {seed} --tag _s{seed}`",
            "",
            COLS,
            "|---|---|---|---|---|",
            *rows,
            "",
            "Headline ...",
        ]
    )


def test_read_table_takes_the_mode_table_only(tmp_path):
    p = tmp_path / "r.md"
    p.write_text(report(0, ["| sync-default | 100.0 | 50 | 40.0 | 0.300 |"]))
    assert read_table(p) == {
        "sync-default": {
            "mode": "sync-default",
            "wall s": "100.0",
            "samples/s": "50",
            "t→target s": "40.0",
            "eval reward": "0.300",
        }
    }
    (tmp_path / "x.md").write_text("no table here")
    with pytest.raises(SystemExit, match="no '| mode |' table"):
        read_table(tmp_path / "x.md")


def test_replay_bound_is_what_an_eta_bounded_pipeline_gives_the_sync_steps():
    # η = 0 is the sync schedule itself
    assert replay_bound([1.0, 2.0, 0.5], [0.5, 1.0, 2.0], 0) == 1.0
    # equal steps: at any η ≥ 1 all but one step overlap
    assert replay_bound([1.0] * 4, [1.0] * 4, 1) == pytest.approx(8 / 5)
    # long and short batches alternating, a long one long to generate and to train: at η = 1
    # the long batch's generation waits for the short one's training and then holds up the
    # trainer; one more batch of lookahead lets the long steps overlap one another
    gen, train = [2.0, 0.5] * 10, [2.0, 0.5] * 10
    by_eta = [replay_bound(gen, train, eta) for eta in (0, 1, 2, 4)]
    assert by_eta[0] == 1.0
    assert by_eta[1] == pytest.approx(1.235, abs=1e-3)
    assert by_eta[2] == pytest.approx(1.852, abs=1e-3) == by_eta[3]
    # never above the ceiling: the sum over the slower stage's sum
    assert by_eta[3] <= (sum(gen) + sum(train)) / max(sum(gen), sum(train))
    with pytest.raises(ValueError, match="one generation and one training time per step"):
        replay_bound([1.0], [1.0, 2.0], 1)


def test_ratios_are_against_each_seeds_fastest_sync_and_pooled(tmp_path):
    s0 = tmp_path / "s0.md"
    s0.write_text(
        report(
            0,
            [
                "| sync-default | 150.0 | 50 | 30.0 | 0.300 |",
                "| sync-pinned | 100.0 | 75 | 40.0 | 0.250 |",  # fastest by wall: the reference
                "| async-η1 | 60.0 | 125 | 20.0 | 0.270 |",
            ],
        )
    )
    s1 = tmp_path / "s1.md"
    s1.write_text(
        report(
            1,
            [
                "| sync-default | 90.0 | 80 | 36.0 | 0.310 |",
                "| async-η1 | 50.0 | 144 | 12.0 | 0.300 |",
                "| async-η4 | 45.0 | 160 | not reached | 0.200 |",
            ],
        )
    )
    out = pool(s0, s1)
    assert "| 0 | sync-pinned, 100.0 s | 40.0 | 0.250 | async-η1 | 20.0 | **2.00x** |" in out
    assert "| 1 | sync-default, 90.0 s | 36.0 | 0.310 | async-η1 | 12.0 | **3.00x** |" in out
    assert "| async-η4 | not reached | n/a |" in out
    # median of 2.00x and 3.00x; eval differences +0.020 and -0.010: mean +0.005, SE 0.015
    assert (
        "- async-η1 over 2 seeds: time to target 2.50x (median; 2.00x-3.00x, 2 of 2 at 1.8x or "
        "more); eval difference async - sync +0.005 ± 0.015 (mean ± SE)"
    ) in out
    assert "- async-η4" not in out  # never reached the target: no ratio to pool


def test_with_the_curves_the_ratio_splits_into_per_step_speed_and_steps(tmp_path):
    # sync: 2 s a step, target at step 20 (40 s); async: 1 s a step, target at step 25 (25 s):
    # 1.6x = 2.00x faster per step x 0.80 (20 steps against 25)
    p = tmp_path / "s0.md"
    p.write_text(
        report(
            0,
            [
                "| sync-pinned | 120.0 | 64 | 40.0 | 0.300 |",
                "| async-η1 | 60.0 | 128 | 25.0 | 0.300 |",
            ],
        )
    )
    curves = {
        "sync-pinned": [{"step": i, "wall_s": 2.0 * i} for i in range(1, 61)],
        "async-η1": [{"step": i, "wall_s": 1.0 * i} for i in range(1, 61)],
    }
    p.with_suffix(".json").write_text(json.dumps(curves))
    out = pool(p)
    assert "| **1.60x** | 2.00x x 0.80 (20/25 steps) |" in out
    assert (
        "  - split over 1 seeds: per step 2.00x (median; 2.00x-2.00x) x steps to target "
        "sync/async 0.80 (median; 0.80-0.80)"
    ) in out


def test_with_the_timings_each_run_is_set_against_the_overlap_ceiling(tmp_path):
    # sync: 2 s a step, 1 s training, 1 s waiting for the batch: balanced roles, ceiling 2x.
    # async: 1.25 s a step, the same 1 s of training per step, 0.25 s waiting: 1.60x the
    # trained tokens/s (100 a step in both), 80% of the ceiling, 20% of its wall time waiting
    p = tmp_path / "s0.md"
    p.write_text(
        report(
            0,
            [
                "| sync-pinned | 120.0 | 64 | 40.0 | 0.300 |",
                "| async-η1 | 75.0 | 102 | 25.0 | 0.300 |",
            ],
        )
    )

    def run(step_s: float, wait_s: float) -> list[dict]:
        return [
            {"step": i, "wall_s": step_s * i, "train_s": 1.0, "wait_s": wait_s, "train_tokens": 100}
            for i in range(1, 61)
        ]

    curves = {"sync-pinned": run(2.0, 1.0), "async-η1": run(1.25, 0.25)}
    p.with_suffix(".json").write_text(json.dumps(curves))
    out = pool(p)
    # η bound: the sync steps (1 s rest, 1 s train) replayed at η = 1 overlap all but one
    # step: 120 s of work in 61 s
    row = "| 0 | sync-pinned | async-η1 | 1.60x | 2.00x | 1.97x | 80% | 20% | 1.00 | 60 of 60 | - |"
    assert row in out
    assert (
        "- async-η1: trained tokens/s 1.60x the fastest sync (median; 1.60x-1.60x) against an "
        "overlap ceiling of 2.00x (median; 2.00x-2.00x)"
    ) in out
    # the sync run's own bound at each η, whichever async modes ran: 120 s of work, 61 s at
    # any η >= 1 (constant steps never stall each other)
    assert "| 0 | sync-pinned | 2.00x | 1.97x | 1.97x | 1.97x | 1.97x |" in out
    assert "- η = 1: at best 1.97x (median; 1.97x-1.97x, 1 of 1 seeds at 1.8x or more)" in out
    # without the timings (older curves), no throughput table
    curves = {m: [{"step": r["step"], "wall_s": r["wall_s"]} for r in c] for m, c in curves.items()}
    p.with_suffix(".json").write_text(json.dumps(curves))
    out = pool(p)
    assert "trained tok/s" not in out
    assert "What overlap could give" not in out


def test_the_waits_are_set_against_the_batch_tails(tmp_path):
    # async: the trainer waited in steps 2 and 4 only, whose batches had 1.0 s tails; the
    # other steps' tails were 0.2 s: mean tail 1.0 s in the waited steps, 0.6 s over all four
    p = tmp_path / "s0.md"
    p.write_text(
        report(
            0,
            ["| sync-pinned | 8.0 | 64 | 4.0 | 0.300 |", "| async-η1 | 5.0 | 102 | 3.0 | 0.300 |"],
        )
    )
    sync = [
        {"step": i, "wall_s": 2.0 * i, "train_s": 1.0, "wait_s": 1.0, "train_tokens": 100}
        for i in range(1, 5)
    ]
    tails = {1: 0.2, 2: 1.0, 3: 0.2, 4: 1.0}
    waits = {1: 0.0, 2: 0.5, 3: 0.01, 4: 0.5}
    async_ = [
        {
            "step": i,
            "wall_s": 1.25 * i,
            "train_s": 1.0,
            "wait_s": waits[i],
            "train_tokens": 100,
            "tail_s": tails[i],
        }
        for i in range(1, 5)
    ]
    p.with_suffix(".json").write_text(json.dumps({"sync-pinned": sync, "async-η1": async_}))
    out = pool(p)
    assert "| 2 of 4 | 1.00 / 0.60 |" in out


@pytest.mark.slow  # ~8 s on 2 cores: the pooling report's plots
def test_seed_mean_curves_give_one_time_to_target(tmp_path):
    # per step i (1-30) the two seeds' rewards are i/30 + 0.1 and i/30 - 0.1: their mean is i/30
    # in both modes. Target 0.9 x the sync curve's last 10 (mean 25.5/30) = 0.765; the rolling
    # 10-step mean (i - 4.5)/30 reaches it at step 28: sync (2 s a step) 56 s, async (1 s) 28 s
    for seed, shift in ((0, 0.1), (1, -0.1)):
        p = tmp_path / f"s{seed}.md"
        p.write_text(
            report(
                seed,
                [
                    "| sync-pinned | 60.0 | 64 | 40.0 | 0.300 |",
                    "| async-η1 | 30.0 | 128 | 25.0 | 0.300 |",
                ],
            )
        )

        def run(step_s: float, shift: float = shift) -> list[dict]:
            return [
                {"step": i, "wall_s": step_s * i, "reward_mean": i / 30 + shift}
                for i in range(1, 31)
            ]

        p.with_suffix(".json").write_text(
            json.dumps({"sync-pinned": run(2.0), "async-η1": run(1.0)})
        )
    out = pool(tmp_path / "s0.md", tmp_path / "s1.md")
    assert (
        "| async-η1 | 2 | 0.765 | 56.0 (step 28) | 28.0 (step 28) | **2.00x** | 2.00x-2.00x |"
    ) in out
