"""Liveness end to end: a frozen worker is named, killed and restarted; a worker that exits 0
mid-run is restarted. Either way the run finishes with exact accounting.

A SIGSTOPped process keeps its NATS connection's socket open, so the server still takes it for
alive; only its heartbeats stop. The test never SIGCONTs it: the launcher's watchdog must name
it (`worker_frozen` on the bus), SIGKILL it and restart it, and the bus must hand its tasks to
the restart. What the freeze cost is read back from the run's own events and heartbeats after
the run (the embedded server's store in --out) and printed. Nothing is decided by a clock
except generous hang guards."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import nats
import pytest

from areal.bus.codec import decode
from areal.bus.embedded import EmbeddedNats
from schemas import Event, MetricRecord
from schemas import subjects as S
from schemas.subjects import RunNames
from tests.e2e.test_run import _worker_pid, check_invariants, start_run, wait_steps
from tests.factories import process_alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
RUN = "arithmetic"  # the example's run id
FROZEN_AFTER_S = 8.0  # the default is 30 s; shorter keeps the test short


async def _stored(store: Path, stream: str, cls: type) -> list:
    """Every message of the run's `stream` in the (stopped) run's store, decoded as `cls`:
    read from a server started on a copy of nothing but that store, without accounts."""
    server = EmbeddedNats(store_dir=store).start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        name = RunNames(RUN).stream(stream)
        state = (await js.stream_info(name)).state
        out = []
        for seq in range(state.first_seq, state.last_seq + 1):
            try:
                msg = await js.get_msg(name, seq)
            except nats.js.errors.NotFoundError:
                continue  # a gap (a de-duplicated or expired message)
            out.append(decode(msg.data, cls))
        await nc.close()
        return out
    finally:
        server.stop()


def _wait_dead(pid: int, proc, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s  # hang guard
    while process_alive(pid):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, f"pid {pid} still alive"
        time.sleep(0.1)


@pytest.mark.slow  # a 20-step run with a frozen rollout worker: ~1-2 minutes on 2 cores
def test_a_frozen_rollout_worker_is_named_killed_and_restarted_and_nothing_is_lost(tmp_path):
    out = tmp_path / "frozen"
    proc = start_run(
        out,
        "train.total_steps=20",
        "nats.ack_wait_s=4",
        f"watchdog.frozen_after_s={FROZEN_AFTER_S}",
    )
    try:
        wait_steps(proc, out, 5)
        pid = _worker_pid(proc.pid, "rollout-0")
        assert pid is not None
        stopped_at = time.time()
        os.kill(pid, signal.SIGSTOP)  # never SIGCONTed: only the watchdog can end this
        _wait_dead(pid, proc)
        killed_at = time.time()
        stdout, err = proc.communicate(timeout=900)  # hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-3000:]
    summary = check_invariants(out, eta=1, B=16)
    assert summary["steps"] == 20
    stderr = err.decode()
    assert "worker_frozen" in stderr and "worker_restarted" in stderr
    assert "frozen: no heartbeat for" in stderr  # the restart warning names the watchdog's kill
    # and the run's last lines say what the freeze cost
    assert "watchdog: rollout-0 froze" in stdout.decode() and "the run held" in stdout.decode()
    # the restart redid the frozen worker's tasks: a second rollout-0 started
    log = (out / "logs" / "rollout-0.log").read_text()
    assert log.count("rollout_started") == 2, log[-2000:]

    events = asyncio.run(_stored(out / "nats", S.EVENTS, Event))
    [frozen] = [e for e in events if e.type == "worker_frozen"]
    d = frozen.detail
    assert (d["worker_id"], d["role"], d["pid"]) == ("rollout-0", "rollout", pid)
    assert d["silent_s"] >= FROZEN_AFTER_S and d["frozen_after_s"] == FROZEN_AFTER_S
    assert d["host"] and f"pid {pid}" in d["action"]
    [back] = [e for e in events if e.type == "worker_recovered"]
    assert back.detail["worker_id"] == "rollout-0"
    assert back.detail["held_s"] > 0 and back.detail["down_s"] > d["silent_s"]

    beats = [
        r
        for r in asyncio.run(_stored(out / "nats", S.METRICS, MetricRecord))
        if r.type == "heartbeat" and r.worker_id == "rollout-0"
    ]
    last_beat = max(r.time for r in beats if r.values.get("pid") == pid)
    first_after = min(r.time for r in beats if r.values.get("pid") != pid and r.time > last_beat)
    print(
        f"\nwatchdog (frozen_after_s={FROZEN_AFTER_S:g}, ack_wait_s=4): SIGSTOP -> "
        f"worker_frozen {frozen.time - stopped_at:.1f} s (silent_s {d['silent_s']:.1f} since "
        f"its last heartbeat, {stopped_at - last_beat:.1f} s before the stop); kill -> the "
        f"restart's first heartbeat {first_after - frozen.time:.1f} s (pid gone "
        f"{killed_at - stopped_at:.1f} s after the stop); worker_recovered: down_s "
        f"{back.detail['down_s']:.1f}, run held (no new step) {back.detail['held_s']:.1f} s; "
        f"run wall {summary['wall_s']:.1f} s"
    )


@pytest.mark.slow  # a 16-step run whose reward worker is stopped from outside: ~1 minute
def test_a_worker_that_exits_0_mid_run_is_restarted_and_the_run_finishes(tmp_path):
    out = tmp_path / "exit0"
    proc = start_run(out, "train.total_steps=16", "nats.ack_wait_s=4")
    try:
        wait_steps(proc, out, 4)
        pid = _worker_pid(proc.pid, "reward-0")
        assert pid is not None
        os.kill(pid, signal.SIGTERM)  # stops it cleanly: exit 0, though the run goes on
        _wait_dead(pid, proc)
        _, err = proc.communicate(timeout=900)  # hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-3000:]
    summary = check_invariants(out, eta=1, B=16)
    assert summary["steps"] == 16
    stderr = err.decode()
    assert "worker_restarted" in stderr and "exited 0 before the run finished" in stderr
    assert "worker_frozen" not in stderr  # it said it stopped; its silence was no freeze
    log = (out / "logs" / "reward-0.log").read_text()
    assert log.count("reward_started") == 2, log[-2000:]  # the first start and the restart
