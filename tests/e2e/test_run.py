"""The real system end to end: `areal run` with an embedded nats-server and worker processes.

These are the issue's acceptance checks: reward rises, the admission rule and the staleness
bound hold at every step, every admitted task is accounted for exactly once, synchronous mode is
truly synchronous, bad config fails before anything starts, Ctrl-C stops every process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.factories import process_alive

# the pytest-timeout default (300 s) would cut runs that pass their own 900 s hang guards
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "arithmetic.yaml"


def areal(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "areal.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def start_run(out: Path, *sets: str) -> subprocess.Popen:
    """`areal run` of the example in the background, with `--set` overrides."""
    args = [sys.executable, "-m", "areal.cli", "run", str(EXAMPLE), "--out", str(out), "--quiet"]
    for kv in sets:
        args += ["--set", kv]
    # no SIGINT reset here: a runner started as a background job passes SIGINT on ignored,
    # and the launcher itself must still stop on the Ctrl-C tests' SIGINT
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_steps(proc: subprocess.Popen, out: Path, n: int, timeout_s: float = 300) -> None:
    """Wait until the run has written `n` step records (failing fast if it died)."""
    deadline = time.monotonic() + timeout_s
    path = out / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= n):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, f"no {n} steps after {timeout_s}s"
        time.sleep(0.1)


def admission_steps(recs: list[dict]) -> list[int]:
    """Per step record: the most published steps (admission's i: `version - versions_skipped`,
    the record's step) that the controller can have counted when the record read `admitted`.
    A restart lowers i to its checkpoint's step while tasks admitted against the trainer before
    it are still in flight (the steps since are redone): that trainer published at most the
    version the restart rolled past, less the versions skipped before."""
    seen, out = 0, []
    prev = {"step": 0, "versions_skipped": 0}  # the record before (the checkpoint's, on a restart)
    for r in recs:
        if r["versions_skipped"] > prev["versions_skipped"]:  # rolled forward at a restart
            rolled_past = r["version"] - (r["step"] - prev["step"]) - 1
            seen = max(seen, rolled_past - prev["versions_skipped"])
        seen = max(seen, r["version"] - r["versions_skipped"])
        out.append(seen)
        prev = r
    return out


def check_step_records(recs: list[dict], eta: int, B: int) -> None:
    """What every step record must show: the staleness bound and consistent batch timings."""
    for r, i in zip(recs, admission_steps(recs), strict=True):
        # admission (AReaL eq. 3), read right after the step's version was published
        assert r["outstanding"] <= (i + eta + 1) * B, r
        # intake: nothing older than η was trained on
        assert r["staleness_max"] <= eta, r
        assert r["trained_on_version"] - r["token_version_min"] <= eta, r
        # where the batch's time went, from its samples' timestamps (one host: no clock skew)
        assert 0 <= r["tail_s"] <= r["gen_span_s"], r
        assert r["queue_s"] >= 0 and r["ready_age_s"] >= 0, r


def check_invariants(out: Path, eta: int, B: int) -> dict:
    recs = records(out)
    summary = json.loads((out / "summary.json").read_text())
    check_step_records(recs, eta, B)
    # every admitted task accounted for exactly once
    assert summary["admitted"] == (
        summary["trained"]
        + summary["dropped_stale"]
        + summary["filtered"]
        + summary["rejected"]
        + summary["in_flight"]
    )
    assert summary["rejected"] == 0 and summary["skipped_steps"] == 0
    assert summary["in_flight"] == 0
    assert summary["trained"] == summary["steps"] * B
    assert summary["dlq"] == 0
    assert [r["step"] for r in recs] == list(range(1, summary["steps"] + 1))
    return summary


@pytest.mark.slow  # the learning run: ~2-4 minutes on a 2-core CPU
def test_async_run_learns_and_keeps_its_invariants(tmp_path):
    out = tmp_path / "run"
    res = areal("run", str(EXAMPLE), "--out", str(out), "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    summary = check_invariants(out, eta=1, B=16)
    assert summary["reward_last5"] > summary["reward_first5"] + 0.15, summary
    assert (out / "final" / "config.json").exists()
    assert json.loads((out / "config.json").read_text())["algo"]["max_staleness"] == 1


def test_synchronous_mode_trains_each_step_on_its_own_version(tmp_path):
    out = tmp_path / "sync"
    res = areal(
        "run",
        str(EXAMPLE),
        "--out",
        str(out),
        "--quiet",
        "--set",
        "train.total_steps=5",
        "--set",
        "algo.max_staleness=0",
        "--set",
        "rollout.interruptible=false",
        "--set",
        "weights.transport=file",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    check_invariants(out, eta=0, B=16)
    for r in records(out):
        assert r["token_version_min"] == r["token_version_max"] == r["trained_on_version"], r
        assert r["staleness_hist_tokens"] == {"0": r["tokens"]}
    assert (out / "weights").is_dir()  # weights went through the shared dir (file:// URIs)


def test_bad_config_fails_before_anything_starts(tmp_path):
    res = areal("run", str(EXAMPLE), "--out", str(tmp_path / "bad"), "--set", "algo.batch_size=0")
    assert res.returncode == 2
    assert "algo.batch_size" in res.stderr and "greater than or equal to 1" in res.stderr
    assert not (tmp_path / "bad").exists()


def _children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(d.name))
    return out


def test_ctrl_c_stops_every_process(tmp_path):
    out = tmp_path / "cc"
    proc = start_run(out, "train.total_steps=1000")
    wait_steps(proc, out, 1)
    children = _children_of(proc.pid)
    assert len(children) >= 5  # nats-server, controller, trainer, reward, rollout
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    time.sleep(0.5)
    alive = [
        c
        for c in children
        if Path(f"/proc/{c}").exists()
        and "Z" not in (Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1].split()[0])
    ]
    assert alive == [], alive
    assert proc.returncode in (130, -signal.SIGINT, 0)


def _worker_pid(launcher_pid: int, wid: str) -> int | None:
    for pid in _children_of(launcher_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if wid.encode() in cmd:
            return pid
    return None


@pytest.mark.slow  # kills and restarts workers mid-run: ~1-2 minutes
def test_killed_workers_are_restarted_and_nothing_is_lost(tmp_path):
    """SIGKILL the controller, a rollout worker, the reward worker and the trainer mid-run: the
    launcher restarts them, the bus redelivers their unfinished work, the trainer resumes from
    its checkpoint, and the run finishes with every admitted task accounted for exactly once.
    The reward worker's scoring processes die with it (no orphans)."""
    out = tmp_path / "crash"
    proc = start_run(out, "train.total_steps=30", "nats.ack_wait_s=4")
    orphans: list[int] = []
    try:
        kills = (("controller-0", 3), ("rollout-0", 8), ("reward-0", 11), ("trainer-0", 14))
        for wid, after_step in kills:
            wait_steps(proc, out, after_step)
            pid = _worker_pid(proc.pid, wid)
            assert pid is not None, wid
            children = _children_of(pid)  # the reward worker's pool (spawned on first use)
            os.kill(pid, signal.SIGKILL)
            if wid.startswith("reward"):
                assert children, "the reward worker had no scoring process to check"
                deadline = time.monotonic() + 60  # hang guard: the kernel signals at once
                while [c for c in children if process_alive(c)] and time.monotonic() < deadline:
                    time.sleep(0.1)
                orphans = [c for c in children if process_alive(c)]
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-3000:]
    assert orphans == [], "scoring processes outlived their reward worker"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["trained"] == 30 * 16
    assert (
        summary["admitted"] == summary["trained"] + summary["dropped_stale"] + summary["filtered"]
    )
    assert summary["in_flight"] == 0
    recs = records(out)
    steps = [r["step"] for r in recs]
    assert steps == list(range(1, 31))  # resumed from the checkpoint: no step lost or repeated
    for r, i in zip(recs, admission_steps(recs), strict=True):
        assert r["staleness_max"] <= 4
        assert r["outstanding"] <= (i + 4 + 1) * 16
    assert (out / "logs" / "trainer-0.log").read_text().count("trainer_resumed") == 1


