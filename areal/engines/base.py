"""Engine protocols: the small interfaces that services see.

Invariants:
- An inference engine returns, for every generated token, the log-prob of that token under the
  weights that produced it (behaviour log-prob) and the policy version of those weights.
- A training engine never owns the RL math: the loss comes from `areal.algo.loss`, packing from
  `areal.algo.packing`. The engine owns device placement, optimizer and (de)serialisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

# The typed engine configs live in `config.py`; re-exported here next to the protocols they
# configure (`from areal.engines.base import InferenceEngineConfig` works).
from areal.engines.config import InferenceEngineConfig, TrainEngineConfig

if TYPE_CHECKING:  # annotations only: the reward worker imports this module and needs no torch
    import torch

__all__ = [
    "GenOutput",
    "GenRequest",
    "InferenceEngine",
    "InferenceEngineConfig",
    "OnFinished",
    "PollRequests",
    "PollWeights",
    "SamplingParams",
    "TrainEngine",
    "TrainEngineConfig",
    "TrainSeq",
    "WeightUpdate",
]


@dataclass
class SamplingParams:
    max_new_tokens: int = 16  # generated tokens per sequence at most (incl. a final stop token)
    temperature: float = 1.0  # softmax temperature; <= 0 = greedy (log-probs then at T = 1)
    top_p: float = 1.0  # nucleus mass kept when sampling; never changes the recorded log-prob
    stop_token_ids: tuple[int, ...] = ()  # sampling one of these ends the sequence ("stop")


@dataclass
class GenRequest:
    """One sequence to generate from ``prompt_ids`` (non-empty)."""

    key: str
    prompt_ids: list[int]
    max_new_tokens: int | None = None  # per-request cap; None = SamplingParams.max_new_tokens


@dataclass
class GenOutput:
    key: str
    output_ids: list[int]  # generated tokens only (incl. a final stop token if one was sampled)
    behav_logp: list[float]  # [len(output_ids)] log-prob of each token under the producing weights
    versions: list[int]  # [len(output_ids)] policy version that produced each token
    finish_reason: str  # "stop" (a stop token was sampled) | "length" (token or context cap)
    n_interrupts: int = 0  # weight switches that happened while this sequence was in flight
    n_reprefill_tokens: int = 0  # tokens re-prefilled (prompt + partial output) after switches


@dataclass
class WeightUpdate:
    version: int
    state_dict: dict[str, torch.Tensor]


# Called by the engine at every token boundary; returns a pending weight update to apply now
# (interruptible mode), or None. Must be cheap and thread-safe.
PollWeights = Callable[[], "WeightUpdate | None"]
# Called by the engine after each finished sequence (so a worker can publish it at once).
OnFinished = Callable[[GenOutput], None]
# Called by the engine at token boundaries while it has free rows: new requests to admit into
# the running batch (continuous batching across calls). Must be cheap and thread-safe.
PollRequests = Callable[[], "list[GenRequest]"]


class InferenceEngine(Protocol):
    version: int

    def generate(
        self,
        requests: list[GenRequest],
        *,
        params: SamplingParams,
        poll_weights: PollWeights | None = None,
        on_finished: OnFinished | None = None,
        poll_requests: PollRequests | None = None,
    ) -> list[GenOutput]:
        """Outputs of `requests` in order, then of any admitted via `poll_requests`; returns
        when every one of them has finished and `poll_requests` (if given) hands in nothing."""
        ...

    def check_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Raise `ValueError` unless `state_dict` fits the model whole (every name, shape and
        dtype; finite values); touches no parameter."""
        ...

    def load_weights(self, update: WeightUpdate) -> None:
        """`check_weights`, then copy: a refused update changes no parameter."""
        ...


@dataclass
class TrainSeq:
    """One sample as the trainer sees it. Tensors are 1-D."""

    prompt_ids: torch.Tensor  # [P] int64
    output_ids: torch.Tensor  # [T] int64
    behav_logp: torch.Tensor  # [T] float32
    versions: torch.Tensor  # [T] int64
    adv: float  # GRPO advantage of the sample (γ=λ=1: same for every token)
    prox_logp: torch.Tensor | None = None  # [T] filled by the trainer before the update
    # [T] bool: True = a model token (in the loss), False = an environment token (tool output,
    # user turn: never trained, not counted in the loss's token denominator); None = all True
    loss_mask: torch.Tensor | None = None

    def n_loss_tokens(self) -> int:
        """Tokens in the loss (the loss-mask count): what the token denominator sums."""
        if self.loss_mask is None:
            return len(self.output_ids)
        return int(self.loss_mask.sum())


class TrainEngine(Protocol):
    version: int

    def compute_logp(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> list[torch.Tensor]:
        """Per-token log-probs of each seq's output tokens under the current weights (no grad):
        of every output token, environment tokens too (the loss just leaves those out)."""
        ...

    def train_step(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> dict[str, float]:
        """One ``train_step`` over all seqs, packed into micro-batches; returns step stats:
        ``reduce_loss_stats`` keys (``loss``, ``clipfrac``, k3 ``approx_kl``, ``entropy``, ...)
        plus ``grad_norm``, ``lr``, ``padding_frac``, ``n_microbatches``, ``tokens``, ``time_s``."""
        ...

    def export_safetensors(self) -> bytes: ...

    def save_pretrained(self, path: str) -> None: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...
