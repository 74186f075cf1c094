"""Decoupled PPO loss (AReaL eq. 5) and its statistics.

Per token t of a sample with advantage A (DESIGN section 5):

    ratio_t = u_t = exp(logp - prox_logp)        # ratio to the proximal policy, carries grad
    w_t           = exp(prox_logp - behav_logp)  # behaviour importance weight, no grad
    pg_loss_t     = -w_t * min(u_t * A, clip(u_t, 1 - eps_clip_low, 1 + eps_clip_high) * A)

With ``decoupled=False`` it is standard PPO with ``logp_old = behav_logp``: ``u_t =
exp(logp - behav_logp)``, ``w_t = 1``, no cap, ``prox_logp`` unused.

Invariants:
- All tensors are flat ``[N]`` over tokens; ``mask`` is bool or 0/1 float.
- Only ``logp`` carries gradient; ``prox_logp``, ``behav_logp``, ``adv`` are treated as constants.
- ``w_t`` follows ``areal.algo.behav_weight``'s rule: by default a token with
  ``w_t > behav_imp_weight_cap`` is dropped from the loss (not clipped); the level (token,
  sequence, geometric mean), the mode (mask or truncate), a lower bound
  (``behav_imp_weight_floor``) and M2PO's second-moment bound (``m2po_tau``) are settings.
- ``loss = sum over kept tokens / loss_denominator``; the caller passes the minibatch's normaliser
  (`areal.algo.loss_norm`; by default its loss-mask token count), so micro-batch losses add up
  to the minibatch's loss. ``loss_denominator`` may also be ``[N]``, one per token.
- ``LossInput`` / ``LossOutput`` are what every objective of `areal.algo.registry` takes and
  returns; ``ppo_objective`` is this loss on them.
- Tokens outside the mask never influence the loss, its gradient or the stats, even if they hold
  inf or NaN. An all-masked input gives loss 0 that is still connected to ``logp``'s graph.
- ``approx_kl`` is Schulman's k3 estimator of KL(old || current) per kept token:
  ``r = exp(logp - old_logp)``, ``k3 = (r - 1) - log r`` (unbiased for samples drawn from the old
  policy, and >= 0 for every token), with ``old_logp`` the PPO reference: ``prox_logp`` when
  decoupled, ``behav_logp`` otherwise.
- Staleness diagnostics, over loss-mask tokens, from ``w = exp(prox_logp - behav_logp)``
  whatever the objective does with it: ``behav_kl`` is the k1 estimate of KL(behav || prox),
  the mean of ``behav_logp - prox_logp``; ``behav_kl_k3`` the k3 one, mean of
  ``(w - 1) - log w`` (>= 0 token by token); ``behav_ess`` the normalised effective sample
  size of the weights, ``(sum w)^2 / (n * sum w^2)`` in (0, 1] (1 = fresh data; the mean of w is
  ~1 by construction and shows nothing). All 0 (ess 1) when ``prox_logp == behav_logp``.
- ``entropy`` is the mean over loss-mask tokens of the current policy's per-token entropy, which
  the engine computes (no grad) from the same temperature-scaled distribution as ``logp``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from areal.algo.behav_weight import behav_weights

__all__ = [
    "LossInput",
    "LossOutput",
    "LossSettings",
    "PPOLossConfig",
    "PPOLossOutput",
    "behav_stat_sums",
    "loglinear_prox_logp",
    "loss_stat_sums",
    "ppo_loss",
    "ppo_objective",
    "reduce_loss_stats",
    "reduce_tokens",
    "stats_from_sums",
]


class LossSettings(Protocol):
    """What the objectives read: `areal.config.AlgoSettings` is one (the run's settings reach the
    loss as they are, no field is copied on the way); `PPOLossConfig` is the plain one."""

    @property
    def eps_clip_low(self) -> float: ...
    @property
    def eps_clip_high(self) -> float: ...
    @property
    def behav_imp_weight_cap(self) -> float | None: ...
    @property
    def behav_imp_weight_floor(self) -> float | None: ...
    @property
    def behav_imp_weight_level(self) -> str: ...
    @property
    def behav_imp_weight_mode(self) -> str: ...
    @property
    def m2po_tau(self) -> float | None: ...
    @property
    def lr_lag_decay(self) -> float: ...
    @property
    def decoupled(self) -> bool: ...
    @property
    def loss(self) -> str: ...
    @property
    def loss_norm(self) -> str: ...
    @property
    def loss_norm_tokens(self) -> int | None: ...
    @property
    def gspo_eps_clip_low(self) -> float: ...
    @property
    def gspo_eps_clip_high(self) -> float: ...
    @property
    def kl_coef(self) -> float: ...
    @property
    def kl_estimator(self) -> str: ...


@dataclass(frozen=True)
class PPOLossConfig:
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2  # asymmetric allowed (DAPO clip-higher)
    behav_imp_weight_cap: float | None = 5.0  # upper bound of w; None = none
    behav_imp_weight_floor: float | None = None  # lower bound of w; None = none
    behav_imp_weight_level: str = "token"  # token | sequence | geometric (`algo.behav_weight`)
    behav_imp_weight_mode: str = "mask"  # mask (drop) | truncate (clamp) outside the bounds
    m2po_tau: float | None = None  # M2PO's bound on the mean (log w)^2 of kept tokens; None = off
    lr_lag_decay: float = 0.0  # staleness-aware step: lr / (1 + this * mean lag); 0 = off
    decoupled: bool = True  # False: standard PPO with logp_old = behav_logp
    loss: str = "ppo"  # objective: ppo | gspo | pkg.mod:fn (`areal.algo.registry`)
    loss_norm: str = "token"  # token | sequence | constant (`areal.algo.loss_norm`)
    loss_norm_tokens: int | None = None  # constant: tokens per sequence (Dr. GRPO's max length)
    gspo_eps_clip_low: float = 3e-4  # GSPO's sequence-ratio clip range below 1
    gspo_eps_clip_high: float = 4e-4  # and above 1
    kl_coef: float = 0.0  # KL to the frozen reference per loss token (`areal.algo.kl`); 0 = off
    kl_estimator: str = "k3"  # k1 | k2 | k3


@dataclass(frozen=True, kw_only=True)
class LossInput:
    """One micro-batch for an objective: flat ``[N]`` over its sequences' output tokens,
    sequence after sequence.

    Only ``logp`` carries gradient. ``prox_logp`` is the PPO reference when ``decoupled``
    (else it equals ``behav_logp``). ``seq_ids`` numbers the sequences 0..S-1 in order, so a
    sequence's tokens are ``seq_ids == i`` (sequence-level objectives such as GSPO group by it).
    ``loss_denominator`` is the normaliser (`areal.algo.loss_norm`): one number, or ``[N]`` per
    token; an objective returns ``sum_t loss_t / denominator_t`` (``reduce_tokens``), so the
    micro-batch losses of a minibatch add up to its normalised loss.
    """

    logp: torch.Tensor  # [N] float, current policy at the rollout temperature; carries grad
    prox_logp: torch.Tensor  # [N] float, proximal policy (no grad)
    behav_logp: torch.Tensor  # [N] float, behaviour policy recorded by the rollout (no grad)
    adv: torch.Tensor  # [N] float, the sample's advantage on each of its tokens
    mask: torch.Tensor  # [N] bool, True = a loss token (model token of a kept sample)
    seq_ids: torch.Tensor  # [N] int64, 0..S-1, non-decreasing: each token's sequence
    versions: torch.Tensor  # [N] int64, policy version that generated each token
    loss_denominator: float | torch.Tensor  # number, or [N] per token (> 0 on loss tokens)
    entropy: torch.Tensor | None = None  # [N] float, current policy's entropy (no grad, stats)
    ref_logp: torch.Tensor | None = None  # [N] float, frozen reference policy (kl_coef > 0)


def reduce_tokens(
    per_token: torch.Tensor, loss_denominator: float | torch.Tensor, n_kept: int
) -> torch.Tensor:
    """``sum_t per_token_t / denominator_t`` (a scalar with ``per_token``'s graph).
    ``per_token`` must be exactly 0 on tokens outside the loss. A denominator <= 0 is an error
    where a token contributes (a number: when ``n_kept`` > 0); elsewhere it counts as 1."""
    if isinstance(loss_denominator, torch.Tensor):
        den = loss_denominator.to(per_token.device, per_token.dtype)
        if n_kept > 0 and bool(((den <= 0) & (per_token != 0)).any()):
            raise ValueError("loss_denominator must be > 0 on every token that is kept")
        return (per_token / torch.where(den > 0, den, torch.ones_like(den))).sum()
    if loss_denominator <= 0:
        if n_kept > 0:
            raise ValueError(
                f"loss_denominator must be > 0 when tokens are kept, got {loss_denominator}"
            )
        loss_denominator = 1.0
    return per_token.sum() / loss_denominator


@dataclass
class PPOLossOutput:
    loss: torch.Tensor  # scalar, differentiable: sum over kept tokens / loss_denominator
    n_tokens: int  # tokens in mask
    n_kept: int  # tokens in mask and not dropped by the imp-weight cap
    clip_count: float  # kept tokens where the clipped branch was taken
    approx_kl_sum: float  # sum over kept tokens of k3 = (r - 1) - log r, r = exp(logp - old)
    imp_weight_sum: float  # sum of w_t over masked tokens (before cap masking)
    imp_weight_max: float  # max of w_t over masked tokens (0 when none)
    n_imp_masked: int  # tokens dropped because w_t > cap
    entropy_sum: float = 0.0  # sum over masked tokens of the policy entropy (0 if not given), nats
    kl_ref_sum: float | None = None  # sum over masked tokens of the KL to the reference; None: off
    behav_kl_sum: float = 0.0  # sum over masked tokens of behav_logp - prox_logp (k1), nats
    behav_kl_k3_sum: float = 0.0  # sum over masked tokens of (w - 1) - log w (k3), nats
    imp_weight_sq_sum: float = 0.0  # sum over masked tokens of w^2 (the ESS's denominator)


def behav_stat_sums(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """The staleness diagnostics' sums over loss-mask tokens (module docstring), for
    ``PPOLossOutput``'s ``behav_kl_sum``, ``behav_kl_k3_sum`` and ``imp_weight_sq_sum``; tokens
    outside ``mask`` count for nothing, even when they hold inf or NaN. A user objective passes
    them on with ``dataclasses.replace(out, **behav_stat_sums(...))``."""
    with torch.no_grad():
        m = mask.bool()
        zero = torch.zeros((), dtype=prox_logp.dtype, device=prox_logp.device)
        log_w = torch.where(m, prox_logp.detach() - behav_logp.detach(), zero)  # [N]
        w = torch.exp(log_w)
        return {
            "behav_kl_sum": float((-log_w).sum().item()),
            "behav_kl_k3_sum": float((torch.expm1(log_w) - log_w).sum().item()),
            "imp_weight_sq_sum": float(torch.where(m, w * w, zero).sum().item()),
        }


def ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossSettings | PPOLossConfig,
    loss_denominator: float | torch.Tensor,
    entropy: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
) -> PPOLossOutput:
    """Decoupled (or standard) PPO clipped surrogate over flat ``[N]`` token tensors.

    ``loss_denominator``: one number (the batch's loss tokens by default) or ``[N]`` per token
    (``reduce_tokens``). ``entropy`` ``[N]`` (optional, no grad): the current policy's entropy
    at each token, only summed into the stats. ``seq_ids`` ``[N]``: each token's sequence, needed
    by a sequence or geometric behaviour-weight level (one sequence when None).
    """
    n = logp.shape[0]
    others = [("prox_logp", prox_logp), ("behav_logp", behav_logp), ("adv", adv)]
    if entropy is not None:
        others.append(("entropy", entropy))
    for name, t in others:
        if t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if logp.dim() != 1 or mask.shape != (n,):
        raise ValueError(
            f"expected flat [N] tensors, got logp {tuple(logp.shape)}, mask {tuple(mask.shape)}"
        )
    m = mask.bool()  # [N]
    behav = behav_logp.detach()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)

    if cfg.decoupled:
        old_logp = prox_logp.detach()
        rule = behav_weights(
            old_logp,
            behav,
            m,
            seq_ids if seq_ids is not None else torch.zeros(n, dtype=torch.long),
            level=cfg.behav_imp_weight_level,  # type: ignore[arg-type]
            mode=cfg.behav_imp_weight_mode,  # type: ignore[arg-type]
            low=cfg.behav_imp_weight_floor,
            high=cfg.behav_imp_weight_cap,
            m2po_tau=cfg.m2po_tau,
        )
        w, imp_masked = rule.weight.to(logp.dtype), rule.dropped  # [N], 1 outside mask
        w_raw = torch.exp(torch.where(m, old_logp - behav, zero))  # [N], for the stats
    else:
        old_logp = behav
        w = w_raw = torch.ones_like(logp).detach()
        imp_masked = torch.zeros_like(m)
    kept = m & ~imp_masked  # [N]

    # Sanitise before exp so non-kept tokens can neither overflow nor leak NaN into the grad.
    log_ratio = torch.where(kept, logp - old_logp, zero)  # [N]
    ratio = torch.exp(log_ratio)
    a = torch.where(kept, adv.detach().to(logp.dtype), zero)
    pg_loss1 = -a * ratio
    pg_loss2 = -a * torch.clamp(ratio, 1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # = -min(u*A, clip(u)*A)
    w_kept = torch.where(kept, w, zero)
    per_token = w_kept * pg_loss  # [N], exactly 0 outside kept

    n_kept = int(kept.sum().item())
    loss = reduce_tokens(per_token, loss_denominator, n_kept)

    with torch.no_grad():
        clipped = kept & (pg_loss2 > pg_loss1)
        log_r = log_ratio.detach()  # [N], 0 outside kept
        approx_kl = torch.expm1(log_r) - log_r  # k3 = (r - 1) - log r >= 0; 0 outside kept
        w_in_mask = torch.where(m, w_raw, zero)
        ent_sum = (
            float(torch.where(m, entropy.detach().to(logp.device, logp.dtype), zero).sum().item())
            if entropy is not None
            else 0.0
        )
        n_tokens = int(m.sum().item())
        return PPOLossOutput(
            loss=loss,
            n_tokens=n_tokens,
            n_kept=n_kept,
            clip_count=float(clipped.sum().item()),
            approx_kl_sum=float(approx_kl.sum().item()),
            imp_weight_sum=float(w_in_mask.sum().item()),
            imp_weight_max=float(w_in_mask.max().item()) if n_tokens > 0 else 0.0,
            n_imp_masked=int(imp_masked.sum().item()),
            entropy_sum=ent_sum,
            **behav_stat_sums(prox_logp, behav_logp, m),
        )


LossOutput = PPOLossOutput  # what every objective returns (the stats are the same for all)


def ppo_objective(inp: LossInput, cfg: LossSettings) -> PPOLossOutput:
    """``algo.loss: ppo``: decoupled PPO (AReaL, Fu et al. 2025, arXiv 2505.24298, eq. 5; PPO:
    Schulman et al. 2017, arXiv 1707.06347) on a `LossInput`: exactly ``ppo_loss``."""
    return ppo_loss(
        inp.logp,
        inp.prox_logp,
        inp.behav_logp,
        inp.adv,
        inp.mask,
        cfg,
        inp.loss_denominator,
        entropy=inp.entropy,
        seq_ids=inp.seq_ids,
    )


def loss_stat_sums(outs: Sequence[PPOLossOutput]) -> dict[str, float]:
    """Additive totals of micro-batch outputs (what ranks all-reduce with a sum before
    ``stats_from_sums``); ``imp_weight_max`` is combined with a max instead."""
    return {
        "loss": float(sum(float(o.loss.detach().item()) for o in outs)),
        "n_tokens": float(sum(o.n_tokens for o in outs)),
        "n_kept": float(sum(o.n_kept for o in outs)),
        "clip_count": float(sum(o.clip_count for o in outs)),
        "approx_kl_sum": float(sum(o.approx_kl_sum for o in outs)),
        "imp_weight_sum": float(sum(o.imp_weight_sum for o in outs)),
        "n_imp_masked": float(sum(o.n_imp_masked for o in outs)),
        "entropy_sum": float(sum(o.entropy_sum for o in outs)),
        "behav_kl_sum": float(sum(o.behav_kl_sum for o in outs)),
        "behav_kl_k3_sum": float(sum(o.behav_kl_k3_sum for o in outs)),
        "imp_weight_sq_sum": float(sum(o.imp_weight_sq_sum for o in outs)),
    } | (
        {"kl_ref_sum": float(sum(o.kl_ref_sum or 0.0 for o in outs))}
        if any(o.kl_ref_sum is not None for o in outs)
        else {}
    )


def stats_from_sums(sums: dict[str, float], imp_weight_max: float) -> dict[str, float]:
    """Step stats from ``loss_stat_sums`` totals; every value finite, 0 when there is no token.

    ``clipfrac`` and ``approx_kl`` are per kept token; ``entropy``, ``kl_ref`` (the KL estimate
    to the frozen reference, only when ``kl_coef`` > 0) and the imp-weight stats are per masked
    (loss) token.
    """

    def frac(num: float, den: float) -> float:
        return float(num) / den if den > 0 else 0.0

    n_tokens, n_kept = sums["n_tokens"], sums["n_kept"]
    w_sum, w_sq = sums["imp_weight_sum"], sums.get("imp_weight_sq_sum", 0.0)
    return {
        "loss": sums["loss"],
        "clipfrac": frac(sums["clip_count"], n_kept),
        "approx_kl": frac(sums["approx_kl_sum"], n_kept),
        "entropy": frac(sums["entropy_sum"], n_tokens),
        "behav_imp_weight_mean": frac(sums["imp_weight_sum"], n_tokens),
        "behav_imp_weight_max": float(imp_weight_max),
        "behav_imp_weight_masked_frac": frac(sums["n_imp_masked"], n_tokens),
        "behav_kl": frac(sums.get("behav_kl_sum", 0.0), n_tokens),
        "behav_kl_k3": frac(sums.get("behav_kl_k3_sum", 0.0), n_tokens),
        "behav_ess": frac(w_sum * w_sum, n_tokens * w_sq) if w_sq > 0 else 1.0,
        "n_tokens": n_tokens,
    } | ({"kl_ref": frac(sums["kl_ref_sum"], n_tokens)} if "kl_ref_sum" in sums else {})


def reduce_loss_stats(outs: Sequence[PPOLossOutput]) -> dict[str, float]:
    """Combine micro-batch outputs of one step; every value is finite, 0 when there is no token.

    ``loss`` is the sum of micro-batch losses (each already divided by the batch token count);
    ``clipfrac`` and ``approx_kl`` (k3) are per kept token; ``entropy`` and the imp-weight stats
    are per masked token.
    """
    return stats_from_sums(loss_stat_sums(outs), max((o.imp_weight_max for o in outs), default=0.0))


def loglinear_prox_logp(
    behav_logp: torch.Tensor,
    logp_theta: torch.Tensor,
    behav_versions: torch.Tensor,
    current_version: int,
) -> torch.Tensor:
    """Approximate ``prox_logp`` by log-linear interpolation in policy version (AReaL-lite).

    ``prox = behav + alpha * (logp_theta - behav)`` with ``alpha = (v_prox - v_behav) /
    (v_theta - v_behav)``, ``v_prox = current_version``, ``v_theta = current_version + 1``:
    a token of the current version gets alpha 0 (prox = behav), one version old alpha 1/2,
    k versions old k / (k + 1). alpha is clamped to [0, 1]. The result carries no gradient.
    """
    behav = behav_logp.detach()
    lag = (current_version - behav_versions).to(behav.dtype)  # [N], v_prox - v_behav
    alpha = (lag.clamp(min=0.0) / (lag + 1.0).clamp(min=1.0)).clamp(0.0, 1.0)
    return behav + alpha * (logp_theta.detach() - behav)
