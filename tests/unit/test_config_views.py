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
