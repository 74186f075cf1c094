"""Behaviour importance weights: how far a stale token may pull the loss, and at what level.

Decoupled PPO multiplies each token's surrogate by ``w_t = exp(prox_logp_t - behav_logp_t)``
(AReaL eq. 5). The rule here decides what is compared with the bounds, what happens outside
them, and which weight the token then carries:

- ``level="token"``: ``w_t`` itself (AReaL; TIS / token-MIS, Yao et al. 2025, "Your efficient
  RL framework secretly brings you off-policy RL training");
- ``level="sequence"``: the sequence's product ``prod_t w_t`` over its loss tokens, the same for
  each of them (sequence-level IS; exact, and high-variance on long sequences);
- ``level="geometric"``: the sequence's geometric mean ``exp(mean_t log w_t)`` (the geo-mean
  sequence mask of the MIS line of work: length-independent, so one long answer is judged as a
  short one);
- ``mode="mask"``: a token (or every token of a sequence) whose weight lies outside
  ``[low, high]`` is dropped from the loss (MIS; AReaL's cap); ``mode="truncate"``: the weight is
  clamped into ``[low, high]`` and the token kept (TIS);
- ``m2po_tau``: M2PO (Zheng et al. 2025, arXiv 2510.01161): after the rule above, the tokens
  with the largest ``(log w_t)^2`` are dropped, fewest first, until the mean second moment of
  the kept tokens is at most ``tau`` (so a batch with a few very stale tokens keeps the rest).
  Within one call, i.e. one micro-batch.

Invariants:
- all tensors are flat ``[N]``; ``seq_ids`` numbers sequences 0..S-1, non-decreasing;
- only loss tokens (``mask``) are looked at: a token outside it has weight 1, is never dropped,
  and its inf / NaN changes nothing;
- the weights carry no gradient; bounds ``None`` are open; ``low < high`` when both are set;
- with ``prox == behav`` (fresh data) every weight is 1 and nothing is dropped unless a bound
  excludes 1 itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["BehavWeights", "Level", "Mode", "behav_weights", "m2po_drop"]

Level = Literal["token", "sequence", "geometric"]
Mode = Literal["mask", "truncate"]


@dataclass(frozen=True)
class BehavWeights:
    weight: torch.Tensor  # [N] float, the weight each kept token's surrogate is multiplied by
    dropped: torch.Tensor  # [N] bool, loss tokens the rule took out of the loss


def _per_sequence(
    log_w: torch.Tensor, m: torch.Tensor, seq_ids: torch.Tensor, *, mean: bool
) -> torch.Tensor:
    """Each token's sequence total (or mean over its loss tokens) of ``log_w``: ``[N]``."""
    if log_w.numel() == 0:
        return log_w
    n_seq = int(seq_ids.max().item()) + 1
    total = torch.zeros(n_seq, dtype=log_w.dtype, device=log_w.device)
    total.index_add_(0, seq_ids, torch.where(m, log_w, torch.zeros_like(log_w)))
    if mean:
        count = torch.zeros(n_seq, dtype=log_w.dtype, device=log_w.device)
        count.index_add_(0, seq_ids, m.to(log_w.dtype))
        total = total / count.clamp(min=1.0)
    return total[seq_ids]


def m2po_drop(log_w: torch.Tensor, candidates: torch.Tensor, tau: float) -> torch.Tensor:
    """``[N]`` bool: the fewest of ``candidates`` to drop, largest ``log_w^2`` first, so that
    the mean of ``log_w^2`` over the candidates kept is <= ``tau`` (none when it already is)."""
    second = torch.where(candidates, log_w * log_w, torch.zeros_like(log_w))
    n = int(candidates.sum().item())
    if n == 0 or float(second.sum()) <= tau * n:
        return torch.zeros_like(candidates)
    order = torch.argsort(second, descending=True)  # candidates' largest first (others are 0)
    sorted_m2 = second[order][:n]
    # after dropping the k largest: (total - sum of k largest) / (n - k) <= tau
    kept_sum = sorted_m2.sum() - torch.cumsum(sorted_m2, 0)  # [n], sum kept after dropping k+1
    kept_n = torch.arange(n - 1, -1, -1, dtype=log_w.dtype, device=log_w.device)  # n - (k + 1)
    ok = kept_sum <= tau * kept_n
    k = int(torch.nonzero(ok)[0].item()) + 1  # the last one (kept_n 0) always holds
    drop = torch.zeros_like(candidates)
    drop[order[:k]] = True
    return drop


def behav_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    *,
    level: Level = "token",
    mode: Mode = "mask",
    low: float | None = None,
    high: float | None = 5.0,
    m2po_tau: float | None = None,
) -> BehavWeights:
    """The weights and dropped tokens of the module docstring's rule."""
    if low is not None and high is not None and not low < high:
        raise ValueError(f"behaviour-weight bounds need low < high, got [{low}, {high}]")
    m = mask.bool()
    zero = torch.zeros((), dtype=prox_logp.dtype, device=prox_logp.device)
    log_w = torch.where(m, prox_logp.detach() - behav_logp.detach(), zero)  # [N], 0 outside
    if level == "token":
        judged = log_w
    elif level in ("sequence", "geometric"):
        judged = _per_sequence(log_w, m, seq_ids, mean=level == "geometric")
    else:
        raise ValueError(f"unknown behaviour-weight level {level!r}: token, sequence, geometric")
    w = torch.exp(judged)  # [N]
    outside = torch.zeros_like(m)
    if low is not None:
        outside |= w < low
    if high is not None:
        outside |= w > high
    outside &= m
    if mode == "mask":
        dropped = outside
    elif mode == "truncate":
        dropped = torch.zeros_like(m)
        if low is not None or high is not None:
            w = w.clamp(min=low, max=high)
    else:
        raise ValueError(f"unknown behaviour-weight mode {mode!r}: mask or truncate")
    if m2po_tau is not None:
        dropped = dropped | m2po_drop(log_w, m & ~dropped, m2po_tau)
    weight = torch.where(m & ~dropped, w, torch.ones_like(w))
    return BehavWeights(weight=weight, dropped=dropped)
