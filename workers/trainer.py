"""Trainer replica (one per run): decoupled-PPO steps, weights publishing, checkpoints.

Under torchrun or `areal run` with `train.nproc` > 1 it is a group of ranks: rank 0 is this
worker, the other ranks `follow` it (`areal.launch.ranks`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal.bus.client import Bus
from areal.config import RunSettings
from areal.config_views import TrainerView, fields_from
from areal.launch.worker import RoleSpec, resolve_model_path
from areal.launch.worker import main as worker_main

if TYPE_CHECKING:  # heavy: imported inside build() at run time
    from areal.launch.ranks import RankZeroService
    from areal.services.trainer import TrainerOptions, TrainerService


@dataclass(frozen=True)
class TrainerParts:
    view: TrainerView
    engine: Any  # areal.engines.base.TrainEngine (a RankZeroEngine on a group's rank 0)
    grouped: bool = False  # rank 0 of a group of trainer ranks (`areal.launch.ranks`)
    tracker: Any = None  # areal.tracking.Tracker (`tracking`), started by prepare; None: none


def make_engine(settings: RunSettings) -> Any:
    """The training engine of `settings` (every rank of a group builds the same one)."""
    import torch

    from areal.engines.base import TrainEngineConfig
    from areal.engines.config import LoraSpec
    from areal.engines.factory import make_train_engine

    view = TrainerView.of(settings)
    a, t = view.algo, view.train
    torch.set_num_threads(t.torch_threads)
    torch.manual_seed(view.seed)
    return make_train_engine(
        TrainEngineConfig(
            kind=t.engine,
            model_path=resolve_model_path(settings),
            lr=t.lr,
            weight_decay=t.weight_decay,
            grad_clip=t.grad_clip,
            loss_cfg=a,  # the objective reads the algo settings as they are
            temperature=view.temperature,
            n_minibatches=t.n_minibatches,
            prox_logp=a.prox_logp,
            device=view.model.device,
            dtype=view.model.dtype,
            seed=view.seed,
            packing=t.packing,
            fixed_mb_size=t.fixed_mb_size,
            share_prompts=t.share_prompts,
            gradient_checkpointing=t.gradient_checkpointing,
            zero_stage=t.zero_stage,
            activation_offload=t.activation_offload,
            lora=None if t.lora is None else LoraSpec(**t.lora.model_dump()),
        )
    )


def prepare(settings: RunSettings, worker_id: str) -> TrainerParts:
    """Rank 0 (the only rank that gets here): join the rank group first, when there is one,
    then build the engine (`areal.launch.ranks`). The experiment trackers start first, on
    threads of their own: their imports and connections overlap the model's load, not the
    first training steps."""
    from pathlib import Path

    from areal.launch.ranks import join_rank_group, lead_rank_group
    from areal.tracking import tracker_for

    tracker = tracker_for(
        settings.tracking, out_dir=Path(settings.out_dir), config=settings.model_dump(mode="json")
    )
    if tracker is not None:
        tracker.start()
    world_size = join_rank_group(settings)
    engine = lead_rank_group(make_engine(settings), settings, world_size)
    if settings.train.record_batches:
        from areal.engines.record import BatchRecorder

        engine = BatchRecorder(engine, Path(settings.out_dir) / "batches")
    return TrainerParts(TrainerView.of(settings), engine, grouped=world_size > 1, tracker=tracker)


def follow(settings: RunSettings, worker_id: str) -> int:
    """A rank > 0: follow rank 0's engine calls, never touching the bus."""
    from areal.launch.ranks import follow_main

    return follow_main(settings, worker_id, make_engine)


def trainer_options(view: TrainerView, bounds: Any = None) -> TrainerOptions:
    """The trainer service's knobs: the intake's (`algo.batch_size`, `.group_size`,
    `.max_staleness`, `.filter_zero_adv_groups`, `.straggler_wait_s`) and the train, weights and
    eval settings it reads."""
    from areal.algo.registry import resolve_advantage
    from areal.core.intake import IntakePolicy
    from areal.services.trainer import TrainerOptions

    return fields_from(
        TrainerOptions,
        view.train,  # total_steps, max_tokens_per_mb, checkpoint_every, storage_pause_max_s
        view,  # mask_overlong, weights_dir
        intake=fields_from(IntakePolicy, view.algo),
        advantage=resolve_advantage(view.algo.advantage),
        weights_dtype=view.model.dtype,
        wire_dtype=view.weights.wire_dtype,
        overlap_publish_max_bytes=int(view.weights.overlap_max_mib * 2**20),
        eval_every_versions=view.eval.every_versions,
        final_eval_wait_s=view.eval.final_wait_s,
        bounds=bounds,
    )


def build(parts: TrainerParts, bus: Bus) -> TrainerService | RankZeroService:
    from pathlib import Path

    from areal.core.validate import Bounds
    from areal.services.trainer import TrainerService

    v = parts.view
    opts = trainer_options(
        v,
        Bounds.with_model(
            parts.engine,
            run_id=bus.names.run_id,
            group_size=v.algo.group_size,
            **v.sample_limits,
            reward_range=v.reward_range,
        ),
    )
    service = TrainerService(bus, parts.engine, opts, Path(v.out_dir), parts.tracker)
    if parts.grouped:
        from areal.launch.ranks import RankZeroService

        return RankZeroService(service, parts.engine)
    return service


SPEC = RoleSpec("trainer", prepare, build, follow=follow)


def main(argv: list[str] | None = None) -> int:
    return worker_main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())
