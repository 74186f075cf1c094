"""Experiment trackers in a real run (`tracking: [tensorboard, wandb, mlflow]`): a 3-step run
of the quickstart writes TensorBoard event files, an offline W&B run and an MLflow run holding
every step record and eval round, read back with each tracker's own reader; trackers pointed at
a dead address warn once each and leave the run's outcome as it was."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("tensorboard", reason="needs the tracking extra: pip install '.[tracking]'")
pytest.importorskip("wandb", reason="needs the tracking extra: pip install '.[tracking]'")
pytest.importorskip("mlflow", reason="needs the tracking extra: pip install '.[tracking]'")

from tests.trackers import (  # noqa: E402
    mlflow_metric,
    mlflow_runs,
    tb_scalars,
    tb_tags,
    wandb_history,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
DEAD = "http://127.0.0.1:1"  # nothing listens on port 1


def run(out: Path, *sets: str, env: dict[str, str] | None = None) -> float:
    """`areal run` of the quickstart for STEPS steps; its wall time (s). Fails on a bad exit."""
    args = [sys.executable, "-m", "areal.cli", "run", "examples/arithmetic.yaml"]
    args += ["--out", str(out), "--quiet"]
    for kv in (f"train.total_steps={STEPS}", f"run_id=trk-{uuid.uuid4().hex[:8]}", *sets):
        args += ["--set", kv]
    base = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    base["NETRC"] = str(out.parent / "no-netrc")  # and no `wandb login`: W&B runs offline
    t0 = time.monotonic()
    res = subprocess.run(
        args,
        cwd=ROOT,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall_s = time.monotonic() - t0
    assert res.returncode == 0, res.stderr[-3000:]
    return wall_s


def outcome(out: Path) -> dict:
    """The run finished its steps with exact accounting; its summary."""
    summary = json.loads((out / "summary.json").read_text())
    B = json.loads((out / "config.json").read_text())["algo"]["batch_size"]
    assert summary["steps"] == STEPS and summary["trained"] == STEPS * B
    assert summary["in_flight"] == 0 and summary["dlq"] == 0
    return summary


def lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def trainer_events(out: Path, name: str) -> list[str]:
    return [ln for ln in (out / "logs" / "trainer-0.log").read_text().splitlines() if name in ln]


def test_a_run_logs_its_steps_evals_and_config_to_the_three_trackers(tmp_path: Path):
    out = tmp_path / "run"
    wall_s = run(
        out,
        "tracking=[tensorboard,wandb,mlflow]",  # short for tracking.backends=[...]
        "data.eval_size=4",
        "eval.every_versions=2",
    )
    outcome(out)
    steps = lines(out / "metrics.jsonl")
    evals = lines(out / "eval.jsonl") if (out / "eval.jsonl").exists() else []
    reward = [(r["step"], r["reward_mean"]) for r in steps]
    assert [s for s, _ in reward] == [1, 2, 3]

    # TensorBoard: <out>/tb, float32 scalars
    tb = tb_scalars(out / "tb", "train/reward_mean")
    assert [s for s, _ in tb] == [1, 2, 3]
    assert all(abs(v - want) < 1e-6 for (_, v), (_, want) in zip(tb, reward, strict=True))
    if evals:  # a round lands when its version's generation ends before the run does
        got = tb_scalars(out / "tb", "eval/reward")
        assert [s for s, _ in got] == [e["version"] for e in evals]
    assert "config/text_summary" in tb_tags(out / "tb")["tensors"]

    # W&B: offline (no API key), a run dir under <out>/wandb for `wandb sync`
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    rows = wandb_history(run_file)
    assert [(r["train/step"], r["train/reward_mean"]) for r in rows if "train/step" in r] == reward
    assert [r["eval/version"] for r in rows if "eval/version" in r] == [e["version"] for e in evals]

    # MLflow: a file store in <out>/mlruns, the run named after --out, the config as params
    (ml,) = mlflow_runs(out / "mlruns")
    assert ml.info.run_name == "run" and ml.info.status == "FINISHED"
    assert ml.data.params["algo.batch_size"] == "16"
    assert mlflow_metric(out / "mlruns", ml.info.run_id, "train/reward_mean") == reward

    assert not trainer_events(out, "tracker_failed")
    (closed,) = trainer_events(out, "tracking_closed")
    assert "dropped': 0" in closed and "dropped': 1" not in closed
    print(f"three trackers: {wall_s:.1f} s, {len(evals)} eval rounds")  # shown with -s


def test_trackers_at_a_dead_address_warn_once_and_the_run_goes_on(tmp_path: Path):
    out = tmp_path / "run"
    wall_s = run(
        out,
        "tracking.backends=[wandb,mlflow]",
        "tracking.wandb_mode=online",
        f"tracking.mlflow_uri={DEAD}",
        env={"WANDB_BASE_URL": DEAD, "WANDB_API_KEY": "x" * 40},
    )
    summary = outcome(out)
    assert [r["step"] for r in lines(out / "metrics.jsonl")] == [1, 2, 3]
    failed = trainer_events(out, "tracker_failed")
    assert len(failed) == 2, failed  # once per tracker
    for name, fix in (("wandb", "wandb_mode=offline"), ("mlflow", "tracking.mlflow_uri")):
        (line,) = [ln for ln in failed if re.search(rf"tracker=['\"]?{name}\b", ln)]
        assert fix in line and DEAD in line
    assert not trainer_events(out, "tracker_abandoned")  # closing waited for nobody
    assert not (out / "mlruns").exists() and not list((out / "wandb").glob("*run-*"))
    print(f"dead trackers: {wall_s:.1f} s, trainer wall {summary['wall_s']} s")
