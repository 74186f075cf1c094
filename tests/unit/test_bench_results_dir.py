"""Benchmarks write their reports outside the checkout by default (issue 44: a dry run of
`bench/gpu_check.sh` left an untracked file in bench/results); `AREAL_BENCH_RESULTS` points
them at a dir of one's choice, e.g. bench/results to update the tables the docs cite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _results_dir(**env: str) -> Path:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_")}
    out = subprocess.run(
        [sys.executable, "-c", "import _common; print(_common.RESULTS_DIR)"],
        cwd=BENCH,
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return Path(out.stdout.strip())


def test_the_default_is_the_cache_dir_not_the_checkout(tmp_path):
    got = _results_dir(HOME=str(tmp_path))
    assert got == tmp_path / ".cache" / "areal-bus" / "bench-results"
    assert _results_dir(AREAL_CACHE_DIR=str(tmp_path / "c")) == tmp_path / "c" / "bench-results"


def test_areal_bench_results_wins(tmp_path):
    got = _results_dir(AREAL_BENCH_RESULTS=str(tmp_path / "r"), AREAL_CACHE_DIR=str(tmp_path))
    assert got == tmp_path / "r"
