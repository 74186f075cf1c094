"""`areal run` on the quickstart config with per-role accounts (the default).

Steps being trained is itself the check that each worker used its own role's account: prompts
are published only by the controller's, samples only by the rollout's, scores only by the
reward's and weights only by the trainer's (`areal.bus.nats_config`), and no worker's log holds
a refusal. A monitor without credentials is refused with the fix; with the run dir it attaches.
The run is long enough that it is still up (its embedded server with it) whatever the monitors
take to start on a busy machine, and is stopped by Ctrl-C afterwards. Nothing is decided by a
clock except generous hang guards."""

from __future__ import annotations

import json
import signal
import stat
from pathlib import Path

import pytest

from areal.bus.nats_config import ROLES
from tests.e2e.test_run import areal, check_step_records, records, start_run, wait_steps

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


def test_a_run_gives_each_role_its_own_account_and_monitors_need_theirs(tmp_path):
    out = tmp_path / "accounts"
    proc = start_run(out, "train.total_steps=1000")  # outlives the monitors; Ctrl-C ends it
    try:
        wait_steps(proc, out, 2)
        cfg = json.loads((out / "config.json").read_text())
        keys = Path(cfg["nats"]["credentials_dir"])
        assert keys == (out / "keys" / "nats").resolve()
        for role in ROLES:  # one credentials file per role, its owner's eyes only
            assert stat.S_IMODE((keys / f"{role}.json").stat().st_mode) == 0o600, role
        conf = out / "nats" / "nats-server.conf"
        assert "authorization" in conf.read_text()
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600
        assert "password" not in json.dumps(cfg)  # config.json names the dir, holds no secret

        url, run_id = cfg["nats"]["url"], cfg["run_id"]
        top = ("top", "--once", "--collect", "0.5", "--nats-url", url, "--run", run_id)
        refused = areal(*top, timeout=120)  # hang guard
        assert refused.returncode == 2, refused.stderr
        assert "authorization violation" in refused.stderr
        assert "--credentials" in refused.stderr and "monitor.json" in refused.stderr
        seen = areal(*top, "--credentials", str(out), timeout=120)  # the run dir is enough
        assert seen.returncode == 0, seen.stderr
        assert run_id in seen.stdout
        assert proc.poll() is None  # the run was up for both monitors
        wait_steps(proc, out, 4)  # and kept training: weights went out, samples came back
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)  # hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (130, -signal.SIGINT, 0), err.decode()[-3000:]
    recs = records(out)
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1)) and len(recs) >= 4
    check_step_records(recs, cfg["algo"]["max_staleness"], cfg["algo"]["batch_size"])
    for log in (out / "logs").glob("*.log"):  # no worker was refused anything
        text = log.read_text()
        assert "nats_permission_denied" not in text and "authorization" not in text, log.name
