"""`areal top --once` attached to a live run: every panel, real numbers, each role's worker."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from areal.bus.tap import TapClient
from areal.monitor.tap import Tap
from areal.monitor.top import PANEL_TITLES

# Slow: a real 4-process run kept live while top attaches (~25 s on 2 cores; the first run on a
# machine also builds the cached warm-start model, ~1 min).
# The timeout covers that first build on a busy machine.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


async def _first_step(url: str, run_id: str, proc: asyncio.subprocess.Process) -> None:
    """Wait until the run's streams exist and the trainer published its first step."""
    client = await TapClient.connect(url, run_id)
    try:
        step = Tap(emit=None, count=1)
        await client.follow("metrics.trainer.step", step.on_message, history=-1)
        waiter = asyncio.ensure_future(step.done.wait())
        exited = asyncio.ensure_future(proc.wait())
        await asyncio.wait({waiter, exited}, timeout=600, return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        assert step.done.is_set(), "the run published no step metric"
    finally:
        await client.close()


async def test_top_once_against_a_live_run(nats_url, run_id, tmp_path):
    run = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "areal.cli",
        "run",
        str(REPO / "examples" / "arithmetic.yaml"),
        "--nats-url",
        nats_url,
        "--set",
        f"run_id={run_id}",
        "--set",
        "train.total_steps=5000",
        "--quiet",
        "--out",
        str(tmp_path / "run"),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # started with SIGINT ignored, as a script's background job inherits it: the SIGINT
        # below must still stop the run (it once went on to its last step: CI, 2026-12-05)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        # the run declares its streams once its workers start: retry until the first step
        deadline = asyncio.get_running_loop().time() + 700
        while True:
            try:
                await _first_step(nats_url, run_id, run)
                break
            except Exception:
                if run.returncode is not None or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(1.0)
        top = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "areal.cli",
            "top",
            "--once",
            "--run",
            run_id,
            "--nats-url",
            nats_url,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out_b, err_b = await asyncio.wait_for(top.communicate(), 60)
        out = out_b.decode()
        assert top.returncode == 0, err_b.decode()
        assert run.returncode is None, "the run ended before top looked at it"
    finally:
        if run.returncode is None:
            run.send_signal(signal.SIGINT)  # the launcher stops its workers on Ctrl-C
        await asyncio.wait_for(run.wait(), 60)
    assert run.returncode == 130, run.returncode  # stopped by the SIGINT, not finished
    (tmp_path / "top.txt").write_text(out)
    assert "\x1b[" not in out  # not a TTY: plain text
    for title in PANEL_TITLES:
        assert title in out, title
    assert f"run {run_id}  [running]" in out
    version = int(re.search(r"policy version (\d+)", out).group(1))
    assert version > 0
    for wid in ("controller-0", "rollout-0", "reward-0", "trainer-0"):
        assert wid in out, wid
    assert re.search(r"rollout\s+\d+\.\d+\s+\d+\.\d+", out)  # samples/s and tokens/s
    assert re.search(r"prompts\s+\d+\s+\d+\s+\d+", out)  # queue depth and ack pending
