"""The launcher's decision when a worker exits (`on_worker_exit`): deterministic failures are
never restarted, crashes are restarted a bounded number of times, a trainer that exits 0
finishes the run only when it reached train.total_steps, and another worker that exits 0 before
then (stopped from outside) is restarted as a crash is."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from areal.launch.exit_codes import EXIT_BUS_UNAVAILABLE, EXIT_CONFIG
from areal.launch.local import EXIT_NOT_FINISHED, MAX_OUTAGE_RESTARTS, on_worker_exit


@pytest.mark.parametrize(
    ("wid", "rc", "restarts", "action"),
    [
        ("trainer-0", 0, 0, "finished"),  # the trainer's clean exit ends the run
        ("rollout-0", 0, 0, "ignore"),  # others stop on run_finished
        ("controller-0", 0, 3, "ignore"),
        ("trainer-0", 0, 3, "finished"),
        ("reward-0", EXIT_CONFIG, 0, "config_error"),  # deterministic: no restart, even the 1st
        ("trainer-0", EXIT_CONFIG, 0, "config_error"),
        ("rollout-0", 1, 0, "restart"),
        ("rollout-0", -9, 2, "restart"),  # SIGKILL
        ("rollout-0", 1, 3, "give_up"),  # max_restarts=3 used up
        ("trainer-0", -9, 3, "give_up"),
    ],
)
def test_on_worker_exit(wid, rc, restarts, action):
    assert on_worker_exit(wid, rc, restarts, max_restarts=3, run_finished=True) == action


@pytest.mark.parametrize(
    ("wid", "rc", "restarts", "action"),
    [
        ("rollout-0", 0, 0, "restart"),  # a SIGTERM sent to it alone: a clean exit mid-run
        ("reward-0", 0, 2, "restart"),
        ("controller-0", 0, 3, "give_up"),  # the same budget as a crash
        ("trainer-0", 0, 0, "finished"),  # the caller checks its summary (`trainer_finished`)
        ("rollout-0", -9, 0, "restart"),
        ("rollout-0", EXIT_CONFIG, 0, "config_error"),
    ],
)
def test_a_worker_exiting_0_before_the_run_finished_is_restarted(wid, rc, restarts, action):
    assert on_worker_exit(wid, rc, restarts, max_restarts=3, run_finished=False) == action


def test_exit_codes_are_distinct_from_crashes_and_signals():
    assert EXIT_CONFIG not in (0, 1) and EXIT_CONFIG > 0  # signals are negative return codes
    assert EXIT_BUS_UNAVAILABLE not in (0, 1, EXIT_CONFIG) and EXIT_BUS_UNAVAILABLE > 0


def test_an_outage_exit_does_not_spend_the_restart_budget():
    # the server was away past nats.outage_tolerance_s: not the worker's fault
    assert on_worker_exit("controller-0", EXIT_BUS_UNAVAILABLE, 3, 3, run_finished=False) == (
        "restart_free"
    )
    assert (
        on_worker_exit(
            "trainer-0",
            EXIT_BUS_UNAVAILABLE,
            0,
            3,
            outage_restarts=MAX_OUTAGE_RESTARTS - 1,
            run_finished=False,
        )
        == "restart_free"
    )
    # ...but a server that never comes back ends the run eventually
    assert (
        on_worker_exit(
            "trainer-0",
            EXIT_BUS_UNAVAILABLE,
            0,
            3,
            outage_restarts=MAX_OUTAGE_RESTARTS,
            run_finished=False,
        )
        == "give_up"
    )


class _Exited:
    def __init__(self, rc: int, pid: int = 4242) -> None:
        self.returncode, self.pid = rc, pid

    def poll(self) -> int:
        return self.returncode


def test_a_healthy_period_gives_the_restart_budget_back(monkeypatch, tmp_path):
    import time

    from areal.config import load_settings
    from areal.launch.local import HEALTHY_S, Launcher

    launcher = Launcher(load_settings(None, [f"out_dir={tmp_path}"]), max_restarts=3)
    started: list[str] = []
    monkeypatch.setattr(launcher, "_start", started.append)
    # rollout-0 used its whole budget, but then ran longer than HEALTHY_S before crashing
    launcher.procs["rollout-0"] = _Exited(1)
    launcher.restarts["rollout-0"] = 3
    launcher.started_at["rollout-0"] = time.monotonic() - HEALTHY_S - 1
    assert launcher._supervise() is None and started == ["rollout-0"]
    assert launcher.restarts["rollout-0"] == 1
    # a crash right after a restart spends the budget as before
    launcher.procs["reward-0"] = _Exited(1)
    launcher.restarts["reward-0"] = 3
    launcher.started_at["reward-0"] = time.monotonic()
    launcher.procs.pop("rollout-0")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "reward-0.log").write_text("boom\n")
    assert launcher._supervise() == 1


CONSOLE_LOG = """\
2026-12-03T16:39:28.020374Z [info     ] controller_started             admitted=0
2026-12-03T16:39:36.9Z [error    ] worker_failed                  role=controller
Traceback (most recent call last):
  File "/x/areal/launch/worker.py", line 340, in _run
    await lock.serve(spec.build(parts, bus).run(stop), stop)
