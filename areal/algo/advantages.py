"""GRPO advantages: rewards normalised within each group of G samples of one task.

γ = λ = 1 and no critic, so a sample's advantage is one number broadcast to all its tokens
(by the caller).

Invariants:
- Output has the shape of the input ``[n_groups, G]`` and is always finite (no NaN, no inf).
- A group whose rewards are all identical gets advantage exactly 0 for every sample: it carries
  no learning signal (``zero_adv_groups`` finds such groups for DAPO-style filtering).
- Within a group with distinct rewards the advantages sum to 0 (up to float rounding).
- With ``batch_norm`` the whole batch has mean 0 and (population) std 1, unless every advantage
  is 0, in which case all stay 0.
"""

from __future__ import annotations

import torch

__all__ = ["grpo_advantages", "zero_adv_groups"]


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
    """``adv = (r - mean_group) / (std_group + eps)``; optionally renormalised over the batch.

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
        centred = adv - adv.mean()
        std = adv.std(unbiased=False)
        adv = centred / (std + eps) if std > 0 else torch.zeros_like(adv)
    return adv
