"""The algorithm settings: registry names checked at load, the old advantage flags migrated or
refused in one line, `loss_norm_tokens` resolved for the trainer, user functions checked before
anything starts."""

from __future__ import annotations

import os

import pytest

from areal.config import ConfigError, load_settings
from areal.config_views import TrainerView
from areal.launch.preflight import check_algo, check_role


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("AREAL_"):
            monkeypatch.delenv(key)


def one_line_error(*sets: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_settings(None, list(sets))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config error: "), msg
    return msg


def test_defaults_are_todays_objective() -> None:
    a = load_settings(None, []).algo
    assert (a.loss, a.loss_norm, a.advantage) == ("ppo", "token", "grpo")
    assert (a.gspo_eps_clip_low, a.gspo_eps_clip_high) == (3e-4, 4e-4)
    assert (a.kl_coef, a.kl_estimator) == (0.0, "k3")  # off: no reference model


@pytest.mark.parametrize(
    ("sets", "fix"),
    [
        (["algo.adv_norm_std=false"], "set algo.advantage: dr_grpo and remove them"),
        (
            ["algo.adv_norm_std=false", "algo.adv_batch_norm=true"],
            "set algo.advantage: reinforce_pp",
        ),
        (["algo.adv_batch_norm=true"], "use algo.advantage: reinforce_pp"),
        (["algo.adv_norm_std=true", "algo.advantage=rloo"], "set algo.advantage: grpo"),
    ],
)
def test_the_old_advantage_flags_name_their_replacement(sets, fix) -> None:
    msg = one_line_error(*sets)
    assert "were replaced by algo.advantage" in msg and fix in msg


def test_old_flags_that_agree_with_advantage_still_load() -> None:
    # an old run's config.json holds both at their defaults: the same as advantage grpo
    s = load_settings(None, ["algo.adv_norm_std=true", "algo.adv_batch_norm=false"])
    assert s.algo.advantage == "grpo" and "adv_norm_std" not in s.algo.model_dump()
    s = load_settings(None, ["algo.adv_norm_std=false", "algo.advantage=dr_grpo"])
    assert s.algo.advantage == "dr_grpo"


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (["algo.loss=grpo"], "algo.loss='grpo': use one of ppo, gspo, or 'pkg.module:function'"),
        (["algo.advantage=gae"], "algo.advantage='gae': use one of grpo, dr_grpo, rloo"),
        (["algo.loss_norm=tokens"], "algo.loss_norm: Input should be"),
        (["algo.gspo_eps_clip_low=0"], "algo.gspo_eps_clip_low"),
        (["algo.kl_estimator=k4"], "algo.kl_estimator: Input should be"),
    ],
)
def test_bad_names_fail_at_load(sets, line) -> None:
    assert line in one_line_error(*sets)


def test_kl_loads_with_every_engine() -> None:
    for engine in ("torch", "fsdp", "deepspeed"):
        s = load_settings(None, ["algo.kl_coef=0.1", f"train.engine={engine}"])
        assert s.algo.kl_coef == 0.1


def test_the_trainer_sees_the_constant_resolved_to_the_generation_budget() -> None:
    s = load_settings(None, ["algo.loss_norm=constant", "rollout.max_new_tokens=24"])
    assert s.algo.loss_norm_tokens is None
    assert TrainerView.of(s).algo.loss_norm_tokens == 24  # max_new_tokens * max_turns (1)
    s = load_settings(None, ["algo.loss_norm=constant", "algo.loss_norm_tokens=100"])
    assert TrainerView.of(s).algo.loss_norm_tokens == 100


def test_a_user_function_that_does_not_exist_fails_before_start(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_cfg_loss.py").write_text("def loss(inp, cfg):\n    return inp.logp.sum()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_algo(load_settings(None, ["algo.loss=my_cfg_loss:loss"]))  # exists: fine
    for sets, line in [
        (
            ["algo.loss=my_cfg_loss:nope"],
            "algo.loss='my_cfg_loss:nope': module 'my_cfg_loss' has no attribute 'nope'",
        ),
        (
            ["algo.advantage=no_such_pkg_q.mod:fn"],
            "algo.advantage='no_such_pkg_q.mod:fn': cannot import module",
        ),
    ]:
        s = load_settings(None, sets)
        with pytest.raises(ConfigError) as e:
            check_role("trainer", s)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"config error: {line}"), msg
