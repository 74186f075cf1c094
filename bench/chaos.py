"""A long run under randomized faults, with the books checked at the end.

    python bench/chaos.py                          # 20 minutes, 30 faults, seed 0
    python bench/chaos.py --minutes 5 --faults 8   # a short look

`areal run examples/arithmetic.yaml` (embedded nats-server, `--max-restarts` high) runs while
faults are injected at seeded random times: SIGKILL of the controller, a rollout worker, the
reward worker or the trainer; SIGKILL of the nats-server (the launcher restarts it on its
store); the checkpoint dir made unwritable (`chattr +i`) for a while; a burst of bad messages
(random bytes, wrong types, a bad schema version) on the prompts / trajectories / rewards
subjects. Each fault waits for the run to have made a step since the previous one. Then the
run is stopped with Ctrl-C, resumed to a few more steps with `--resume`, and audited:

- admitted: tasks the controller admitted (its KV record); trained: tasks in the step records
  (`task_seqs`); dropped / filtered: the trainer's counts;
- lost = admitted tasks neither trained nor dropped nor filtered (must be 0);
- trained twice = task seqs that appear in more than one step record (must be 0);
- restarts used, max staleness, dead letters, and the time lost to each fault class (the time
  from a fault to the run's third step after it, beyond three median step times).

It prints a table and writes chaos.{md,json} to the results dir
(bench/_common.py). Nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, RESULTS_DIR, machine_header, md_table  # noqa: E402

CONFIG = REPO_ROOT / "examples" / "arithmetic.yaml"
KILLS = ("controller-0", "rollout-0", "reward-0", "trainer-0")
FAULTS = (*(f"kill:{w}" for w in KILLS), "kill:nats-server", "freeze_checkpoints", "bad_messages")


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def child_matching(launcher: int, needle: bytes) -> int | None:
    for pid in children(launcher):
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


def steps_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


# the role whose account may publish on each stage: the garbage comes from a buggy worker
PUBLISHER = {"prompts": "controller", "trajectories": "rollout", "rewards": "reward"}


async def _bad_messages(
    url: str, run_id: str, rng: random.Random, n: int, keys: Path | None = None
) -> None:
    import msgpack
    import nats

    from areal.bus.auth import load_credentials

    conns = {}
    for stage, role in PUBLISHER.items():
        creds = keys / f"{role}.json" if keys is not None else None
        opts = load_credentials(creds).connect_options() if creds and creds.is_file() else {}
        conns[stage] = await nats.connect(url, **opts)
    for _ in range(n):
        stage = rng.choice(("prompts", "trajectories", "rewards"))
        js = conns[stage].jetstream()
        kind = rng.choice(("bytes", "wrong_type", "bad_version"))
        if kind == "bytes":
            data = rng.randbytes(rng.randint(1, 300))
        elif kind == "wrong_type":
            data = msgpack.packb({"task_id": 7, "seq": "x", "group_size": None})
        else:
            data = msgpack.packb({"schema_version": 999})
        msg_id = f"chaos-bad-{rng.getrandbits(64):x}"
        await js.publish(f"areal.{run_id}.{stage}", data, headers={"Nats-Msg-Id": msg_id})
    for nc in conns.values():
        await nc.close()


def bad_messages(
    url: str, run_id: str, rng: random.Random, n: int = 10, keys: Path | None = None
) -> None:
    """`n` garbage messages on random stages, each through the account of the role that may
    publish there (`keys`: the run's `<out>/keys/nats`; None or absent: no credentials)."""
    asyncio.run(_bad_messages(url, run_id, rng, n, keys))


def server_url(out: Path) -> str:
    cfg = json.loads((out / "config.json").read_text())
    return cfg["nats"]["url"]


def wait_new_step(proc: subprocess.Popen, out: Path, after: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while steps_done(out) <= after:
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def run_chaos(args: argparse.Namespace, out: Path) -> dict:
    rng = random.Random(args.seed)
    run_id = f"chaos-{args.seed}"
    base = [sys.executable, "-m", "areal.cli", "run", str(CONFIG), "--out", str(out), "--quiet"]
    sets = ["--set", f"run_id={run_id}", "--set", "nats.ack_wait_s=4", "--max-restarts", "1000"]
    proc = subprocess.Popen(
        [*base, *sets, "--set", "train.total_steps=1000000"],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(out.with_name("launcher.log"), "wb"),  # noqa: SIM115
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    t0 = time.monotonic()
    duration = args.minutes * 60
    times = sorted(rng.uniform(0.05, 0.95) * duration for _ in range(args.faults))
    injected: list[dict] = []
    last_fault_step = 2  # the first fault comes after step 3
    for at in times:
        while time.monotonic() - t0 < at and proc.poll() is None:
            time.sleep(0.2)
        if not wait_new_step(proc, out, last_fault_step, 600):  # progress since the last one
            break
        fault = rng.choice(FAULTS)
        step = steps_done(out)
        t_fault = time.monotonic() - t0
        detail = ""
        if fault.startswith("kill:"):
            name = fault.split(":", 1)[1]
            pid = child_matching(proc.pid, name.encode())
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            detail = f"pid {pid}"
        elif fault == "freeze_checkpoints":
            hold = rng.uniform(5, 20)
            ckpt = out / "checkpoint"
            ok = subprocess.run(["chattr", "+i", str(ckpt)], capture_output=True).returncode == 0
            time.sleep(hold)
            subprocess.run(["chattr", "-i", str(ckpt)], capture_output=True)
            detail = f"{hold:.0f} s" if ok else "chattr unsupported"
        else:
            bad_messages(server_url(out), run_id, rng, keys=out / "keys" / "nats")
            detail = "10 messages"
        # recovery: how long the run takes for 3 more steps from the fault (the freeze's hold
        # included); beyond 3 median steps it is time lost to the fault
        t_end = time.monotonic()
        wait_new_step(proc, out, step + 2, 900)
        recover_s = time.monotonic() - t0 - t_fault
        last_fault_step = steps_done(out)
        injected.append(
            {
                "fault": fault,
                "at_s": round(t_fault, 1),
                "step": step,
                "detail": detail,
                "recover_s": round(recover_s, 1),
                "after_fault_s": round(time.monotonic() - t_end, 1),
            }
        )
        print(f"  {t_fault:7.1f} s  step {step:5d}  {fault:24s} {detail}", flush=True)
    while time.monotonic() - t0 < duration and proc.poll() is None:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # Ctrl-C, then resume to close the books
    proc.wait(timeout=120)
    # Everything admitted so far must be trained (or dropped / filtered) by the closing run:
    # admission allowed up to (version + η + 1) * B, so train up to that many steps.
    cfg = json.loads((out / "config.json").read_text())
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    total = int(last["version"]) + int(cfg["algo"]["max_staleness"]) + 2
    res = subprocess.run(
        [*base, "--resume", *sets, "--set", f"train.total_steps={total}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return {
        "injected": injected,
        "chaos_wall_s": round(time.monotonic() - t0, 1),
        "resume_rc": res.returncode,
        "resume_err": res.stderr[-2000:],
    }


def audit(out: Path, run: dict) -> dict:
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    seqs = Counter(s for r in records for s in r.get("task_seqs", []))
    trained_twice = sum(1 for c in seqs.values() if c > 1)
    # every admitted task ends once: trained (in exactly one step record), dropped or filtered
    lost = (
        summary["admitted"]
        - len(seqs)
        - summary["dropped_stale"]
        - summary["filtered"]
        - summary.get("rejected", 0)
    )
    logs = {p.name: p.read_text(errors="replace") for p in (out / "logs").glob("*.log")}
    launcher = out.with_name("launcher.log").read_text(errors="replace")
    restarts = launcher.count("worker_restarted")
    # time lost per fault class: the gap from the fault to the next step, past the median step
    walls = [float(r["wall_s"]) for r in records]
    gaps = [b - a for a, b in zip(walls, walls[1:], strict=False)]
    median = statistics.median(gaps) if gaps else 0.0
    lost_s: dict[str, float] = defaultdict(float)
    counts = Counter(f["fault"] for f in run["injected"])
    for f in run["injected"]:
        lost_s[f["fault"]] += max(0.0, f["recover_s"] - 3 * median)
    return {
        "summary": summary,
        "steps": len(records),
        "trained_tasks": len(seqs),
        "trained_twice": trained_twice,
        "lost": lost,
        "restarts": restarts,
        "server_restarts": launcher.count("nats_server_restarted"),
        "max_staleness": max((int(r["staleness_max"]) for r in records), default=0),
        "dlq": summary.get("dlq", 0),
        "faults": dict(counts),
        "lost_s": {k: round(v, 1) for k, v in lost_s.items()},
        "median_step_s": round(median, 2),
        "checkpoint_write_failures": sum(_failed_checkpoint_writes(t) for t in logs.values()),
    }


def _failed_checkpoint_writes(log: str) -> int:
    """Failed checkpoint write attempts in a worker log: the first of a pause (`write_failed` /
    `storage_full`) and its retries (`storage_write_retry`), each naming what=checkpoint."""
    events = ("write_failed", "storage_full", "storage_write_retry")
    return sum(
        1
        for line in log.splitlines()
        if any(e in line for e in events)
        and ("what=checkpoint" in line or '"what": "checkpoint"' in line)
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--faults", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="areal-chaos-") as tmp:
        out = Path(tmp) / "run"
        load_before = os.getloadavg()[0]
        run = run_chaos(args, out)
        if run["resume_rc"] != 0:
            print(f"the closing --resume failed ({run['resume_rc']}):\n{run['resume_err']}")
            return 1
        a = audit(out, run)
    s = a["summary"]
    rows = [
        ["faults injected", sum(a["faults"].values())],
        *[[f"  {k}", v] for k, v in sorted(a["faults"].items())],
        ["steps", a["steps"]],
        ["admitted", s["admitted"]],
        ["trained", a["trained_tasks"]],
        ["dropped stale", s["dropped_stale"]],
        ["filtered", s["filtered"]],
        ["dead-lettered messages", a["dlq"]],
        ["**lost** (must be 0)", a["lost"]],
        ["**trained twice** (must be 0)", a["trained_twice"]],
        ["worker restarts used", a["restarts"]],
        ["nats-server restarts", a["server_restarts"]],
        ["failed checkpoint writes (retried)", a["checkpoint_write_failures"]],
        ["max staleness (η = 4)", a["max_staleness"]],
        ["median step (s)", a["median_step_s"]],
        *[[f"time lost to {k} (s)", v] for k, v in sorted(a["lost_s"].items())],
    ]
    md = "\n".join(
        [
            "# Chaos: a long run under randomized faults",
            "",
            machine_header(),
            f"- load average when the chaos began {load_before:.2f}; chaos phase "
            f"{run['chaos_wall_s']:.0f} s, then Ctrl-C and a closing `--resume`",
            "",
            md_table(["", "value"], rows),
            "",
        ]
    )
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "chaos.md").write_text(md)
    (RESULTS_DIR / "chaos.json").write_text(json.dumps({"run": run, "audit": a}, indent=1))
    print(md)
    return 0 if a["lost"] == 0 and a["trained_twice"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
