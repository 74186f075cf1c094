"""From a picked batch of groups to the engine's `TrainSeq`s, with their advantages
(`algo.advantage`, GRPO by default)."""

from __future__ import annotations

import numpy as np
import torch

from areal.algo.advantages import grpo_advantages
from areal.algo.registry import AdvantageFn, compute_advantages
from areal.bus.client import Lease
from areal.bus.codec import unpack
from areal.core.intake import Group, loss_mask, token_versions
from areal.engines.base import TrainSeq


def to_train_seqs(
    batch: list[Group[Lease]],
    rewards: list[list[float]],
    *,
    advantage: AdvantageFn = grpo_advantages,
    mask_truncated: bool = False,
) -> list[TrainSeq]:
    """One `TrainSeq` per sample, groups in batch order and samples in index order;
    `rewards` is `[B][G]` in the same order (`Intake.rewards`); `advantage` maps them to
    advantages `[B, G]` (`areal.algo.registry`).

    `mask_truncated` (`rollout.overlong: mask`, DAPO's overlong filtering): a sample cut at
    `max_new_tokens` keeps its reward in its group's baseline but gets advantage 0, so its tokens
    add no gradient (they still count in the token normaliser).

    A multi-turn sample's environment tokens (`Sample.loss_mask` 0) get loss mask False: no
    gradient, and not counted in the token normaliser."""
    adv = compute_advantages(advantage, torch.tensor(rewards, dtype=torch.float32))  # [B, G]
    seqs: list[TrainSeq] = []
    for gi, group in enumerate(batch):
        for si, scored in enumerate(group.ordered()):
            s = scored.sample
            mask = loss_mask(scored)
            seqs.append(
                TrainSeq(
                    prompt_ids=torch.from_numpy(unpack(s.prompt_ids).astype(np.int64)),
                    output_ids=torch.from_numpy(unpack(s.output_ids).astype(np.int64)),
                    behav_logp=torch.from_numpy(unpack(s.behav_logp).copy()),
                    versions=torch.from_numpy(token_versions(scored)),
                    loss_mask=None if mask is None else torch.from_numpy(mask),
                    adv=0.0
                    if mask_truncated and s.finish_reason == "length"
                    else float(adv[gi, si]),
                )
            )
    return seqs
