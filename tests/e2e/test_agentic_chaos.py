"""Agentic runs under the e2e checks: a multi-turn workflow (`examples.workflows.double_check`:
two model turns around an environment turn) through the real system, with the rollout worker
SIGKILLed twice mid-episode. Its tasks are redone by the restarted worker (the bus redelivers
them after `ack_wait`), nothing is trained twice, every step trains B tasks, and the episodes
really hold environment tokens. Nothing is decided by a clock except generous hang guards."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.e2e.test_run import _worker_pid, check_invariants, records, start_run, wait_steps

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
WORKFLOW = "examples.workflows.double_check:DoubleCheck"


@pytest.mark.slow  # kills the rollout twice mid-run: ~1-2 minutes
def test_a_rollout_killed_mid_episode_has_its_tasks_redone_exactly_once(tmp_path):
    out = tmp_path / "agentic"
    proc = start_run(
        out,
        "train.total_steps=24",
        "nats.ack_wait_s=4",
        f"rollout.workflow={WORKFLOW}",
        "rollout.max_turns=2",
    )
    try:
        for after_step in (5, 12):
            wait_steps(proc, out, after_step)
            pid = _worker_pid(proc.pid, "rollout-0")
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=900)  # hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    summary = check_invariants(out, eta=cfg["algo"]["max_staleness"], B=cfg["algo"]["batch_size"])
    assert summary["steps"] == 24 and summary["trained"] == 24 * cfg["algo"]["batch_size"]
    assert all(r["masked_token_frac"] > 0 for r in records(out))  # episodes, not completions
    log = (out / "logs" / "rollout-0.log").read_text()
    assert log.count("rollout_started") == 3  # the first start and two restarts
