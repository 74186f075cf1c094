"""The run directory rules: a new run never deletes data implicitly, `--overwrite` deletes only
run artifacts, `--resume` knows a finished run from one it can extend."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from areal.config import ConfigError
from areal.launch.run_dir import (
    ResumePoint,
    artifacts,
    ensure_writable,
    prepare_new,
    resume_point,
)


def _old_run(out: Path, *, step: int, finished: bool) -> None:
    """The files a run leaves in --out (contents are placeholders: only names matter here)."""
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "trainer_state.json").write_text(
        json.dumps({"trainer": {"step": step, "done": False}, "done_tasks": []})
    )
    (out / "final").mkdir()
    (out / "final" / "config.json").write_text("{}")
    (out / "logs").mkdir()
    (out / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    if finished:
        (out / "summary.json").write_text("{}")


def test_a_missing_or_empty_out_is_fine_and_untouched(tmp_path):
    assert prepare_new(tmp_path / "new", overwrite=False, weights_in_out=True) == []
    assert not (tmp_path / "new").exists()  # created later, by the launcher, not by the check
    (tmp_path / "empty").mkdir()
    assert prepare_new(tmp_path / "empty", overwrite=False, weights_in_out=True) == []


def test_a_non_empty_out_is_refused_and_nothing_is_deleted(tmp_path):
    _old_run(tmp_path, step=3, finished=True)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError) as e:
        prepare_new(tmp_path, overwrite=False, weights_in_out=True)
    msg = str(e.value)
    assert "\n" not in msg and "--resume" in msg and "--overwrite" in msg and "--out" in msg
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_unrelated_files_alone_also_make_out_non_empty(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="notes.txt"):
        prepare_new(tmp_path, overwrite=False, weights_in_out=True)


def test_overwrite_deletes_run_artifacts_only(tmp_path):
    _old_run(tmp_path, step=3, finished=True)
    (tmp_path / "weights").mkdir()
    (tmp_path / "eval.jsonl").write_text('{"round": 0}\n')  # else a rerun skips its rounds
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "analysis").mkdir()
    (tmp_path / "analysis" / "plot.png").write_bytes(b"png")
    gone = prepare_new(tmp_path, overwrite=True, weights_in_out=True)
    assert {p.name for p in gone} == {
        "checkpoint",
        "final",
        "logs",
        "config.json",
        "metrics.jsonl",
        "eval.jsonl",
        "summary.json",
        "weights",
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["analysis", "notes.txt"]
    assert (tmp_path / "analysis" / "plot.png").read_bytes() == b"png"


def test_overwrite_keeps_a_weights_dir_that_is_not_the_runs(tmp_path):
    # weights.dir set elsewhere: a `weights/` in --out is the user's, not the run's
    (tmp_path / "weights").mkdir()
    (tmp_path / "config.json").write_text("{}")
    assert [p.name for p in artifacts(tmp_path, weights_in_out=False)] == ["config.json"]
    prepare_new(tmp_path, overwrite=True, weights_in_out=False)
    assert [p.name for p in tmp_path.iterdir()] == ["weights"]


def test_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        prepare_new(tmp_path / "f", overwrite=True, weights_in_out=True)


def test_resume_needs_a_run(tmp_path):
    with pytest.raises(ConfigError, match=r"holds no run \(no config.json\).*drop --resume"):
        resume_point(tmp_path / "typo")


@pytest.mark.parametrize(
    ("step", "finished", "total_steps", "done"),
    [
        (3, True, 3, True),  # same total_steps: nothing to do
        (3, True, 2, True),  # fewer steps than already trained: nothing to do either
        (3, True, 5, False),  # a larger total_steps extends the run
        (3, False, 3, False),  # checkpoint at the end but no summary: the trainer finishes it
        (2, False, 3, False),  # stopped mid-run
    ],
)
def test_resume_point_tells_finished_from_extendable(tmp_path, step, finished, total_steps, done):
    _old_run(tmp_path, step=step, finished=finished)
    point = resume_point(tmp_path)
    assert point.step == step
    assert (point.summary == tmp_path / "summary.json") is finished
    assert point.finished_at(total_steps) is done


def test_resume_before_the_first_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resume_point(tmp_path) == ResumePoint(step=None, summary=None)


def test_unreadable_checkpoint_state_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "trainer_state.json").write_text("{not json")
    with pytest.raises(ConfigError, match="trainer_state.json is unreadable"):
        resume_point(tmp_path)


@pytest.mark.parametrize("kind", ["proc", "under_a_file", "immutable"])
def test_an_out_that_cannot_be_written_is_one_clear_line(tmp_path, kind):
    if kind == "proc":
        out = Path("/proc/areal-out")
    elif kind == "under_a_file":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "run"
    else:
        out = tmp_path / "frozen"
        out.mkdir()
        if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not supported on this filesystem (or not permitted)")
    try:
        with pytest.raises(ConfigError, match=r"--out .* cannot be written: .*choose a directory"):
            ensure_writable(out)
    finally:
        if kind == "immutable":
            subprocess.run(["chattr", "-i", str(out)], check=False)


def test_a_writable_out_is_created_and_left_empty(tmp_path):
    out = tmp_path / "a" / "b"
    ensure_writable(out)
    assert out.is_dir() and list(out.iterdir()) == []
