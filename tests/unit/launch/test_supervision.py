"""The launcher's decision when a worker exits (`on_worker_exit`): deterministic failures are
never restarted, crashes are restarted a bounded number of times."""

from __future__ import annotations

import pytest

from areal.launch.local import on_worker_exit
from areal.launch.worker import EXIT_CONFIG


@pytest.mark.parametrize(
    ("wid", "rc", "restarts", "action"),
    [
        ("trainer-0", 0, 0, "finished"),  # the trainer's clean exit ends the run
        ("rollout-0", 0, 0, "ignore"),  # others stop on run_finished
        ("controller-0", 0, 3, "ignore"),
        ("reward-0", EXIT_CONFIG, 0, "config_error"),  # deterministic: no restart, even the 1st
        ("trainer-0", EXIT_CONFIG, 0, "config_error"),
        ("rollout-0", 1, 0, "restart"),
        ("rollout-0", -9, 2, "restart"),  # SIGKILL
        ("rollout-0", 1, 3, "give_up"),  # max_restarts=3 used up
        ("trainer-0", -9, 3, "give_up"),
    ],
)
def test_on_worker_exit(wid, rc, restarts, action):
    assert on_worker_exit(wid, rc, restarts, max_restarts=3) == action


def test_exit_config_is_distinct_from_crashes_and_signals():
    assert EXIT_CONFIG not in (0, 1) and EXIT_CONFIG > 0  # signals are negative return codes
