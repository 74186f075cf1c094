"""`bench/cpu_by_process.py`: CPU seconds per role of a command's processes, over the whole
run and, with `--steps A:B`, between two steps of the run's metrics.jsonl."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path[:0] = [str(BENCH)]

from cpu_by_process import latest_step, parse_window  # noqa: E402

# a stand-in worker: burns CPU for a while per "step" and records each step as the trainer does
WORKER = """
import json, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
for step in range(1, 5):
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    with open(out + "/metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step}) + "\\n")
    time.sleep(0.6)  # a few of the tool's 0.25 s samples see each step
"""


def test_the_window_counts_cpu_between_two_steps(tmp_path):
    cmd = [sys.executable, "-c", WORKER, "--worker-id", "fake-0", "--out", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, str(BENCH / "cpu_by_process.py"), "--steps", "1:3", *cmd],
        capture_output=True,
        text=True,
        timeout=300,  # hang guard
    )
    assert out.returncode == 0, out.stderr
    whole, _, window = out.stdout.partition("steps 1 to 3")
    assert "| fake-0 |" in whole and "| all |" in whole
    row = next(ln for ln in window.splitlines() if ln.startswith("| fake-0 |"))
    cpu_s, cores = (float(c) for c in row.strip("|").split("|")[1:])
    assert cpu_s > 0 and cores > 0
    # the window holds the burns of steps 2 and 3, not those of 1 and 4
    total = float(
        next(ln for ln in whole.splitlines() if ln.startswith("| fake-0 |")).split("|")[2]
    )
    assert cpu_s < total


def test_window_arguments_are_checked(tmp_path):
    assert parse_window(["areal", "run"]) == (None, None, ["areal", "run"])
    assert parse_window(["--steps", "2:5", "x", "--out", "d"]) == (
        (2, 5),
        "d/metrics.jsonl",
        ["x", "--out", "d"],
    )
    for bad, why in [
        (["--steps", "5"], "takes A:B"),
        (["--steps", "5:3", "x", "--out", "d"], "needs 0 <= A < B"),
        (["--steps", "1:3", "x"], "needs the command's --out"),
    ]:
        with pytest.raises(SystemExit, match=why):
            parse_window(bad)


def test_latest_step_skips_partial_lines(tmp_path):
    m = tmp_path / "metrics.jsonl"
    assert latest_step(str(m)) == 0  # not written yet
    m.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert latest_step(str(m)) == 2
    # an earlier run's file, not yet replaced by the one being measured: no step seen
    assert latest_step(str(m), since=m.stat().st_mtime + 1) == 0
