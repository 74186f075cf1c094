"""`areal eval` (`areal.launch.evaluate`): what it evaluates with (the run config, then the
command line), its one-line errors, the report's pass@k over its own per-item counts, and the
table. The check against a real run's in-run evaluation is `tests/e2e/test_eval.py`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from areal.algo.pass_at_k import mean_pass_at_k
from areal.cli import main
from areal.launch.evaluate import EvalRequest, eval_settings, format_report

ROOT = Path(__file__).resolve().parents[3]


def even_length(completion: str, answer: str) -> float:
    """A reward that some random completions earn and some do not (for pass@k)."""
    return float(len(completion) % 2 == 0)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A directory that looks like a model dir (enough for the checks before loading)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def test_settings_come_from_the_config_then_the_command_line(model_dir):
    s = eval_settings(
        EvalRequest(
            model_dir=str(model_dir),
            config=str(ROOT / "examples" / "math_jsonl.yaml"),
            data="examples/data/math.jsonl",
            reward="math",
            engine="torch",
            max_new_tokens=12,
            limit=3,
            overrides=("prompt.format=boxed",),
        )
    )
    assert s.model.path == str(model_dir)
    assert s.data.eval_source == "examples/data/math.jsonl" and s.data.eval_size == 3
    assert s.data.prompt_field == "prompt"  # the config's field mapping
    assert s.prompt.format == "boxed"  # --set of the run config
    assert s.reward_fn_name() == "math" and s.eval.max_new_tokens == 12
    assert s.eval.every_versions >= 1  # the eval plan is built


def test_the_config_held_out_set_is_kept_without_data(model_dir):
    s = eval_settings(
        EvalRequest(
            model_dir=str(model_dir),
            config=str(ROOT / "examples" / "arithmetic.yaml"),
            overrides=("data.eval_size=16",),
        )
    )
    assert s.data.eval_source is None and s.data.eval_size == 16
    assert s.data.source == "synthetic:arithmetic" and s.rollout.temperature == 1.5


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--data", "synthetic:arithmetic"], "is procedural: give --limit N"),
        ([], "the config holds out no items"),
        (["--split", "test"], "--split names the split of an hf: --data"),
        (["--data", "hf:/no/such/dir"], "data.eval_source: hf:/no/such/dir: no such folder"),
        (["--data", "x.jsonl", "--n", "2", "--k", "1,4"], "--k 4: each k must be in [1, --n 2]"),
    ],
)
def test_bad_input_is_one_line_naming_the_fix(model_dir, capsys, args, error):
    assert main(["eval", str(model_dir), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("areal eval: ") and error in err, err
    assert err.count("\n") == 1


def test_a_dir_without_a_model(tmp_path, capsys):
    assert main(["eval", str(tmp_path)]) == 2
    assert "is not a model directory (no config.json)" in capsys.readouterr().err


def test_the_table():
    report = {
        "model_dir": "runs/x/final",
        "held_out": "t.jsonl",
        "n_items": 4,
        "reward_fn": "math",
        "correct_at": 1.0,
        "engine": "torch",
        "max_new_tokens": 8,
        "greedy": {
            "accuracy": 0.5,
            "mean_reward": 0.5,
            "gen_len_mean": 3.0,
            "truncated_frac": 0.25,
            "errors": 0,
        },
        "sampled": {
            "n": 4,
            "temperature": 1.0,
            "pass@1": 0.375,
            "pass@4": 0.75,
            "mean_reward": 0.375,
            "gen_len_mean": 3.5,
            "truncated_frac": 0.0,
            "errors": 1,
        },
    }
    lines = format_report(report).splitlines()
    assert lines[0].startswith("areal eval runs/x/final: 4 items of t.jsonl; reward math")
    assert lines[2].split() == ["greedy", "accuracy", "0.5000", "0.5000", "3.0", "0.250", "0"]
    assert lines[3].split()[:5] == ["pass@1", "(n=4,", "T=1)", "0.3750", "0.3750"]
    assert lines[4].split() == ["pass@4", "(n=4,", "T=1)", "0.7500"]


@pytest.mark.slow  # loads a model, generates and scores in a process pool: ~10 s on 2 cores
@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs datasets")
def test_a_model_dir_on_an_hf_split(tmp_path, monkeypatch):
    from datasets import Dataset, DatasetDict

    from areal.data.tiny_model import build_tiny_model

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    model = build_tiny_model(tmp_path / "model", seed=1)
    questions = [f"{i}+{i}=" for i in range(6)]
    DatasetDict(
        {
            "train": Dataset.from_dict({"q": ["9+9="], "a": ["18"]}),
            "test": Dataset.from_dict({"q": questions, "a": [str(2 * i) for i in range(6)]}),
        }
    ).save_to_disk(str(tmp_path / "d"))
    out = tmp_path / "report.json"
    code = main(
        [
            "eval",
            str(model),
            "--data",
            f"hf:{tmp_path / 'd'}",
            "--set",
            "data.prompt_field=q",
            "--set",
            "data.answer_field=a",
            "--reward",
            "tests.unit.launch.test_evaluate:even_length",
            "--max-new-tokens",
            "5",
            "--n",
            "3",
            "--k",
            "1,2,3",
            "--temperature",
            "1.0",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    items = report["items"]
    # the test split, in its order, with its answers
    assert [it["prompt"] for it in items] == questions
    assert [it["answer"] for it in items] == [str(2 * i) for i in range(6)]
    assert report["held_out"].endswith("(split test)") and report["n_items"] == 6
    assert report["greedy"]["accuracy"] == sum(it["greedy_reward"] >= 1 for it in items) / 6
    for it in items:  # the scorer saw the decoded completion
        assert it["greedy_reward"] == even_length(it["greedy"], it["answer"])
    counts = [it["n_correct"] for it in items]
    for k in (1, 2, 3):
        assert report["sampled"][f"pass@{k}"] == pytest.approx(mean_pass_at_k(3, counts, k))
    assert report["sampled"]["pass@1"] == pytest.approx(report["sampled"]["mean_reward"])
