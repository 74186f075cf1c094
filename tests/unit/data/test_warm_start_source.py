"""`model.warm_start_source`: the tiny model's warm start trains on other data than the run's
own (issue 44: `math_jsonl` / `code_jsonl` warm-started on their own file and began at a
reward of 0.88-0.97, showing no learning)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import areal.data.warm_start
from areal.config import ConfigError, load_settings
from areal.launch.worker import resolve_model_path

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "examples" / "data"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("AREAL_")]:
        monkeypatch.delenv(key)


@pytest.fixture
def warm_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    calls: list[tuple[str, dict]] = []

    def fake(spec: str, **kw) -> Path:
        calls.append((spec, kw["task_kwargs"]))
        return Path("/cached/warm")

    monkeypatch.setattr(areal.data.warm_start, "ensure_warm_model", fake)
    return calls


def test_the_warm_start_reads_its_own_source_with_the_runs_field_names(warm_calls):
    s = load_settings(
        None,
        [
            f"data.source={DATA / 'code.jsonl'}",
            "data.answer_field=test",
            f"model.warm_start_source={DATA / 'code_warm.jsonl'}",
        ],
    )
    assert resolve_model_path(s) == "/cached/warm"
    assert warm_calls == [
        (str(DATA / "code_warm.jsonl"), {"prompt_field": "prompt", "answer_field": "test"})
    ]


def test_unset_it_is_the_runs_source_with_its_task_options(warm_calls):
    s = load_settings(None, ["data.source=synthetic:arithmetic", "data.task_kwargs={ops: '+-'}"])
    resolve_model_path(s)
    assert warm_calls == [("synthetic:arithmetic", {"ops": "+-"})]


def test_a_missing_warm_start_file_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model.warm_start_source: dataset file .* not exist"):
        load_settings(None, ["model.warm_start_source=nope.jsonl"])


@pytest.mark.parametrize("name", ["math", "code"])
def test_the_examples_warm_start_data_holds_none_of_their_prompts(name):
    def prompts(path: Path) -> set[str]:
        return {json.loads(line)["prompt"] for line in path.read_text().splitlines()}

    own, warm = prompts(DATA / f"{name}.jsonl"), prompts(DATA / f"{name}_warm.jsonl")
    assert len(warm) >= 256 and not own & warm
