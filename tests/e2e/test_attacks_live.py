"""A live `areal run` (per-role accounts, the default) attacked mid-run with every role's
account (`tests.attacks`): each attack is refused by the server, an unsigned `run_finished`
published with the trainer's password is refused by every worker, and the run finishes on its
own with every step training B tasks and nothing in flight. Nothing is decided by a clock
except generous hang guards."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from areal.bus.auth import load_credentials
from tests import attacks
from tests.e2e.test_run import check_invariants, start_run, wait_steps

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


async def _attack(url: str, run: str, keys: Path) -> list[attacks.Refusal]:
    def creds(role: str):
        return load_credentials(keys / f"{role}.json")

    refusals = [await attack() for attack in attacks.every_attack(url, run, creds)]
    await attacks.unsigned_run_finished(url, run, creds("trainer"))
    return refusals


@pytest.mark.slow  # a 40-step run: ~1-2 minutes on a 2-core CPU
def test_a_run_under_every_attack_finishes_exact(tmp_path):
    out = tmp_path / "attacked"
    proc = start_run(out, "train.total_steps=40")
    try:
        wait_steps(proc, out, 3)
        cfg = json.loads((out / "config.json").read_text())
        keys = Path(cfg["nats"]["credentials_dir"])
        refusals = asyncio.run(_attack(cfg["nats"]["url"], cfg["run_id"], keys))
        assert len(refusals) == 11
        _, err = proc.communicate(timeout=900)  # hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()[-3000:]
    summary = check_invariants(out, eta=cfg["algo"]["max_staleness"], B=cfg["algo"]["batch_size"])
    assert summary["steps"] == 40
    logs = {p.name: p.read_text() for p in (out / "logs").glob("*.log")}
    for role in ("controller", "rollout", "reward"):  # each heard the forgery and stayed
        text = next(t for name, t in logs.items() if name.startswith(role))
        assert "run_finished_refused" in text, role
