"""Per-role settings views: each role sees exactly its parts of the resolved settings."""

from __future__ import annotations

import pydantic
import pytest

from areal.config import load_settings
from areal.config_views import ControllerView, RewardView, RolloutView, TrainerView


def settings(*sets: str):
    return load_settings(None, ["run_id=view-test", "algo.batch_size=3", *sets])


def test_views_carry_their_roles_parts() -> None:
    s = settings("train.total_steps=7", "rollout.temperature=1.5", "reward.timeout_s=2.5")
    ctrl = ControllerView.of(s)
    assert (ctrl.run_id, ctrl.algo.batch_size, ctrl.total_steps) == ("view-test", 3, 7)
    assert RolloutView.of(s).rollout.temperature == 1.5
    reward = RewardView.of(s)
    assert reward.fn == "arithmetic"  # the synthetic:arithmetic source's default scorer
    assert reward.reward.timeout_s == 2.5
    trainer = TrainerView.of(s)
    assert (trainer.train.total_steps, trainer.temperature) == (7, 1.5)
    assert not hasattr(trainer, "rollout") and not hasattr(ctrl, "train")  # only their parts


def test_trainer_view_weights_dir_and_greedy_temperature() -> None:
    assert TrainerView.of(settings()).weights_dir is None  # object store
    s = settings("weights.transport=file", "out_dir=/tmp/o", "rollout.temperature=0")
    view = TrainerView.of(s)
    assert view.weights_dir == "/tmp/o/weights"
    assert view.temperature == 1.0  # greedy rollout: log-probs are taken at T = 1


def test_views_are_frozen() -> None:
    view = RolloutView.of(settings())
    with pytest.raises(pydantic.ValidationError):
        view.seed = 3  # type: ignore[misc]


def test_role_policies_carry_every_knob_from_the_settings() -> None:
    """Each role's policy is filled by name from its view: a knob set away from its default in
    the config reaches the object that reads it (no builder copies fields by hand)."""
    from workers.controller import admission_policy
    from workers.rollout import scheduler_policy
    from workers.trainer import trainer_options

    s = settings(
        "algo.group_size=5",
        "algo.max_staleness=3",
        "algo.filter_zero_adv_groups=true",
        "algo.straggler_wait_s=7.5",
        "algo.advantage=rloo",
        "train.total_steps=11",
        "train.max_tokens_per_mb=999",
        "train.checkpoint_every=4",
        "train.storage_pause_max_s=12",
        "rollout.interruptible=false",
        "rollout.interrupt_min_interval_s=0.25",
        "rollout.needed_first=true",
        "rollout.overlong=mask",
        "weights.transport=file",
        "out_dir=/tmp/o",
        "eval.every_versions=2",
        "data.eval_size=4",
    )
    adm = admission_policy(ControllerView.of(s))
    assert (adm.batch_size, adm.max_staleness, adm.total_steps) == (3, 3, 11)
    sched = scheduler_policy(RolloutView.of(s))
    assert (sched.interruptible, sched.interrupt_min_interval_s) == (False, 0.25)
    assert (sched.needed_first, sched.max_staleness) == (True, 3)
    opts = trainer_options(TrainerView.of(s))
    i = opts.intake
    assert (i.batch_size, i.group_size, i.max_staleness) == (3, 5, 3)
    assert (i.filter_zero_adv_groups, i.straggler_wait_s) == (True, 7.5)
    assert (opts.total_steps, opts.max_tokens_per_mb, opts.checkpoint_every) == (11, 999, 4)
    assert opts.storage_pause_max_s == 12
    assert (opts.mask_overlong, opts.weights_dir, opts.eval_every_versions) == (
        True,
        "/tmp/o/weights",
        2,
    )
    assert opts.advantage.__name__ == "rloo_advantages"


def test_fields_from_names_a_knob_no_source_has() -> None:
    import dataclasses

    from areal.config_views import fields_from

    @dataclasses.dataclass(frozen=True)
    class Policy:
        batch_size: int
        renamed_knob: float = 1.0

    algo = settings().algo
    with pytest.raises(TypeError, match=r"Policy\.renamed_knob: not given .* AlgoSettings"):
        fields_from(Policy, algo)
    assert fields_from(Policy, algo, renamed_knob=2.0) == Policy(3, 2.0)
    with pytest.raises(TypeError, match="no field typo"):
        fields_from(Policy, algo, renamed_knob=2.0, typo=1)
