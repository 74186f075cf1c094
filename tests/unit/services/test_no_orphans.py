"""A SIGKILLed owner leaves no scoring process or sandboxed program behind.

A child script builds a `ScoringPool` (2 spawned processes) and starts a hanging `code_reward`
program in each, prints every pid, then waits; the test SIGKILLs the script (no cleanup runs)
and checks that each pid goes away. The only time limit is a generous hang guard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.factories import process_alive

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    from pathlib import Path
    from areal.services.reward_pool import ScoringPool
    from areal.rewards.scoring import Item

    async def main():
        pool = ScoringPool("code", workers=2, timeout_s=600)
        # a program that never ends, so the sandbox child is alive at the kill
        hang = ("```python\\nimport time\\nwhile True: time.sleep(1)\\n```", "")
        # two calls: the executor starts a process per call while none is idle
        tasks = [asyncio.ensure_future(pool.score([hang])) for _ in range(2)]
        while True:
            await asyncio.sleep(0.2)
            pids = [p.pid for p in pool._executor._processes.values()]
            kids = {}
            for pid in pids:
                try:
                    kids[pid] = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                except OSError:
                    kids[pid] = []
            sandboxes = [int(k) for ks in kids.values() for k in ks]
            if len(pids) == 2 and len(sandboxes) == 2:
                print(json.dumps({"pool": pids, "sandboxes": sandboxes}), flush=True)
                await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


def test_killing_the_owner_kills_its_pool_and_sandboxes(tmp_path):
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # hang guard: pytest-timeout
        assert line, proc.stderr.read()[-3000:]
        pids = json.loads(line)
        assert len(pids["pool"]) == 2 and len(pids["sandboxes"]) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        everyone = pids["pool"] + pids["sandboxes"]
        deadline = time.monotonic() + 60  # generous: the kernel delivers at once
        while any(process_alive(p) for p in everyone) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in everyone if process_alive(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
