"""`bench/gpu_check.sh --dry-run`: every part's plumbing runs on the CPU (tiny model, few
tokens); the generation part interrupts samples with a reload and its log-probs match the
weights of the version that produced each token; a part without its engine or extra is a SKIP
that says why, never a silent pass."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"


def test_the_dry_run_passes_or_skips_each_part_with_a_reason(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [str(SCRIPT), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = {r["part"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"generate[torch]", "generate[vllm]", "fsdp", "deepspeed"}
    gen = results["generate[torch]"]
    assert gen["status"] == "PASS", gen
    assert gen["numbers"]["n_interrupts"] > 0 and gen["numbers"]["version"] == 1
    assert gen["numbers"]["logp_abs_err_max"] < 1e-3  # fp32 on the CPU: the same numbers
    assert results["generate[vllm]"]["status"] == "SKIP" and results["generate[vllm]"]["detail"]
    assert results["fsdp"]["status"] == "PASS"
    has_ds = importlib.util.find_spec("deepspeed") is not None
    assert results["deepspeed"]["status"] == ("PASS" if has_ds else "SKIP")
    for r in results.values():
        assert r["status"] != "SKIP" or "install" in r["detail"] or "GPU" in r["detail"]
        assert r["status"] != "PASS" or r["tokens_per_s"] > 0
    assert "| part | status | tokens/s | detail |" in proc.stdout
