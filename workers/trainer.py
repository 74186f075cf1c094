"""Trainer replica (one per run): decoupled-PPO steps, weights publishing, checkpoints."""

from __future__ import annotations

import sys

from areal.launch.worker import main as worker_main
from areal.launch.worker import resolve_model_path


async def build(settings, bus, worker_id):
    import torch

    from areal.algo.loss import PPOLossConfig
    from areal.engines.factory import make_train_engine
    from areal.services.trainer import TrainerOptions, TrainerService

    a, t = settings.algo, settings.train
    torch.set_num_threads(t.torch_threads)
    torch.manual_seed(settings.seed)
    loss_cfg = PPOLossConfig(
        eps_clip_low=a.eps_clip_low,
        eps_clip_high=a.eps_clip_high,
        behav_imp_weight_cap=a.behav_imp_weight_cap,
        decoupled=a.decoupled,
    )
    engine = make_train_engine(
        t.engine,
        model_path=resolve_model_path(settings),
        lr=t.lr,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        loss_cfg=loss_cfg,
        temperature=settings.rollout.temperature or 1.0,
        n_minibatches=t.n_minibatches,
        prox_logp=a.prox_logp,
        device=settings.model.device,
        dtype=settings.model.dtype,
        seed=settings.seed,
        packing=t.packing,
        fixed_mb_size=t.fixed_mb_size,
    )
    opts = TrainerOptions(
        batch_size=a.batch_size,
        group_size=a.group_size,
        max_staleness=a.max_staleness,
        total_steps=t.total_steps,
        max_tokens_per_mb=t.max_tokens_per_mb,
        checkpoint_every=t.checkpoint_every,
        adv_norm_std=a.adv_norm_std,
        adv_batch_norm=a.adv_batch_norm,
        filter_zero_adv_groups=a.filter_zero_adv_groups,
        weights_dtype=settings.model.dtype,
        weights_dir=(settings.weights.dir or f"{settings.out_dir}/weights")
        if settings.weights.transport == "file"
        else None,
    )
    svc = TrainerService(bus, engine, opts, settings.out_dir)
    return svc.run


def main(argv: list[str] | None = None) -> int:
    return worker_main("trainer", build, argv)


if __name__ == "__main__":
    sys.exit(main())
