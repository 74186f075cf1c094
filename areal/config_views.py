"""Per-role views of the run settings: each role's builder sees only the parts it reads.

A view is a frozen model taken from the resolved `RunSettings` (`View.of(settings)`), so a
role cannot read or change another role's knobs by accident, and a test can build a role from a
small view. The worker shell itself (NATS, logging, the model's cache) still reads the whole
settings.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from areal.config import (
    AlgoSettings,
    DataSettings,
    ModelSettings,
    RewardSettings,
    RolloutSettings,
    RunSettings,
    TrainSettings,
    WeightsSettings,
)

__all__ = ["ControllerView", "RewardView", "RolloutView", "TrainerView"]


class _View(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ControllerView(_View):
    run_id: str
    seed: int
    data: DataSettings
    algo: AlgoSettings
    total_steps: int

    @classmethod
    def of(cls, s: RunSettings) -> ControllerView:
        return cls(
            run_id=s.run_id, seed=s.seed, data=s.data, algo=s.algo, total_steps=s.train.total_steps
        )


class RolloutView(_View):
    seed: int
    model: ModelSettings
    rollout: RolloutSettings

    @classmethod
    def of(cls, s: RunSettings) -> RolloutView:
        return cls(seed=s.seed, model=s.model, rollout=s.rollout)


class RewardView(_View):
    fn: str  # resolved: the configured scorer or the data source's default
    reward: RewardSettings

    @classmethod
    def of(cls, s: RunSettings) -> RewardView:
        return cls(fn=s.reward_fn_name(), reward=s.reward)


class TrainerView(_View):
    seed: int
    out_dir: str
    model: ModelSettings
    weights: WeightsSettings
    algo: AlgoSettings
    train: TrainSettings
    temperature: float  # the rollout's sampling temperature (log-probs are taken under it)

    @classmethod
    def of(cls, s: RunSettings) -> TrainerView:
        return cls(
            seed=s.seed,
            out_dir=s.out_dir,
            model=s.model,
            weights=s.weights,
            algo=s.algo,
            train=s.train,
            temperature=s.rollout.temperature or 1.0,
        )

    @property
    def weights_dir(self) -> str | None:
        """Shared dir for `weights.transport: file`; None for the object store."""
        if self.weights.transport != "file":
            return None
        return self.weights.dir or f"{self.out_dir}/weights"
