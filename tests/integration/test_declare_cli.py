"""`areal declare`: the run's streams, consumers and buckets made with the launcher's account
(where no `areal run` launcher does it: compose's `declare` service, Kubernetes); a worker
account is refused with a one-line config error."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from areal.bus.client import Bus
from areal.bus.embedded import EmbeddedNats
from areal.bus.nats_config import authorization_block, ensure_accounts
from areal.config import NatsSettings
from tests.e2e.test_run import EXAMPLE, ROOT

pytestmark = pytest.mark.integration


def declare(url: str, *sets: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "areal.cli", "declare", "--config", str(EXAMPLE)]
    args += ["--nats-url", url]
    for kv in sets:
        args += ["--set", kv]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # ~8 s on 2 cores: the CLI in subprocesses
async def test_areal_declare_makes_the_run_with_the_launchers_account(tmp_path, run_id):
    keys = tmp_path / "keys"
    auth = authorization_block(ensure_accounts(keys, [run_id]))
    with EmbeddedNats(store_dir=tmp_path / "nats", authorization=auth) as server:
        refused = declare(
            server.url, f"run_id={run_id}", f"nats.credentials_file={keys / 'rollout.json'}"
        )
        assert refused.returncode == 2 and "config error" in refused.stderr, refused.stderr
        done = declare(server.url, f"run_id={run_id}", f"nats.credentials_dir={keys}")
        assert done.returncode == 0, done.stderr
        assert f"declared run {run_id}" in done.stderr
        nats = NatsSettings(credentials_dir=str(keys))
        bus = await Bus.connect(server.url, run_id, "rollout", "r-0", nats, declare=False)
        try:
            assert await bus.wait_declared(asyncio.Event())
        finally:
            await bus.close()
