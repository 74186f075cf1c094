"""How long a run stalls when a node of its three-node NATS cluster dies, beside another revision.

Each repeat runs `tests/e2e/test_cluster.py` (a 24-step quickstart run on a local three-node
cluster with `nats.replicas=3`; the leader of the run's prompts stream is SIGKILLed after step
8 and stays dead) and reads the line it prints: the stall is the longest gap between two step
records after the kill, against the run's typical (median) gap. The test itself also checks
that the run finishes with exact accounting, no task trained twice and no worker restarted; a
repeat whose test failed is reported as such. With `--compare REV` the same repeats are run
from a git worktree of REV too, interleaved, from this venv.

    python bench/cluster_stall.py [--repeats 4] [--compare HEAD~1] [--tag _x] [--keep DIR]

Writes cluster_stall<tag>.md and .json to the results dir
(bench/_common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

from _common import code_trees, md_table, median, report, write_report  # noqa: E402

TEST = "tests/e2e/test_cluster.py::test_a_cluster_node_killed_mid_run_costs_no_worker_and_no_sample"
REPORT = "cluster_node_kill "  # the test prints this, then its JSON report
RUN_TIMEOUT_S = 1500.0  # a hang guard for one repeat (the test's own is 1200 s)


def run_once(code: Path, basetemp: Path) -> dict:
    """One run of the cluster test from the checkout `code`: its printed report, and whether
    it passed."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    basetemp.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
           f"--basetemp={basetemp}", TEST]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=code, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    report = next(
        (json.loads(ln[len(REPORT) :]) for ln in proc.stdout.splitlines() if ln.startswith(REPORT)),
        {},
    )
    return {"passed": proc.returncode == 0, **report}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--compare", default=None, help="a git revision to run beside this tree")
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--keep", default=None, help="keep the runs' folders and logs under this folder"
    )
    args = ap.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="areal-cluster-stall-") as tmp,
        code_trees(args.compare, Path(tmp)) as codes,
    ):
        results: dict[str, list[dict]] = {name: [] for name in codes}
        for rep in range(args.repeats):
            for i, (name, code) in enumerate(codes.items()):
                run = run_once(code, Path(args.keep or tmp) / f"run-{rep}-{i}")
                results[name].append(run)
                print(f"{name} #{rep}: {run}", flush=True)
    rows = [
        [name, rep, "yes" if r["passed"] else "NO", r.get("killed", "-"),
         r.get("stall_s", "-"), r.get("typical_gap_s", "-"), r.get("stall_before_step", "-")]
        for name, runs in results.items()
        for rep, r in enumerate(runs)
    ]  # fmt: skip
    summary = []
    for name, runs in results.items():
        stalls = [r["stall_s"] for r in runs if "stall_s" in r]
        passed = sum(r["passed"] for r in runs)
        summary.append(
            f"- {name}: stall {median(stalls):.1f} s (median of {len(stalls)}, "
            f"{min(stalls):.1f}-{max(stalls):.1f} s); test passed in {passed} of {len(runs)}"
            if stalls
            else f"- {name}: no stall measured; test passed in {passed} of {len(runs)}"
        )
    table = md_table(["code", "repeat", "test passed", "killed node", "stall s", "typical gap s",
                      "stall before step"], rows)  # fmt: skip
    header = {"run": f"`{TEST}`: 24 steps, nats.replicas=3, the prompts stream's leader "
              "SIGKILLed after step 8; stall = the longest gap between step records after the "
              "kill"}  # fmt: skip
    text = report("Stall when a NATS cluster node dies mid-run", header, table, summary)
    write_report(f"cluster_stall{args.tag}", text, results)


if __name__ == "__main__":
    main()