nats.js.errors.ServiceUnavailableError: nats: ServiceUnavailableError: code=None
2026-12-03T16:39:37.0Z [info     ] worker_stopped                 role=controller
"""
JSON_LOG = (
    '{"event": "worker_failed", "level": "error", "exception": "Traceback (most recent call '
    'last):\\n  File \\"x.py\\", line 1, in f\\nValueError: bad row 7\\n"}\n'
    '{"event": "worker_stopped", "level": "info"}\n'
)


@pytest.mark.parametrize(
    "log_text, cause",
    [
        (CONSOLE_LOG, "nats.js.errors.ServiceUnavailableError: nats: ServiceUnavailableError"),
        (JSON_LOG, "ValueError: bad row 7"),
        ("2026-12-03T16:39:28Z [info ] a\nkilled by the OOM killer\n", "killed by the OOM killer"),
        ("", "(no output)"),
        (None, "(no log)"),
    ],
    ids=["console", "json", "no-exception", "empty", "no-log"],
)
def test_a_restart_warning_names_the_cause_from_the_workers_log(
    monkeypatch, tmp_path, log_text, cause
):
    from areal.config import load_settings
    from areal.launch import local
    from areal.launch.local import Launcher

    warnings: list[tuple[str, dict]] = []
    # the module's logger itself: structlog caches loggers once configured, which
    # `structlog.testing.capture_logs` cannot reach after another test configured logging
    monkeypatch.setattr(
        local, "log", SimpleNamespace(warning=lambda e, **kw: warnings.append((e, kw)))
    )
    launcher = Launcher(load_settings(None, [f"out_dir={tmp_path}"]), max_restarts=3)
    launcher._start = lambda wid: None  # type: ignore[method-assign]
    if log_text is not None:
        (tmp_path / "logs").mkdir()
        (tmp_path / "logs" / "controller-0.log").write_text(log_text)
    launcher.procs["controller-0"] = _Exited(1)
    assert launcher._supervise() is None
    [warning] = [kw for e, kw in warnings if e == "worker_restarted"]
    assert warning["worker"] == "controller-0" and warning["exit_code"] == 1
    assert warning["cause"].startswith(cause)


@pytest.mark.parametrize(
    ("summary", "rc"),
    [
        (None, EXIT_NOT_FINISHED),  # stopped before it wrote one
        ({"steps": 3}, EXIT_NOT_FINISHED),  # an older run's (--resume to more steps)
        ({"steps": 5}, 0),  # written on reaching train.total_steps
        ("not json", EXIT_NOT_FINISHED),
    ],
    ids=["no-summary", "older-summary", "finished", "unreadable"],
)
def test_a_trainer_exiting_0_finishes_the_run_only_at_total_steps(tmp_path, capsys, summary, rc):
    from areal.config import load_settings
    from areal.launch.local import Launcher

    launcher = Launcher(load_settings(None, [f"out_dir={tmp_path}", "train.total_steps=5"]))
    if summary is not None:
        text = summary if isinstance(summary, str) else json.dumps(summary)
        (tmp_path / "summary.json").write_text(text)
    launcher.procs["trainer-0"] = _Exited(0)
    assert launcher._supervise() == rc
    if rc:
        err = capsys.readouterr().err
        assert "worker trainer-0 was stopped" in err and "--resume continues it" in err


def test_sigterm_stops_the_run_once(tmp_path):
    """A SIGTERM raises KeyboardInterrupt (the stop path Ctrl-C takes) and is remembered for
    the exit code; one during the stop changes nothing."""
    import signal

    from areal.config import load_settings
    from areal.launch.local import Launcher

    launcher = Launcher(load_settings(None, [f"out_dir={tmp_path}"]))
    with pytest.raises(KeyboardInterrupt):
        launcher._on_sigterm(signal.SIGTERM, None)
    assert launcher.stop_signal == signal.SIGTERM
    launcher._on_sigterm(signal.SIGTERM, None)  # stopping already: no second interrupt


def _warnings(monkeypatch) -> list[tuple[str, dict]]:
    from areal.launch import local

    warnings: list[tuple[str, dict]] = []
    monkeypatch.setattr(
        local, "log", SimpleNamespace(warning=lambda e, **kw: warnings.append((e, kw)))
    )
    return warnings


def test_a_worker_exiting_0_mid_run_is_restarted_and_after_the_end_is_not(monkeypatch, tmp_path):
    from areal.config import load_settings
    from areal.launch.local import Launcher

    warnings = _warnings(monkeypatch)
    launcher = Launcher(load_settings(None, [f"out_dir={tmp_path}", "train.total_steps=5"]))
    started: list[str] = []
    monkeypatch.setattr(launcher, "_start", started.append)
    launcher.procs["reward-0"] = _Exited(0)
    assert launcher._supervise() is None and started == ["reward-0"]
    [warning] = [kw for e, kw in warnings if e == "worker_restarted"]
    assert warning["exit_code"] == 0 and "before the run finished" in warning["cause"]
    assert launcher.restarts["reward-0"] == 1
    # the trainer's last step record was seen: the controller stops on the trainer's `done`,
    # before the summary is written; its exit is the run's end, not a stop from outside
    launcher.last_step = 5
    launcher.procs["controller-0"] = _Exited(0)
    launcher.procs.pop("reward-0")
    assert launcher._supervise() is None and started == ["reward-0"]
    # and once the summary is there
    launcher.last_step = 0
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 5}))
    launcher.procs["rollout-0"] = _Exited(0)
    assert launcher._supervise() is None and started == ["reward-0"]


def test_a_frozen_worker_is_killed_and_its_restart_names_the_freeze(monkeypatch, tmp_path):
    """The watchdog's kill goes through the crash path: the restart warning says why."""
    import subprocess

    from areal.config import load_settings
    from areal.core.watchdog import Frozen
    from areal.launch.local import Launcher

    warnings = _warnings(monkeypatch)
    launcher = Launcher(load_settings(None, [f"out_dir={tmp_path}"]))
    started: list[str] = []
    monkeypatch.setattr(launcher, "_start", started.append)
    proc = subprocess.Popen(["sleep", "600"])
    try:
        launcher.procs["rollout-0"] = proc
        assert launcher._kill_frozen("rollout-0") == proc.pid
        assert launcher._kill_frozen("rollout-9") is None  # not this launcher's
        proc.wait(timeout=60)  # hang guard: SIGKILL is immediate
        launcher.watchdog.frozen["rollout-0"] = Frozen("rollout-0", "rollout", 31.5, True, 1, "h")
        assert launcher._supervise() is None and started == ["rollout-0"]
    finally:
        proc.kill()
        proc.wait()
    [warning] = [kw for e, kw in warnings if e == "worker_restarted"]
    assert warning["exit_code"] == -9
    assert warning["cause"].startswith("frozen: no heartbeat for 31.5 s")
    assert launcher._kill_frozen("rollout-0") is None  # exited: nothing to kill
