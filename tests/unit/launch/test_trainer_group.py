"""The launcher's trainer group (`train.nproc` > 1): it lives and dies whole. Real child
processes (`sleep`) stand in for the ranks, so stopping the group is the real signal path."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from areal.config import ConfigError, load_settings
from areal.launch.exit_codes import EXIT_CONFIG
from areal.launch.local import TRAINER, Launcher


def _launcher(tmp_path, monkeypatch) -> tuple[Launcher, list[str]]:
    settings = load_settings(None, [f"out_dir={tmp_path}", "train.engine=fsdp", "train.nproc=2"])
    launcher = Launcher(settings, max_restarts=3)
    started: list[str] = []
    monkeypatch.setattr(launcher, "_start", started.append)
    launcher.followers = [f"{TRAINER}.rank1"]
    launcher.started_at[TRAINER] = time.monotonic()  # just started: no healthy-period reset
    (tmp_path / "logs").mkdir()
    for wid in (TRAINER, f"{TRAINER}.rank1"):
        (tmp_path / "logs" / f"{wid}.log").write_text("a line\n")
    return launcher, started


def _rank(rc: int | None) -> subprocess.Popen:
    """A live process (rc None) or one that exited with `rc`."""
    if rc is None:
        return subprocess.Popen(["sleep", "600"])
    p = subprocess.Popen(["sh", "-c", f"exit {rc}"])
    p.wait()
    return p


def test_a_follower_that_fails_stops_rank0_and_restarts_the_group(tmp_path, monkeypatch):
    launcher, started = _launcher(tmp_path, monkeypatch)
    lead = _rank(None)
    launcher.procs = {TRAINER: lead, f"{TRAINER}.rank1": _rank(1)}
    assert launcher._supervise() is None
    assert lead.poll() is not None  # rank 0 was stopped with the group
    assert started == [TRAINER]  # the restart of trainer-0 starts the whole group
    assert launcher.restarts[TRAINER] == 1


def test_a_follower_that_exits_0_waits_for_rank0(tmp_path, monkeypatch):
    launcher, started = _launcher(tmp_path, monkeypatch)
    lead = _rank(None)
    launcher.procs = {TRAINER: lead, f"{TRAINER}.rank1": _rank(0)}
    try:
        assert launcher._supervise() is None
        assert lead.poll() is None and started == []
    finally:
        lead.kill()
        lead.wait()


def test_rank0_exiting_0_finishes_the_run(tmp_path, monkeypatch):
    launcher, started = _launcher(tmp_path, monkeypatch)
    steps = launcher.s.train.total_steps
    (tmp_path / "summary.json").write_text(json.dumps({"steps": steps}))  # what it writes last
    launcher.procs = {TRAINER: _rank(0), f"{TRAINER}.rank1": _rank(0)}
    assert launcher._supervise() == 0 and started == []


def test_a_failed_follower_is_reported_from_its_own_log(tmp_path, monkeypatch, capsys):
    launcher, started = _launcher(tmp_path, monkeypatch)
    (tmp_path / "logs" / f"{TRAINER}.rank1.log").write_text("config error: rank 1's reason\n")
    launcher.procs = {TRAINER: _rank(None), f"{TRAINER}.rank1": _rank(EXIT_CONFIG)}
    assert launcher._supervise() == EXIT_CONFIG and started == []
    err = capsys.readouterr().err
    assert f"worker {TRAINER}.rank1 failed with a configuration error" in err
    assert "rank 1's reason" in err and "a line" not in err  # not trainer-0's log


def test_rank0_failing_stops_its_followers_and_restarts_the_group(tmp_path, monkeypatch):
    launcher, started = _launcher(tmp_path, monkeypatch)
    follower = _rank(None)
    launcher.procs = {TRAINER: _rank(1), f"{TRAINER}.rank1": follower}
    assert launcher._supervise() is None
    assert follower.poll() is not None and started == [TRAINER]


def test_a_group_that_keeps_failing_gives_up_with_the_trainers_budget(tmp_path, monkeypatch):
    launcher, started = _launcher(tmp_path, monkeypatch)
    launcher.procs = {TRAINER: _rank(None), f"{TRAINER}.rank1": _rank(7)}
    launcher.restarts[TRAINER] = 3
    assert launcher._supervise() == 7 and started == []


def test_more_ranks_need_a_distributed_engine():
    with pytest.raises(ConfigError, match="train.nproc=2 needs a distributed engine"):
        load_settings(None, ["train.nproc=2"])
    assert load_settings(None, ["train.nproc=2", "train.engine=fsdp"]).train.nproc == 2
