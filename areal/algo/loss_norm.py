"""The loss normaliser (``algo.loss_norm``): what a minibatch's summed token losses are divided by.

    token     loss = sum_t loss_t / (loss tokens of the minibatch)          DAPO's token mean
    sequence  loss = 1/S sum_i (1/|o_i|) sum_{t in o_i} loss_t              GRPO's sample mean
    constant  loss = sum_t loss_t / (S * L)                                 Dr. GRPO's constant

``S`` is the minibatch's sequences (for ``sequence``: those with at least one loss token),
``|o_i|`` sequence i's loss tokens, ``L`` = ``loss_norm_tokens`` (by default the most model
tokens a sample may hold, ``rollout.max_new_tokens * rollout.max_turns``). Token is DAPO's
(Yu et al. 2025, arXiv 2503.14476) token-level mean; sequence is GRPO's (Shao et al. 2024,
arXiv 2402.03300) per-sample length normalisation; constant is Dr. GRPO's (Liu et al. 2025,
arXiv 2503.20783) fix of the length bias: a constant that does not depend on how long each
answer is (their code divides each sequence's token sum by the generation budget, then
averages over the batch: the same as dividing the total by ``S * L``).

Invariants:
- ``Normaliser.of`` is the one place a denominator is derived from a minibatch; engines call it
  once per minibatch and hand the result to every micro-batch of it, so micro-batch losses add
  up to the minibatch's loss whatever the micro-batching.
- ``token`` and ``constant`` give one number (``per_sequence`` False): the denominator of every
  token; ``sequence`` gives ``S * |o_i|`` per token of sequence i.
- An empty minibatch (or one without loss tokens) gives denominator 0, which the loss reads as
  "nothing to normalise" (loss 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["LOSS_NORMS", "Normaliser"]

LOSS_NORMS = ("token", "sequence", "constant")


@dataclass(frozen=True)
class Normaliser:
    """``denominator_t = batch_term * (|o_i| if per_sequence else 1)`` for token t of seq i."""

    batch_term: float
    per_sequence: bool = False

    @classmethod
    def of(
        cls, n_loss_tokens: Sequence[int], norm: str, loss_norm_tokens: int | None = None
    ) -> Normaliser:
        """The normaliser of a minibatch whose sequences have ``n_loss_tokens`` loss tokens."""
        if norm == "token":
            return cls(float(sum(n_loss_tokens)))
        if norm == "sequence":
            return cls(float(sum(1 for k in n_loss_tokens if k > 0)), per_sequence=True)
        if norm == "constant":
            if loss_norm_tokens is None or loss_norm_tokens < 1:
                raise ValueError(
                    f"loss_norm 'constant' needs loss_norm_tokens >= 1, got {loss_norm_tokens}"
                )
            return cls(float(len(n_loss_tokens) * loss_norm_tokens))
        raise ValueError(f"unknown loss_norm {norm!r}; choose one of {list(LOSS_NORMS)}")

    def denominator(
        self, n_loss_tokens: Sequence[int], lengths: Sequence[int]
    ) -> float | torch.Tensor:
        """For a micro-batch whose sequences have ``n_loss_tokens`` loss tokens and ``lengths``
        output tokens: one number, or ``[sum(lengths)]`` float64 per token (``per_sequence``)."""
        if not self.per_sequence:
            return self.batch_term
        per_seq = torch.tensor([self.batch_term * k for k in n_loss_tokens], dtype=torch.float64)
        return torch.repeat_interleave(per_seq, torch.tensor(list(lengths), dtype=torch.long))
