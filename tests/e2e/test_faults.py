"""Faults around the workers: the embedded nats-server SIGKILLed mid-run.

The launcher restarts the server on its store and port; the workers ride through the outage
(publishes and run-state reads retried with the same message ids, pulls renewed) and the run
finishes on its own with exact accounting. Nothing here is decided by a clock except generous
hang guards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.test_run import _children_of, check_invariants, start_run, wait_steps

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


def _server_pid(launcher_pid: int) -> int | None:
    for pid in _children_of(launcher_pid):
        try:
            if b"nats-server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


@pytest.mark.slow  # a 24-step run with an outage: ~1-2 minutes on 2 cores
def test_the_embedded_server_killed_mid_run_is_restarted_and_the_run_finishes(tmp_path):
    out = tmp_path / "outage"
    proc = start_run(out, "train.total_steps=24", "nats.ack_wait_s=4")
    try:
        wait_steps(proc, out, 6)
        first = _server_pid(proc.pid)
        assert first is not None
        os.kill(first, signal.SIGKILL)
        _, err = proc.communicate(timeout=900)  # hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert "restarting it on its store" in err.decode()
    summary = check_invariants(out, eta=4, B=16)
    assert summary["steps"] == 24
    launcher_log = (out / "nats" / "nats-server.log").read_text()
    assert launcher_log.count("Server is ready") == 2  # the first start and the restart
    # no worker crashed because of the outage (a restart would log worker_restarted)
    for log in (out / "logs").glob("*.log"):
        assert "worker_failed" not in log.read_text(), log.name
    assert json.loads((out / "summary.json").read_text())["dlq"] == 0


@pytest.mark.slow  # a 30-step run through five server restarts: ~2-3 minutes on 2 cores
def test_an_external_server_restarted_five_times_costs_no_worker_crash(tmp_path):
    from areal.bus.embedded import EmbeddedNats

    server = EmbeddedNats(store_dir=tmp_path / "nats").start()  # "external": not the launcher's
    out = tmp_path / "ext"
    proc = start_run(out, "train.total_steps=30", "nats.ack_wait_s=4", f"nats.url={server.url}")
    try:
        for after_step in (3, 7, 11, 15, 19):
            wait_steps(proc, out, after_step)
            server.proc.send_signal(signal.SIGKILL)  # a hard stop; then back on its store
            server.proc.wait()
            server.start()
        _, err = proc.communicate(timeout=900)  # hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
    assert proc.returncode == 0, err.decode()[-3000:]
    summary = check_invariants(out, eta=4, B=16)
    assert summary["steps"] == 30
    assert "worker_restarted" not in err.decode()  # the launcher restarted no worker
    logs = {p.name: p.read_text() for p in (out / "logs").glob("*.log")}
    for name, text in logs.items():
        assert "worker_failed" not in text, name
    # the outages were real: the workers lost their connection and got it back
    assert sum(t.count("nats_reconnected") for t in logs.values()) >= 5 * len(logs)


def _wait_log(path: Path, text: str, count: int, proc, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s  # hang guard
    while not (path.exists() and path.read_text().count(text) >= count):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, f"no {count}x {text} in {path.name}"
        time.sleep(0.1)


def _steps(out: Path) -> int:
    return len((out / "metrics.jsonl").read_text().splitlines())


@pytest.mark.slow  # a 20-step run with a stretch of failed checkpoint writes: ~1-2 minutes
def test_an_unwritable_checkpoint_dir_pauses_training_and_nothing_is_lost(tmp_path):
    out = tmp_path / "ckpt"
    # a checkpoint every step (the example writes one every 10): the freeze bites at once
    proc = start_run(out, "train.total_steps=20", "nats.ack_wait_s=4", "train.checkpoint_every=1")
    ckpt = out / "checkpoint"
    frozen = False
    try:
        wait_steps(proc, out, 5)
        if subprocess.run(["chattr", "+i", str(ckpt)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not supported here (needs root on ext4/xfs/btrfs/tmpfs)")
        frozen = True
        log = out / "logs" / "trainer-0.log"
        _wait_log(log, "write_failed", 1, proc)  # the pause, reported once (EPERM)
        at_first = _steps(out)
        _wait_log(log, "storage_write_retry", 2, proc)  # >= 1 + 2 s of backoff later
        # one checkpoint in flight: the trainer finished at most the step it was on, then
        # waited (acking nothing) instead of running ahead of what a resume could restore
        assert _steps(out) - at_first <= 1
        subprocess.run(["chattr", "-i", str(ckpt)], check=True)
        frozen = False
        _, err = proc.communicate(timeout=900)  # hang guard
    finally:
        if frozen:
            subprocess.run(["chattr", "-i", str(ckpt)], check=False)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-3000:]
    text = (out / "logs" / "trainer-0.log").read_text()
    # one pause, one report (its retries are logged as storage_write_retry)
    assert len(re.findall(r"\] write_failed ", text)) == 1
    assert "storage_recovered" in text and "trainer_resumed" not in text
    summary = check_invariants(out, eta=4, B=16)
    assert summary["steps"] == 20
    assert summary["admitted"] <= (summary["steps"] + 4 + 1) * 16
