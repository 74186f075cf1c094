"""Time a run loses when its embedded nats-server is SIGKILLed mid-run, on the quickstart.

The launcher restarts a dead embedded nats-server on its store and port and the workers
reconnect; what it costs is how long the run crawls afterwards. Each run is `areal run
examples/arithmetic.yaml` (150 steps, η = 1); its nats-server is SIGKILLed as soon as the
trainer has recorded step 40, 80 and 120 (`--kill-at`). Per kill: the wall time of the next
`--window` steps (20) minus window x the run's median step before its first kill. With
`--compare REV` the same runs are made from a git worktree of REV too (same venv, its code
first on PYTHONPATH), interleaved, so two versions of the code are compared side by side on
one machine in one sitting.

    python bench/nats_restart.py [--repeats 2] [--compare HEAD~1] [--tag _x]

Writes nats_restart<tag>.md and .json to the results dir
(bench/_common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

from _common import code_trees, md_table, median, report, write_report  # noqa: E402

RUN_TIMEOUT_S = 900.0  # a hang guard for one run


def nats_server_pids(out: Path) -> list[int]:
    """PIDs of the nats-server(s) whose command line names the run's store under `out`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "nats-server" in cmd and str(out / "nats") in cmd:
            pids.append(int(pid))
    return pids


def steps_of(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if "reward_mean" in row and "wall_s" in row:
            rows.append(row)
    return rows


def run_once(code: Path, out: Path, kill_at: list[int], steps: int) -> dict:
    """One run of the quickstart from the checkout `code`, its nats-server killed at `kill_at`."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    cmd = [
        sys.executable, "-m", "areal.cli", "run", str(code / "examples/arithmetic.yaml"),
        "--out", str(out), "--quiet", "--set", f"train.total_steps={steps}",
    ]  # fmt: skip
    log = (out.parent / f"{out.name}.log").open("w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT)
    kills: list[int] = []  # the step recorded last when each kill was sent
    pending = sorted(kill_at)
    while proc.poll() is None:
        if time.monotonic() - t0 > RUN_TIMEOUT_S:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
            raise TimeoutError(f"run {out} did not finish in {RUN_TIMEOUT_S:.0f} s")
        if pending:
            done = len(steps_of(out))
            if done >= pending[0]:
                pids = nats_server_pids(out)
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                if pids:
                    kills.append(done)
                pending.pop(0)
        time.sleep(0.02)
    log.close()
    rows = steps_of(out)
    summary = (
        json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    )
    return {"rc": proc.returncode, "kills": kills, "wall": [r["wall_s"] for r in rows],
            "summary": {k: summary.get(k) for k in ("admitted", "trained", "dropped_stale")}}  # fmt: skip


def losses(run: dict, window: int) -> tuple[float, list[float]]:
    """Median step before the first kill, and per kill the time lost over the next `window`."""
    wall = run["wall"]
    first = run["kills"][0] if run["kills"] else len(wall)
    steps = wall[5:first]
    base = median([b - a for a, b in zip(steps, steps[1:], strict=False)])
    lost = []
    for k in run["kills"]:
        if k + window <= len(wall):  # steps are 1-based: wall[k - 1] is step k
            lost.append(wall[k - 1 + window] - wall[k - 1] - window * base)
    return base, lost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--compare", default=None, help="a git revision to run beside this tree")
    ap.add_argument("--kill-at", default="40,80,120", help="steps after which to kill")
    ap.add_argument("--window", type=int, default=20, help="steps after a kill to charge")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--keep", default=None, help="keep the runs' folders and logs under this folder"
    )
    args = ap.parse_args()
    kill_at = [int(s) for s in args.kill_at.split(",")]
    with (
        tempfile.TemporaryDirectory(prefix="areal-nats-restart-") as tmp,
        code_trees(args.compare, Path(tmp)) as codes,
    ):
        runs_dir = Path(args.keep) if args.keep else Path(tmp)
        runs_dir.mkdir(parents=True, exist_ok=True)
        results: dict[str, list[dict]] = {name: [] for name in codes}
        for rep in range(args.repeats):
            for i, (name, code) in enumerate(codes.items()):
                out = runs_dir / f"run-{rep}-{i}"
                run = run_once(code, out, kill_at, args.steps)
                base, lost = losses(run, args.window)
                run.update(base=base, lost=lost)
                results[name].append(run)
                print(f"{name} #{rep}: rc {run['rc']}, kills after steps {run['kills']}, "
                      f"median step {base:.3f} s, lost {[round(x, 1) for x in lost]} s, "
                      f"{run['summary']}", flush=True)  # fmt: skip
    rows = []
    for name, runs in results.items():
        for rep, r in enumerate(runs):
            s = r["summary"]
            rows.append([name, rep, r["rc"], f"{r['base']:.3f}",
                         " / ".join(f"{x:.1f}" for x in r["lost"]), f"{sum(r['lost']):.1f}",
                         f"{s['admitted']} / {s['trained']} / {s['dropped_stale']}"])  # fmt: skip
    summary = [
        f"- {name}: per kill {median([x for r in runs for x in r['lost']]):.1f} s lost (median "
        f"of {sum(len(r['lost']) for r in runs)} kills), "
        f"{min(x for r in runs for x in r['lost']):.1f}-{max(x for r in runs for x in r['lost']):.1f} s"
        for name, runs in results.items()
    ]
    header = {"kills": f"SIGKILL of the run's embedded nats-server after steps {kill_at}; time "
              f"lost = wall time of the next {args.window} steps - {args.window} x the median "
              "step before the first kill"}  # fmt: skip
    table = md_table(["code", "repeat", "exit", "median step s", "lost s per kill",
                      "lost s in all", "admitted / trained / dropped"], rows)  # fmt: skip
    text = report("Time lost to a nats-server restart (quickstart)", header, table, summary)
    write_report(f"nats_restart{args.tag}", text, results)


if __name__ == "__main__":
    main()
