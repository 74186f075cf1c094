"""One registry for the RL math a run picks by name: the objective (``algo.loss``) and the
advantage estimator (``algo.advantage``), each a built-in name or your own ``pkg.mod:fn``.

    algo.loss       ppo (decoupled PPO) | gspo (GSPO) | pkg.mod:fn
    algo.advantage  grpo | dr_grpo | rloo | reinforce_pp | pkg.mod:fn

Your own functions (looked up like reward functions, `areal.user_code.CWD_RULE`):

    def my_loss(inp: LossInput, cfg: LossSettings) -> LossOutput | torch.Tensor
        # inp: flat [N] tensors of one micro-batch (areal.algo.loss.LossInput); cfg: the run's
        # algo settings. Return sum_t loss_t / inp.loss_denominator (reduce_tokens) with
        # logp's graph; a bare scalar tensor gets the generic stats (`plain_output`).
    def my_advantage(rewards: torch.Tensor) -> torch.Tensor
        # rewards [n_groups, G] float -> advantages [n_groups, G], finite

Invariants:
- ``resolve_loss`` / ``resolve_advantage`` either return a callable that takes the documented
  arguments or raise one ``ValueError`` line that names the setting and the fix (an unknown
  name, a module that cannot be imported or fails to, a missing attribute, a wrong signature).
  The launcher and the trainer call them before anything starts (`areal.launch.preflight`).
- ``compute_loss`` always returns a ``LossOutput`` and ``compute_advantages`` always a finite
  tensor of the rewards' shape; a user function that breaks that raises, naming the spec.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch

from areal.algo.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from areal.algo.gspo import gspo_loss
from areal.algo.kl import kl_per_token
from areal.algo.loss import LossInput, LossOutput, LossSettings, ppo_objective, reduce_tokens
from areal.user_code import load_user_attr

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "AdvantageFn",
    "LossFn",
    "compute_advantages",
    "compute_loss",
    "plain_output",
    "resolve_advantage",
    "resolve_loss",
]

LossFn = Callable[[LossInput, LossSettings], "LossOutput | torch.Tensor"]
AdvantageFn = Callable[[torch.Tensor], torch.Tensor]

LOSSES: dict[str, LossFn] = {"ppo": ppo_objective, "gspo": gspo_loss}
ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}


def _resolve(spec: str, setting: str, builtin: dict[str, Any], signature: str, n_args: int):
    if spec in builtin:
        return builtin[spec]
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(
            f"{setting}={spec!r}: use one of {', '.join(builtin)}, or 'pkg.module:function' "
            f"for your own {signature}"
        )
    obj = load_user_attr(mod_name, attr, f"{setting}={spec!r}")
    try:
        inspect.signature(obj).bind(*([None] * n_args))
    except TypeError:
        raise ValueError(
            f"{setting}={spec!r}: {attr} is not a function {signature}; fix its signature"
        ) from None
    except ValueError:  # a builtin without a signature: trust it
        pass
    return obj


@lru_cache(maxsize=32)
def resolve_loss(spec: str) -> LossFn:
    """The objective ``algo.loss`` names (``LOSSES`` or ``pkg.mod:fn``)."""
    return _resolve(spec, "algo.loss", LOSSES, "(inp: LossInput, cfg) -> LossOutput | Tensor", 2)


@lru_cache(maxsize=32)
def resolve_advantage(spec: str) -> AdvantageFn:
    """The estimator ``algo.advantage`` names (``ADVANTAGES`` or ``pkg.mod:fn``)."""
    return _resolve(spec, "algo.advantage", ADVANTAGES, "(rewards [n_groups, G]) -> advantages", 1)


def plain_output(inp: LossInput, cfg: LossSettings, loss: torch.Tensor) -> LossOutput:
    """The stats of a loss that came back as a bare tensor: every loss token counts as kept;
    k3 ``approx_kl`` against the PPO reference, the behaviour weights and the entropy are those
    of the data (nothing clipped or masked by the objective is known)."""
    with torch.no_grad():
        m = inp.mask.bool()
        zero = torch.zeros((), dtype=inp.logp.dtype, device=inp.logp.device)
        old = inp.prox_logp if cfg.decoupled else inp.behav_logp
        log_r = torch.where(m, inp.logp.detach() - old.to(inp.logp.dtype), zero)
        w = torch.exp(torch.where(m, (inp.prox_logp - inp.behav_logp).to(zero.dtype), zero))
        w = torch.where(m, w, zero)
        n_tokens = int(m.sum().item())
        ent = inp.entropy
        return LossOutput(
            loss=loss,
            n_tokens=n_tokens,
            n_kept=n_tokens,
            clip_count=0.0,
            approx_kl_sum=float((torch.expm1(log_r) - log_r).sum().item()),
            imp_weight_sum=float(w.sum().item()) if cfg.decoupled else float(n_tokens),
            imp_weight_max=(float(w.max().item()) if cfg.decoupled else 1.0) if n_tokens else 0.0,
            n_imp_masked=0,
            entropy_sum=float(torch.where(m, ent.to(zero.dtype), zero).sum().item())
            if ent is not None
            else 0.0,
        )


def compute_loss(inp: LossInput, cfg: LossSettings) -> LossOutput:
    """The objective ``cfg.loss`` on one micro-batch (what the engines call), plus
    ``cfg.kl_coef`` times the KL to the reference (`areal.algo.kl`) under the same normaliser."""
    out = resolve_loss(cfg.loss)(inp, cfg)
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        out = plain_output(inp, cfg, out)
    if not isinstance(out, LossOutput):
        raise TypeError(
            f"algo.loss={cfg.loss!r} returned {type(out).__name__}; return a LossOutput or a "
            "scalar tensor"
        )
    if cfg.kl_coef > 0:
        if inp.ref_logp is None:
            raise ValueError("kl_coef > 0 needs the reference log-probs (LossInput.ref_logp)")
        kl = kl_per_token(inp.logp, inp.ref_logp, inp.mask, cfg.kl_estimator)  # [N]
        n = int(inp.mask.bool().sum().item())
        out.loss = out.loss + cfg.kl_coef * reduce_tokens(kl, inp.loss_denominator, n)
        out.kl_ref_sum = float(kl.detach().sum().item())
    return out


def compute_advantages(fn: AdvantageFn, rewards: torch.Tensor, spec: str = "") -> torch.Tensor:
    """``fn(rewards)`` for rewards ``[n_groups, G]``, checked: float, same shape, finite."""
    adv = fn(rewards)
    if not isinstance(adv, torch.Tensor) or adv.shape != rewards.shape:
        got = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
        raise ValueError(
            f"algo.advantage {spec or fn!r} returned {got} for rewards {tuple(rewards.shape)}; "
            "return a tensor of the rewards' shape"
        )
    if not bool(torch.isfinite(adv).all()):
        raise ValueError(f"algo.advantage {spec or fn!r} returned a non-finite advantage")
    return adv.float()
