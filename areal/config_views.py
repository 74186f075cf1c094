"""Per-role views of the run settings: each role's builder sees only the parts it reads.

A view is a frozen model taken from the resolved `RunSettings` (`View.of(settings)`), so a
role cannot read or change another role's knobs by accident, and a test can build a role from a
small view. The worker shell itself (NATS, logging, the model's cache) still reads the whole
settings.

A role's plain policy object (`IntakePolicy`, `SchedulerPolicy`, `AdmissionPolicy`,
`TrainerOptions`) is filled by `fields_from`: each of its fields is taken by name from the
settings parts it reads, so a new knob is declared where it is set and where it is read, and no
builder copies it field by field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from areal.config import (
    AlgoSettings,
    DataSettings,
    EvalSettings,
    ModelSettings,
    PromptSettings,
    RewardSettings,
    RolloutSettings,
    RunSettings,
    TrainSettings,
    WeightsSettings,
)

__all__ = ["ControllerView", "RewardView", "RolloutView", "TrainerView", "fields_from"]

T = TypeVar("T")


def fields_from(cls: type[T], *sources: object, **given: Any) -> T:
    """The dataclass `cls` with every field not in `given` taken, by name, from the first of
    `sources` that has an attribute of that name. A field found nowhere is a `TypeError` naming
    it and the sources, even when the field has a default: a knob renamed on one side fails at
    the role's start, not silently as its default."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in given:
            values[f.name] = given.pop(f.name)
            continue
        src = next((s for s in sources if hasattr(s, f.name)), None)
        if src is None:
            names = ", ".join(type(s).__name__ for s in sources) or "no source"
            raise TypeError(f"{cls.__name__}.{f.name}: not given and not a field of {names}")
        values[f.name] = getattr(src, f.name)
    if given:
        raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(given))}")
    return cls(**values)


class _View(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ControllerView(_View):
    run_id: str
    seed: int
    data: DataSettings
    prompt: PromptSettings
    algo: AlgoSettings
    total_steps: int

    @classmethod
    def of(cls, s: RunSettings) -> ControllerView:
        return cls(
            run_id=s.run_id,
            seed=s.seed,
            data=s.data,
            prompt=s.prompt,
            algo=s.algo,
            total_steps=s.train.total_steps,
        )


class RolloutView(_View):
    seed: int
    model: ModelSettings
    rollout: RolloutSettings
    prompt: PromptSettings  # stop strings; eval prompts are rendered as the controller does
    data: DataSettings  # the held-out set
    eval: EvalSettings
    reward_fn: str  # eval rounds are scored by the run's reward function...
    reward_timeout_s: float  # ...with its per-sample timeout
    group_size: int  # G: a task must ask for this many samples
    max_staleness: int  # η: which admitted batch is the trainer's next (the scheduler)

    @classmethod
    def of(cls, s: RunSettings) -> RolloutView:
        return cls(
            group_size=s.algo.group_size,
            max_staleness=s.algo.max_staleness,
            seed=s.seed,
            model=s.model,
            rollout=s.rollout,
            prompt=s.prompt,
            data=s.data,
            eval=s.eval,
            reward_fn=s.reward_fn_name(),
            reward_timeout_s=s.reward.timeout_s,
        )


class RewardView(_View):
    fn: str  # resolved: the configured scorer or the data source's default
    reward: RewardSettings
    rollout: RolloutSettings  # max_new_tokens and the overlong policy shape the reward
    score_range: tuple[float, float]  # what the scorer may return
    group_size: int  # G: what a sample's group must be

    @classmethod
    def of(cls, s: RunSettings) -> RewardView:
        return cls(
            fn=s.reward_fn_name(),
            reward=s.reward,
            rollout=s.rollout,
            score_range=s.score_range(),
            group_size=s.algo.group_size,
        )


def trainer_algo(s: RunSettings) -> AlgoSettings:
    """`algo` as the trainer reads it: `loss_norm_tokens` resolved (the generation budget,
    `rollout.max_new_tokens * rollout.max_turns`, when unset)."""
    if s.algo.loss_norm_tokens is not None:
        return s.algo
    budget = s.rollout.max_new_tokens * s.rollout.max_turns
    return s.algo.model_copy(update={"loss_norm_tokens": budget})


class TrainerView(_View):
    seed: int
    out_dir: str
    model: ModelSettings
    weights: WeightsSettings
    algo: AlgoSettings
    train: TrainSettings
    temperature: float  # the rollout's sampling temperature (log-probs are taken under it)
    mask_overlong: bool  # rollout.overlong == "mask": cut samples are kept out of the loss
    sample_limits: dict[str, int]  # what a sample may hold (`RolloutSettings.sample_limits`)
    reward_range: tuple[float, float]  # what a published reward may be
    eval: EvalSettings  # the round on the final weights the run's end waits for

    @classmethod
    def of(cls, s: RunSettings) -> TrainerView:
        return cls(
            sample_limits=s.rollout.sample_limits(),
            reward_range=s.reward_range(),
            eval=s.eval,
            seed=s.seed,
            out_dir=s.out_dir,
            model=s.model,
            weights=s.weights,
            algo=trainer_algo(s),
            train=s.train,
            temperature=s.rollout.temperature or 1.0,
            mask_overlong=s.rollout.overlong == "mask",
        )

    @property
    def weights_dir(self) -> str | None:
        """Shared dir for `weights.transport: file`; None for the object store."""
        return self.weights.file_dir(self.out_dir)
