"""Engine protocols: the small interfaces that services see.

Invariants:
- An inference engine returns, for every generated token, the log-prob of that token under the
  weights that produced it (behaviour log-prob) and the policy version of those weights.
- A training engine never owns the RL math: the loss comes from `areal.algo.loss`, packing from
  `areal.algo.packing`. The engine owns device placement, optimizer and (de)serialisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class GenRequest:
    """One sequence to generate. `prefix_*` carry tokens already generated (resume after a
    crash or a requeue): they are re-prefilled and kept, never resampled."""

    key: str
    prompt_ids: list[int]
    prefix_ids: list[int] = field(default_factory=list)
    prefix_logp: list[float] = field(default_factory=list)
    prefix_versions: list[int] = field(default_factory=list)
    max_new_tokens: int | None = None  # per-request cap; None = SamplingParams.max_new_tokens


@dataclass
class GenOutput:
    key: str
    output_ids: list[int]  # generated tokens only (incl. a final stop token if one was sampled)
    behav_logp: list[float]  # [len(output_ids)] log-prob of each token under the producing weights
    versions: list[int]  # [len(output_ids)] policy version that produced each token
    finish_reason: str  # "stop" | "length" | "abort"
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
        params: SamplingParams,
        poll_weights: PollWeights | None = None,
        on_finished: OnFinished | None = None,
        should_abort: Callable[[str], bool] | None = None,
        poll_requests: PollRequests | None = None,
    ) -> list[GenOutput]:
        """Outputs of `requests` in order, then of any admitted via `poll_requests`."""
        ...

    def load_weights(self, update: WeightUpdate) -> None: ...


@dataclass
class TrainSeq:
    """One sample as the trainer sees it. Tensors are 1-D."""

    prompt_ids: torch.Tensor  # [P] int64
    output_ids: torch.Tensor  # [T] int64
    behav_logp: torch.Tensor  # [T] float32
    versions: torch.Tensor  # [T] int64
    adv: float  # GRPO advantage of the sample (γ=λ=1: same for every token)
    prox_logp: torch.Tensor | None = None  # [T] filled by the trainer before the update


class TrainEngine(Protocol):
    version: int

    def compute_logp(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> list[torch.Tensor]:
        """Per-token log-probs of each seq's output tokens under the current weights (no grad)."""
        ...

    def train_step(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> dict[str, float]:
        """One optimizer step over all seqs, packed into micro-batches; returns loss stats."""
        ...

    def export_safetensors(self) -> bytes: ...

    def save_pretrained(self, path: str) -> None: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...
