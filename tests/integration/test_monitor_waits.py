"""Observers never wait in silence: `areal tap | top | metrics-exporter` against a dead address
fail in under 15 s naming the URL; a tap stops, saying why, when its server goes away or its run
finishes; `top` says the run finished and exits 0 when a finished run's server goes away; a
`run_finished` of an earlier launch does not end a tap of a run resumed after it.

The dead-address and lost-server checks run the real CLI in a subprocess: the bound is what a
user sees, interpreter start included.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from areal.bus.client import Bus
from areal.bus.embedded import EmbeddedNats, free_port
from areal.monitor.tap import Tap, run_tap
from schemas.state import TrainerState

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
# a dead address must fail in seconds, not hang: the message names the patience used (a few
# seconds), and the wall-clock bound is a generous guard that a loaded machine still meets
BOUND_S = 60.0
HANG_GUARD_S = 120.0


async def areal_cli(*args: str) -> tuple[int, str, float]:
    """(exit code, stderr, seconds from spawn to exit) of `python -m areal.cli ARGS`."""
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "areal.cli",
        *args,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD_S)
    assert proc.returncode is not None
    return proc.returncode, err.decode(), time.monotonic() - t0


def assert_fails_fast(result: tuple[int, str, float], url: str) -> None:
    rc, err, elapsed = result
    assert rc == 2, err
    assert f"error: cannot connect to NATS at {url}: no answer within" in err, err
    patience_s = float(err.split("no answer within ", 1)[1].split(" s", 1)[0])
    assert patience_s <= 10, err  # the wait itself is seconds, whatever the machine's load
    assert "is the run still running?" in err, err  # names the likely cause and the fix
    assert elapsed < BOUND_S, (elapsed, err)


@pytest.mark.slow  # ~7 s on 2 cores: CLIs in subprocesses
async def test_tap_and_top_against_a_dead_address_fail_fast_with_the_reason():
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    tap, top = await asyncio.gather(
        areal_cli("tap", "metrics", "--run", "r1", "--nats-url", url),
        areal_cli("top", "--once", "--run", "r1", "--nats-url", url),
    )
    assert_fails_fast(tap, url)
    assert_fails_fast(top, url)
    assert f"waiting for NATS at {url}; giving up after" in tap[1]  # said while it waited


@pytest.mark.slow  # ~7 s on 2 cores: CLIs in subprocesses
async def test_exporter_and_run_discovery_against_a_dead_address_fail_fast():
    url = f"nats://127.0.0.1:{free_port()}"
    port = str(free_port())
    exporter, discover = await asyncio.gather(
        areal_cli("metrics-exporter", "--run", "r1", "--nats-url", url, "--port", port),
        areal_cli("top", "--once", "--nats-url", url),  # no --run: discovery connects first
    )
    assert_fails_fast(exporter, url)
    assert_fails_fast(discover, url)


@pytest.mark.slow  # ~11 s on 2 cores: waits out a lost server
async def test_tap_stops_with_a_message_when_its_server_stops(tmp_path):
    server = EmbeddedNats(tmp_path / "nats").start()
    url = server.url
    try:
        bus = await Bus.connect(url, "gone", "trainer", "t-0")
        await bus.close()  # the run's streams exist; only the tap stays connected
        tap = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "areal.cli",
            "tap",
            "metrics",
            "--run",
            "gone",
            "--nats-url",
            url,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        assert tap.stderr is not None
        line = b""
        while not line.startswith(b"tap: following"):  # the tap says what it waits for
            line = await asyncio.wait_for(tap.stderr.readline(), HANG_GUARD_S)
            assert line, "the tap ended before following the stream"
        assert line.decode().startswith(f"tap: following areal.gone.metrics.> on {url}"), line
    finally:
        server.stop()
    rest = await asyncio.wait_for(tap.stderr.read(), HANG_GUARD_S)
    rc = await asyncio.wait_for(tap.wait(), HANG_GUARD_S)
    err = rest.decode()
    assert rc == 2, err
    assert f"error: lost the NATS server at {url}: no reconnect within" in err, err
    assert "tap stopped after 0 messages" in err, err


async def test_tap_stops_when_the_run_finishes(nats_url, run_id):
    bus = await Bus.connect(nats_url, run_id, "trainer", "trainer-0")
    lines: list[str] = []
    notes: list[str] = []

    async def finish_once_tapped() -> None:
        while not any(n.startswith("tap: following") for n in notes):
            await asyncio.sleep(0.05)
        await bus.metric("step", {"step": 1})
        await bus.event("run_finished", steps=1)

    finisher = asyncio.ensure_future(finish_once_tapped())
    rc = await asyncio.wait_for(
        run_tap(
            nats_url,
            run_id,
            "metrics",
            tap=Tap(emit=lines.append),
            history=0,
            timeout_s=None,
            note=notes.append,
        ),
        HANG_GUARD_S,
    )
    await finisher
    assert rc == 0 and len(lines) == 1 and "step=1" in lines[0]
    assert notes[-1] == f"tap: run {run_id} has finished; nothing more will come (1 messages)"
    await bus.close()


async def test_tap_on_a_finished_run_replays_its_history_then_stops(nats_url, run_id):
    bus = await Bus.connect(nats_url, run_id, "trainer", "trainer-0")
    for step in (1, 2):
        await bus.metric("step", {"step": step})
    await bus.kv_put("trainer", TrainerState(step=2, done=True))

    async def tap_history(count: int | None) -> tuple[int, list[str], list[str]]:
        lines: list[str] = []
        notes: list[str] = []
        tap = Tap(emit=lines.append, fields=["step"], count=count)
        rc = await asyncio.wait_for(
            run_tap(
                nats_url,
                run_id,
                "metrics.trainer.step",
                tap=tap,
                history=-1,
                timeout_s=None,
                note=notes.append,
            ),
            HANG_GUARD_S,
        )
        return rc, lines, notes

    rc, lines, notes = await tap_history(None)
    assert rc == 0 and lines == ["metric step=1", "metric step=2"]
    assert "has finished" in notes[-1]
    rc, lines, notes = await tap_history(5)  # asked for more than will ever come
    assert rc == 1 and len(lines) == 2 and notes[-1].endswith("(2/5 messages)")
    await bus.close()


async def test_tap_after_a_resume_of_a_finished_run_follows_the_new_launch(nats_url, run_id):
    # issue 44: right after `areal run --resume` extended a finished run, the trainer's `done`
    # in KV and the stored run_finished are the earlier launch's; the launcher's run_started
    # event, stored after them, says a new launch is under way
    trainer = await Bus.connect(nats_url, run_id, "trainer", "trainer-0")
    await trainer.kv_put("trainer", TrainerState(step=2, done=True))
    await trainer.event("run_finished", steps=2)
    launcher = await Bus.connect(nats_url, run_id, "launcher", "launcher", declare=False)
    await launcher.event("run_started", resumed=True, step=2, total_steps=4)
    lines: list[str] = []
    notes: list[str] = []

    async def step_once_tapped() -> None:
        while not any(n.startswith("tap: following") for n in notes):
            await asyncio.sleep(0.05)
        await trainer.metric("step", {"step": 3})

    stepper = asyncio.ensure_future(step_once_tapped())
    rc = await asyncio.wait_for(
        run_tap(
            nats_url,
            run_id,
            "metrics",
            tap=Tap(emit=lines.append, count=1),
            history=0,
            timeout_s=None,
            note=notes.append,
        ),
        HANG_GUARD_S,
    )
    await stepper
    assert rc == 0 and len(lines) == 1 and "step=3" in lines[0], (lines, notes)
    assert not any("has finished" in n for n in notes), notes
    await launcher.close()
    await trainer.close()


def _has_client(monitor_port: int, name: str) -> bool:
    url = f"http://127.0.0.1:{monitor_port}/connz"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return any(c.get("name") == name for c in json.load(resp).get("connections") or [])


@pytest.mark.slow  # ~12 s on 2 cores: a run's server stops under a CLI in a subprocess
async def test_top_exits_0_saying_the_run_finished_when_its_server_goes(tmp_path):
    # issue 44: `areal top` exited 2 ("lost the NATS server") at the normal end of a run,
    # whose launcher stops its embedded server
    monitor_port = free_port()
    server = EmbeddedNats(tmp_path / "nats", monitor_port=monitor_port).start()
    url = server.url
    try:
        bus = await Bus.connect(url, "ends", "trainer", "trainer-0")
        await bus.kv_put("trainer", TrainerState(step=2, done=True))
        await bus.event("run_finished", steps=2, final_reward=0.5, wall_s=12.0)
        await bus.close()
        top = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "areal.cli",
            "top",
            "--run",
            "ends",
            "--nats-url",
            url,
            "--interval",
            "0.2",
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + HANG_GUARD_S
        while not await asyncio.to_thread(_has_client, monitor_port, "areal-top-ends"):
            assert top.returncode is None and time.monotonic() < deadline, "top never attached"
            await asyncio.sleep(0.1)
    finally:
        server.stop()
    _, err = await asyncio.wait_for(top.communicate(), HANG_GUARD_S)
    assert top.returncode == 0, err.decode()
    assert "top: run ends finished at step 2, final reward 0.500" in err.decode(), err.decode()
