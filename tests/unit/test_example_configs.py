"""Every example config validates, the GPU ones included (those cannot run here: no GPU).

`model.path` and a data file that the example expects the user to provide are replaced by
stand-ins: a dir with a config.json, and a JSONL file with the fields the example maps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from areal.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(ROOT)) for p in EXAMPLES])
def test_example_config_validates(path: Path, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the examples name their files from the repository root
    raw = yaml.safe_load(path.read_text())
    sets = []
    if raw.get("model", {}).get("path"):
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text("{}")
        sets.append(f"model.path={model}")
    data = raw.get("data", {})
    source = data.get("source", "")
    if source.endswith(".jsonl") and not (ROOT / source).is_file():
        rows = [
            {data.get("prompt_field", "prompt"): "1+1?", data.get("answer_field", "answer"): "2"}
        ] * 300
        (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        sets.append(f"data.source={tmp_path / 'data.jsonl'}")
    s = load_settings(path, sets)
    assert s.run_id == raw["run_id"]
    if s.eval.every_versions:
        assert s.data.eval_size or s.data.eval_source


def test_the_gpu_example_is_the_paper_scale_setting():
    s = yaml.safe_load((ROOT / "examples/gpu/qwen2.5-1.5b-math.yaml").read_text())
    assert s["rollout"]["engine"] == "vllm" and s["train"]["engine"] == "deepspeed"
    assert s["rollout"]["max_new_tokens"] >= 4096 and s["prompt"]["format"] == "think"
