"""From scored groups to `TrainSeq`s: the loss mask of an episode goes with its tokens."""

from __future__ import annotations

import torch

from areal.bus.codec import pack
from areal.core.intake import Group
from areal.services.batches import to_train_seqs
from schemas import ScoredSample
from tests.factories import make_sample


def test_an_episodes_mask_reaches_the_train_seq_and_single_turn_has_none():
    episode = make_sample(
        5,
        sample_idx=0,
        group_size=2,
        versions=pack([2, 2, -1, -1, 3], "int32"),
        behav_logp=pack([-0.5, -1.0, 0.0, 0.0, -2.0], "float32"),
        loss_mask=pack([1, 1, 0, 0, 1], "uint8"),
        finish_reason="length",
    )
    single = make_sample(3, sample_idx=1, group_size=2)
    group: Group[None] = Group(task_id="run-t3", task_seq=3)
    group.samples = {
        0: ScoredSample(sample=episode, reward=1.0),
        1: ScoredSample(sample=single, reward=0.0),
    }
    ep, st = to_train_seqs([group], [[1.0, 0.0]])  # GRPO (the default)
    assert ep.loss_mask is not None and ep.loss_mask.dtype == torch.bool
    assert ep.loss_mask.tolist() == [True, True, False, False, True]
    assert ep.versions.tolist() == [2, 2, -1, -1, 3]
    assert (ep.n_loss_tokens(), st.n_loss_tokens()) == (3, 3)
    assert st.loss_mask is None
    assert ep.adv > 0 > st.adv
    # overlong masking still zeroes a cut sample's advantage, mask or not
    cut, _ = to_train_seqs([group], [[1.0, 0.0]], mask_truncated=True)
    assert cut.adv == 0.0 and cut.loss_mask is not None


def test_the_advantage_estimator_is_the_one_given():
    # RLOO on [1, 0]: 1 - 0 = 1 and 0 - 1 = -1 (GRPO would give 1 / (0.5 + 1e-6))
    from areal.algo.advantages import rloo_advantages

    group: Group[None] = Group(task_id="run-t4", task_seq=4)
    group.samples = {
        i: ScoredSample(sample=make_sample(3, sample_idx=i, group_size=2), reward=r)
        for i, r in enumerate([1.0, 0.0])
    }
    a, b = to_train_seqs([group], [[1.0, 0.0]], advantage=rloo_advantages)
    assert (a.adv, b.adv) == (1.0, -1.0)
