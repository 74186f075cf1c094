"""The progress line's samples/s (`areal.launch.progress.samples_per_s`): this launch's samples
over this launch's trainer wall time. Issue 44: after `--resume` it divided this launch's
samples by the run's cumulative wall time (5.1 samples/s shown at ~370)."""

from __future__ import annotations

import json

import pytest

from areal.launch.progress import Start, StepProgress, describe, samples_per_s
from areal.launch.run_dir import resume_point


def test_a_new_run_counts_from_zero():
    # 3 steps of 64 samples in 12 s of trainer time: 192 / 12 = 16.0
    assert samples_per_s({1: 64, 2: 64, 3: 64}, 12.0, Start()) == pytest.approx(16.0)


def test_a_resumed_run_counts_from_its_checkpoint():
    # resumed at step 100 after 1000 s; steps 101-103 (3 x 64 = 192 samples) took until
    # wall_s = 1000 + 0.5 = 1000.5: 192 / 0.5 = 384, not 192 / 1000.5 = 0.19
    start = Start(step=100, wall_s=1000.0)
    assert samples_per_s({101: 64, 102: 64, 103: 64}, 1000.5, start) == pytest.approx(384.0)
    # a step at or before the checkpoint (redone after a restart) is not this launch's gain
    assert samples_per_s({100: 64, 101: 64}, 1001.0, start) == pytest.approx(64.0)


def test_no_time_passed_is_zero_not_a_division_by_zero():
    assert samples_per_s({}, 0.0, Start()) == 0.0
    assert samples_per_s({5: 8}, 10.0, Start(step=4, wall_s=10.0)) == 0.0


def test_a_step_redone_after_a_trainer_restart_counts_once(capsys):
    progress = StepProgress(3, quiet=False)
    progress.tty = False  # one plain line per step
    for step, wall_s in ((1, 2.0), (2, 4.0), (2, 3.0), (3, 5.0)):  # step 2 redone
        progress.update({"step": step, "samples": 10, "wall_s": wall_s})
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("step 3/3 ") and "6.0 samples/s" in last  # 30 samples / 5 s


def test_the_line_shows_the_rate_it_is_given():
    assert "384.0 samples/s" in describe({"version": 3, "reward_mean": 0.5}, 384.0)


def test_resume_point_reads_the_checkpoints_wall_time(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "checkpoint").mkdir()
    state = {"trainer": {"step": 7, "wall_s": 123.5}}
    (tmp_path / "checkpoint" / "trainer_state.json").write_text(json.dumps(state))
    point = resume_point(tmp_path)
    assert (point.step, point.wall_s) == (7, 123.5)