@pytest.mark.slow  # two launcher runs: ~1 minute
def test_resume_after_ctrl_c_finishes_the_run(tmp_path):
    """Ctrl-C mid-run, then `--resume`: the trainer continues from its checkpoint, the queued
    work in the embedded server's store (inside --out) is still there, and the accounting of
    the whole run is exact."""
    out = tmp_path / "resume"
    proc = start_run(out, "train.total_steps=20")
    wait_steps(proc, out, 6)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert not (out / "summary.json").exists()
    # the example checkpoints every 10 steps; a stop writes one for the steps trained since
    stopped_at = records(out)[-1]["step"]
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["trainer"]["step"] == stopped_at
    res = areal(
        "run",
        str(EXAMPLE),
        "--out",
        str(out),
        "--quiet",
        "--set",
        "train.total_steps=20",
        "--resume",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = check_invariants(out, eta=1, B=16)
    assert summary["steps"] == 20
    resumed = [
        ln
        for ln in (out / "logs" / "trainer-0.log").read_text().splitlines()
        if "trainer_resumed" in ln
    ]
    assert len(resumed) == 1 and re.search(rf"\bstep\W+{stopped_at}\b", resumed[0]), resumed


def test_runs_whose_ids_differ_only_in_dash_or_underscore_share_a_server(tmp_path, nats_url):
    # Issue 10, bug 1: `run-a` and `run_a` once mapped to the same streams and KV bucket, and
    # declaring the second rewrote the first's stream subjects. On one server both must finish,
    # each with its own exact accounting.
    steps, B = 6, 16
    procs = {
        rid: start_run(
            tmp_path / rid,
            f"run_id={rid}",
            f"nats.url={nats_url}",
            f"train.total_steps={steps}",
        )
        for rid in ("run-a", "run_a")
    }
    for rid, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (rid, err.decode()[-3000:])
    for rid in procs:
        summary = check_invariants(tmp_path / rid, eta=4, B=B)
        assert summary["steps"] == steps and summary["trained"] == steps * B, (rid, summary)
        assert summary["in_flight"] == 0, (rid, summary)
        returned = summary["dropped_stale"] + summary["filtered"]
        assert summary["admitted"] == steps * B + returned, (rid, summary)
