"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071), decoupled.

Per sequence i with loss tokens T_i (``mask`` and ``seq_ids``) and advantage A:

    s_i = exp( mean_{t in T_i} (logp_t - old_logp_t) )          # sequence ratio, carries grad
    w_i = exp( mean_{t in T_i} (prox_logp_t - behav_logp_t) )   # behaviour weight, no grad
    loss_t = -w_i * min(s_i * A_t, clip(s_i, 1 - eps_low, 1 + eps_high) * A_t)   for t in T_i

with ``old_logp = prox_logp`` when ``decoupled`` (else ``behav_logp`` and ``w_i = 1``), and
``eps_low, eps_high = gspo_eps_clip_low, gspo_eps_clip_high`` (the paper: 3e-4, 4e-4; a
length-normalised ratio moves far less than a token's, hence the small range).

The decoupled behaviour weight is taken at the sequence level too, with the same length
normalisation as the ratio (a geometric mean of the token weights): GSPO's point is that
per-token weights are noisy, and a token-level ``w_t`` times a sequence-level clip would mix the
two. ``behav_imp_weight_cap`` then drops a whole sequence whose ``w_i`` exceeds it (not clipped),
as decoupled PPO drops a token.

The per-token form ``loss_t`` carries sequence i's loss on each of its tokens, so the normaliser
decides the weighting: ``loss_norm: sequence`` gives the paper's ``1/G sum_i`` exactly
(each sequence once), ``token`` weights a sequence by its length (as verl's token-mean GSPO).

Invariants (as ``ppo_loss``): tokens outside the mask touch neither loss, grad nor stats (even
inf/NaN); an all-masked input gives loss 0 connected to ``logp``'s graph; ``approx_kl`` is the
per-token k3 against ``old_logp``; ``clip_count`` counts kept tokens of clipped sequences;
imp-weight stats are per loss token of the sequence's ``w_i``.
"""

from __future__ import annotations

import torch

from areal.algo.loss import (
    LossInput,
    LossSettings,
    PPOLossOutput,
    behav_stat_sums,
    reduce_tokens,
)

__all__ = ["gspo_loss", "segment_mean"]


def segment_mean(x: torch.Tensor, seq_ids: torch.Tensor, mask: torch.Tensor, n_seqs: int):
    """``(mean over masked tokens of x per sequence [S], masked tokens per sequence [S])``;
    a sequence without masked tokens gets mean 0. ``x`` must be finite where ``mask``."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    sums = torch.zeros(n_seqs, dtype=x.dtype, device=x.device).index_add(
        0, seq_ids, torch.where(mask, x, zero)
    )
    counts = torch.zeros(n_seqs, dtype=x.dtype, device=x.device).index_add(
        0, seq_ids, mask.to(x.dtype)
    )
    return sums / counts.clamp(min=1.0), counts


def gspo_loss(inp: LossInput, cfg: LossSettings) -> PPOLossOutput:
    """``algo.loss: gspo`` (Zheng et al. 2025, arXiv 2507.18071): the sequence-level clipped
    surrogate above, on a `LossInput`."""
    logp, seq_ids = inp.logp, inp.seq_ids.to(inp.logp.device)
    n = logp.shape[0]
    if logp.dim() != 1 or inp.mask.shape != (n,) or seq_ids.shape != (n,):
        raise ValueError(
            f"expected flat [N] tensors, got logp {tuple(logp.shape)}, mask "
            f"{tuple(inp.mask.shape)}, seq_ids {tuple(seq_ids.shape)}"
        )
    m = inp.mask.bool()  # [N]
    n_seqs = int(seq_ids.max().item()) + 1 if n else 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    behav = inp.behav_logp.detach().to(logp.dtype)
    old_logp = inp.prox_logp.detach().to(logp.dtype) if cfg.decoupled else behav

    if cfg.decoupled:
        log_w, n_tok = segment_mean(old_logp - behav, seq_ids, m, n_seqs)  # [S]
        w_seq = torch.exp(log_w)
        cap = cfg.behav_imp_weight_cap
        capped = (n_tok > 0) & (w_seq > cap) if cap is not None else torch.zeros_like(n_tok > 0)
    else:
        n_tok = torch.zeros(n_seqs, dtype=logp.dtype, device=logp.device).index_add(
            0, seq_ids, m.to(logp.dtype)
        )
        w_seq = torch.ones(n_seqs, dtype=logp.dtype, device=logp.device)
        capped = torch.zeros(n_seqs, dtype=torch.bool, device=logp.device)
    kept_seq = (n_tok > 0) & ~capped  # [S]
    kept = m & kept_seq[seq_ids]  # [N]

    log_ratio_tok = torch.where(kept, logp - old_logp, zero)  # [N], 0 outside kept
    seq_log_ratio, _ = segment_mean(log_ratio_tok, seq_ids, kept, n_seqs)  # [S], grad
    s = torch.exp(seq_log_ratio)[seq_ids]  # [N]: s_i on each token of sequence i
    a = torch.where(kept, inp.adv.detach().to(logp.dtype), zero)
    pg_loss1 = -a * s
    pg_loss2 = -a * torch.clamp(s, 1.0 - cfg.gspo_eps_clip_low, 1.0 + cfg.gspo_eps_clip_high)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # = -min(s*A, clip(s)*A)
    w_tok = torch.where(kept, w_seq.detach()[seq_ids], zero)
    per_token = w_tok * pg_loss  # [N], exactly 0 outside kept

    n_kept = int(kept.sum().item())
    loss = reduce_tokens(per_token, inp.loss_denominator, n_kept)

    with torch.no_grad():
        log_r = log_ratio_tok.detach()
        approx_kl = torch.expm1(log_r) - log_r  # per-token k3, 0 outside kept
        w_in_mask = torch.where(m, w_seq[seq_ids], zero) if n else torch.zeros_like(logp)
        ent = inp.entropy
        n_tokens = int(m.sum().item())
        return PPOLossOutput(
            loss=loss,
            n_tokens=n_tokens,
            n_kept=n_kept,
            clip_count=float((kept & (pg_loss2 > pg_loss1)).sum().item()),
            approx_kl_sum=float(approx_kl.sum().item()),
            imp_weight_sum=float(w_in_mask.sum().item()),
            imp_weight_max=float(w_in_mask.max().item()) if n_tokens > 0 else 0.0,
            n_imp_masked=int((m & capped[seq_ids]).sum().item()) if n else 0,
            entropy_sum=float(torch.where(m, ent.detach().to(logp.dtype), zero).sum().item())
            if ent is not None
            else 0.0,
            **behav_stat_sums(inp.prox_logp, inp.behav_logp, m),
        )
