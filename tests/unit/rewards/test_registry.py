"""Reward registry: built-ins, user `module:function` specs, clear errors, task defaults."""

from __future__ import annotations

import pickle

import pytest

from areal.rewards.registry import BUILTIN_REWARDS, default_reward_for, get_reward_fn


@pytest.mark.parametrize("name", ["arithmetic", "running_sum", "math", "code"])
def test_builtins_are_picklable_scorers(name):
    fn = get_reward_fn(name)
    assert fn is BUILTIN_REWARDS[name]
    assert pickle.loads(pickle.dumps(fn)) is fn  # reward workers use a process pool
    assert fn("no", "42") == 0.0


def test_user_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def exact(completion, answer):\n    return float(completion == answer)\n"
        "class Holder:\n    @staticmethod\n    def half(c, a):\n        return 0.5\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert get_reward_fn("my_rewards:exact")("a", "a") == 1.0
    assert get_reward_fn("my_rewards:Holder.half")("a", "b") == 0.5
    with pytest.raises(ValueError, match=r"'my_rewards:missing'.*no attribute"):
        get_reward_fn("my_rewards:missing")
    with pytest.raises(ValueError, match=r"'my_rewards:NOT_CALLABLE'.*not a callable"):
        get_reward_fn("my_rewards:NOT_CALLABLE")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("nope", "unknown reward function 'nope'.*module:function"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'.*PYTHONPATH"),
        (":f", "must look like"),
        ("os:", "must look like"),
    ],
)
def test_bad_specs_name_the_fix(spec, match):
    with pytest.raises(ValueError, match=match):
        get_reward_fn(spec)


@pytest.mark.parametrize(
    ("task", "reward"),
    [
        ("synthetic:arithmetic", "arithmetic"),
        ("synthetic:running_sum", "running_sum"),
        ("data/gsm8k.jsonl", "math"),
        ("/abs/train.parquet", "math"),
    ],
)
def test_default_reward_for(task, reward):
    assert default_reward_for(task) == reward


def test_default_reward_for_unknown_synthetic():
    with pytest.raises(ValueError, match="synthetic:nope"):
        default_reward_for("synthetic:nope")
