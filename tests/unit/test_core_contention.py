"""`bench/core_contention.py`: each core's rate alone and with every core busy, as a table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow  # ~17 s on 2 cores: it times real CPU work
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to compare")
def test_it_times_each_core_alone_and_together(tmp_path):
    out = subprocess.run(
        [sys.executable, str(BENCH / "core_contention.py"), "--iters", "3", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,  # hang guard
    ).stdout
    report = (tmp_path / "core_contention.md").read_text()
    assert report.strip() in out
    rows = [ln for ln in report.splitlines() if ln.startswith("| mlp") or ln.startswith("| matmul")]
    assert len(rows) == 2 * len(os.sched_getaffinity(0))
    for row in rows:
        alone, together, ratio = (float(c) for c in row.strip("|").split("|")[2:])
        assert alone > 0 and together > 0
        assert ratio == pytest.approx(together / alone, abs=0.01)
