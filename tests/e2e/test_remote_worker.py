"""A worker "on another host" joins a running run with only the NATS URL and the run id.

The joining rollout worker runs in another working directory, with another cache dir and none
of the launcher's environment: everything it knows comes from `--join RUN_ID --nats-url URL`
and a copy of its role's credentials file, `--credentials FILE` (the scale-out
command of docs/tutorials/scaling-out.md). It must fetch the run's config and model from the bus, and
produce samples that the trainer trains on; the run must still end with exact accounting.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from areal.bus.auth import Credentials, load_credentials
from areal.bus.codec import decode
from areal.bus.tap import TapClient, TapMessage
from schemas import ScoredGroup

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "arithmetic.yaml"
REMOTE_ID = "rollout-remote"


class ScoredBy(threading.Thread):
    """Counts the scored samples on the run's `rewards` stream (the trainer's input) by the
    rollout worker that generated them; a core subscription, so it takes nothing away."""

    def __init__(self, url: str, run_id: str, credentials: Credentials) -> None:
        super().__init__(daemon=True)
        self.url, self.run_id, self.credentials = url, run_id, credentials
        self.counts: collections.Counter[str] = collections.Counter()
        self.ready, self.stop = threading.Event(), threading.Event()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        client = await TapClient.connect(
            self.url, self.run_id, name="test-scored-by", credentials=self.credentials
        )

        async def on_message(tm: TapMessage) -> None:
            for scored in decode(tm.data, ScoredGroup).scored:
                self.counts[scored.sample.worker_id] += 1

        await client.follow("rewards", on_message)
        self.ready.set()
        while not self.stop.is_set():
            await asyncio.sleep(0.1)
        await client.close()


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, f"no {path} after {timeout_s}s"
        time.sleep(0.1)


def test_a_worker_elsewhere_joins_with_the_url_and_the_run_id(tmp_path: Path):
    out, run_id = tmp_path / "run", f"join-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal.cli",
            "run",
            str(EXAMPLE),
            "--out",
            str(out),
            "--quiet",
            "--set",
            f"run_id={run_id}",
            "--set",
            "train.total_steps=80",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    remote: subprocess.Popen | None = None
    scored_by: ScoredBy | None = None
    try:
        # config.json is written once the run's files are shared, before any worker starts
        wait_for(out / "config.json", launcher, timeout_s=300)
        url = json.loads((out / "config.json").read_text())["nats"]["url"]
        # the run's per-role accounts: the test reads as the monitor, and the worker elsewhere
        # is handed a copy of the rollout's credentials file (as the join hint says)
        keys = out / "keys" / "nats"
        scored_by = ScoredBy(url, run_id, load_credentials(keys / "monitor.json"))
        scored_by.start()
        assert scored_by.ready.wait(30)

        elsewhere = tmp_path / "other-host"
        elsewhere.mkdir()
        creds = elsewhere / "rollout.json"
        shutil.copy(keys / "rollout.json", creds)
        creds.chmod(0o600)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_")}
        env["AREAL_CACHE_DIR"] = str(elsewhere / "cache")  # not the launcher's cache
        remote_log = elsewhere / "worker.log"
        with remote_log.open("wb") as log:
            remote = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "areal.cli",
                    "worker",
                    "rollout",
                    "--join",
                    run_id,
                    "--nats-url",
                    url,
                    "--credentials",
                    str(creds),
                    "--worker-id",
                    REMOTE_ID,
                ],
                cwd=elsewhere,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        _, err = launcher.communicate(timeout=900)  # hang guard
        assert launcher.returncode == 0, err.decode()[-3000:]
        # the remote worker stops by itself on the run's `run_finished` event
        assert remote.wait(timeout=120) == 0, remote_log.read_text()[-3000:]
    finally:
        for p in (launcher, remote):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if scored_by is not None:
            scored_by.stop.set()
            scored_by.join(10)
    print(f"remote-worker run: {time.monotonic() - t0:.1f} s; scored by {dict(scored_by.counts)}")

    log = remote_log.read_text()
    assert "run_files_fetched" in log, log[-3000:]
    copies = list((elsewhere / "cache" / "joined").glob(f"{run_id}-*/model/model.safetensors"))
    assert len(copies) == 1  # its model came from the bus into its own cache
    # it produced samples that reached the trainer ...
    assert scored_by.counts[REMOTE_ID] > 0, dict(scored_by.counts)
    # ... and the run still accounts for every task exactly once
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 80
    assert summary["admitted"] == (
        summary["trained"] + summary["dropped_stale"] + summary["filtered"] + summary["in_flight"]
    )
    assert summary["in_flight"] == 0 and summary["dlq"] == 0
    assert summary["trained"] == 80 * 16
