"""Advantages from the rewards of groups of G samples of one task (``algo.advantage``).

γ = λ = 1 and no critic, so a sample's advantage is one number broadcast to all its tokens
(by the caller). Every function here maps rewards ``[n_groups, G]`` to advantages of the same
shape (`areal.algo.registry` names them):

    grpo          (r - mean_group) / (std_group + eps)            Shao et al. 2024, 2402.03300
    dr_grpo       r - mean_group                                   Liu et al. 2025, 2503.20783
    rloo          r_i - mean_{j != i} r_j                          Ahmadian et al. 2024, 2402.14740
    reinforce_pp  whiten_batch(r - mean_group)                     Hu 2025, 2501.03262

Invariants:
- Output has the shape of the input ``[n_groups, G]`` and is always finite (no NaN, no inf).
- grpo, dr_grpo, rloo: a group whose rewards are all identical gets advantage exactly 0 for every
  sample: it carries no learning signal (``zero_adv_groups`` finds such groups for DAPO-style
  filtering); within a group the advantages sum to 0 (up to float rounding).
- With ``batch_norm`` (and reinforce_pp) the whole batch has mean 0 and (population) std 1,
  unless every advantage is 0, in which case all stay 0.
"""

from __future__ import annotations

import torch

__all__ = [
    "dr_grpo_advantages",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "zero_adv_groups",
]


def _check_2d(rewards: torch.Tensor) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, G], got shape {tuple(rewards.shape)}")


def zero_adv_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Bool ``[n_groups]``: True where every reward of the group is the same."""
    _check_2d(rewards)
    if rewards.shape[1] == 0:
        return torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    return (rewards == rewards[:, :1]).all(dim=1)


def grpo_advantages(
    rewards: torch.Tensor,
    *,
    norm_std: bool = True,
    batch_norm: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``algo.advantage: grpo`` (GRPO, Shao et al. 2024, DeepSeekMath, arXiv 2402.03300):
    ``adv = (r - mean_group) / (std_group + eps)``; optionally renormalised over the batch.

    ``rewards``: ``[n_groups, G]``. Returns float ``[n_groups, G]`` (float32 for integer input).
    The std is the population std (``unbiased=False``), as in GRPO implementations that treat
    the G samples as the whole group.
    """
    _check_2d(rewards)
    r = rewards if rewards.is_floating_point() else rewards.float()
    if r.numel() == 0:
        return r.clone()
    adv = r - r.mean(dim=1, keepdim=True)  # [n_groups, G]
    if norm_std:
        adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    # Identical rewards: force exact zeros (r - mean may leave a rounding residue that the
    # division by eps would blow up).
    adv = adv.masked_fill(zero_adv_groups(r).unsqueeze(1), 0.0)
    if batch_norm:
        adv = _whiten(adv, eps)
    return adv


def _whiten(adv: torch.Tensor, eps: float) -> torch.Tensor:
    """Batch mean 0 and (population) std 1; all zeros stay zeros."""
    centred = adv - adv.mean()
    std = adv.std(unbiased=False)
    return centred / (std + eps) if std > 0 else torch.zeros_like(adv)


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``algo.advantage: dr_grpo`` (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783): ``r -
    mean_group``, no division by the group std (which up-weights groups whose rewards barely
    differ: too easy or too hard questions). Pair it with ``algo.loss_norm: constant`` for the
    paper's whole fix."""
    return grpo_advantages(rewards, norm_std=False)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``algo.advantage: rloo`` (REINFORCE Leave-One-Out, Ahmadian et al. 2024, arXiv
    2402.14740; Kool et al. 2019): ``A_i = r_i - mean_{j != i} r_j``, the baseline of sample i
    being the mean of the other G - 1 of its group, so it does not depend on r_i (unbiased).
    Equal to ``G / (G - 1) * (r_i - mean_group)``. A group of one sample has no other sample
    to compare with: advantage 0."""
    _check_2d(rewards)
    r = rewards if rewards.is_floating_point() else rewards.float()
    g = r.shape[1]
    if r.numel() == 0 or g < 2:
        return torch.zeros_like(r)
    others_mean = (r.sum(dim=1, keepdim=True) - r) / (g - 1)  # [n_groups, G]
    adv = r - others_mean
    return adv.masked_fill(zero_adv_groups(r).unsqueeze(1), 0.0)


def reinforce_pp_advantages(rewards: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """``algo.advantage: reinforce_pp`` (REINFORCE++-baseline, Hu 2025, arXiv 2501.03262):
    the group mean as baseline (``r - mean_group``), then the whole batch whitened: ``(A -
    mean_batch A) / (std_batch A + eps)``, population std. The paper normalises globally instead
    of per group, which keeps the variance of groups with near-identical rewards from being
    blown up. Here every sample counts once in the batch statistics (the paper's token-level
    whitening would weigh a sample by its length: with one outcome reward per sample, a sample
    is the unit). Group-centred advantages have batch mean 0, so a group of identical rewards
    stays exactly 0; what changes against grpo is the scale, one std for the whole batch."""
    adv = grpo_advantages(rewards, norm_std=False)
    return adv if adv.numel() == 0 else _whiten(adv, eps)
