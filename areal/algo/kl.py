"""KL to a frozen reference policy (``algo.kl_coef``, ``algo.kl_estimator``), per token.

Samples come from the current policy, so with ``log_r = ref_logp - logp`` (Schulman 2020,
"Approximating KL Divergence", http://joschu.net/blog/kl-approx.html; the GRPO paper, Shao et
al. 2024, arXiv 2402.03300, eq. 4 uses k3):

    k1 = -log_r                  unbiased, can be negative per token
    k2 = log_r ** 2 / 2          biased, >= 0, low variance
    k3 = (exp(log_r) - 1) - log_r  unbiased, >= 0

The penalty ``kl_coef * kl_t`` is added to each loss token's loss and divided by the same
normaliser as the objective (``reduce_tokens``), so it adds up over micro-batches like the rest.

Invariants:
- ``logp == ref_logp`` on a token gives exactly 0 for every estimator (``log_r`` is exactly 0),
  so the KL of a policy to a reference loaded from the same weights is exactly 0 before the
  first update.
- Tokens outside the mask contribute nothing to the penalty, its gradient or ``kl_ref_sum``,
  even if they hold inf or NaN; only ``logp`` carries gradient.
"""

from __future__ import annotations

import torch

__all__ = ["KL_ESTIMATORS", "kl_per_token"]

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_per_token(
    logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """``[N]`` estimate of KL(current || reference) at each token, exactly 0 outside ``mask``."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {estimator!r}; choose one of {KL_ESTIMATORS}")
    m = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_r = torch.where(m, ref_logp.detach().to(logp.dtype) - logp, zero)  # [N], 0 outside
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    return torch.expm1(log_r) - log_r
