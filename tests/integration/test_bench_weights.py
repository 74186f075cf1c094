"""`bench/weights.py --quick` end to end: its own nats-server, a 64 MiB synthetic Qwen2-shaped
model through the object store and `file://` with 1 and 2 fetcher processes; every fetcher
ends with the verified weights, streaming adds far less than a blob to any process, and the
physical bounds are measured in the same run. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BENCH = Path(__file__).resolve().parents[2] / "bench" / "weights.py"


def test_the_quick_weights_bench_runs_and_reports_every_case(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(tmp_path), "--mem-budget-gib", "4"],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "weights_quick.json").read_text())
    cases = [(r["transport"], r["fetchers"], r["masters"]) for r in report["results"]]
    assert sorted(cases) == sorted(
        [
            ("object_store", 1, "bfloat16"),
            ("object_store", 1, "float32"),
            ("object_store", 2, "bfloat16"),
            ("file", 1, "bfloat16"),
            ("file", 2, "bfloat16"),
        ]
    )
    for r in report["results"]:
        nbytes = r["publisher"]["nbytes"]
        assert len(r["fetched"]) == r["fetchers"]
        assert all(f["nbytes"] == nbytes for f in r["fetched"])  # verified, whole
        assert r["summary"]["fetcher_stream_mib"] * 2**20 < nbytes / 2  # never a second blob
        assert r["summary"]["publisher_stream_mib"] * 2**20 < nbytes / 2
    assert all(v > 0 for v in report["bounds"].values())
    table = (tmp_path / "weights_quick.md").read_text()
    assert "| model | masters→wire | transport |" in table and "loopback TCP" in table
    assert (tmp_path / "weights_quick.png").stat().st_size > 0
