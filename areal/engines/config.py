"""Typed engine configs: what `areal.engines.factory` builds an engine from.

Invariants:
- Both configs are frozen and keyword-only; a config that exists is valid (every field is
  checked in ``__post_init__``, with a one-line error naming the field and the allowed values).
- ``kind`` picks the implementation; fields that only one kind reads say so in their comment
  and are ignored by the others.
- No field holds run state: an engine's policy ``version`` starts at 0 and moves only through
  ``load_weights`` / ``train_step`` / ``load_checkpoint``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from areal.algo.loss import LossSettings, PPOLossConfig
from areal.algo.loss_norm import LOSS_NORMS
from areal.config import MAX_LORA_ALPHA

__all__ = ["InferenceEngineConfig", "LoraSpec", "TrainEngineConfig"]

_DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


def _check_choice(name: str, value: object, allowed: tuple[object, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class InferenceEngineConfig:
    """How to build an inference engine (``kind`` "torch" or "vllm")."""

    kind: Literal["torch", "vllm"]  # implementation: TorchInferenceEngine | VLLMInferenceEngine
    model_path: str  # local HF model directory (config + weights [+ tokenizer])
    dtype: str = "float32"  # weights dtype: float32 | bfloat16 | float16 (or fp32/bf16/fp16)
    device: str = "cpu"  # torch device, e.g. "cpu", "cuda:0" (torch only; vllm places itself)
    max_batch_size: int = 64  # sequences decoded together, >= 1 (vllm: max_num_seqs)
    seed: int = 0  # sampling RNG seed
    gpu_memory_utilization: float = 0.85  # fraction of GPU memory vllm may take, (0, 1] (vllm)
    tensor_parallel_size: int = 1  # GPUs one vllm engine shards over, >= 1 (vllm)
    # vllm: skip torch.compile and CUDA graphs; None = eager on CPU, compiled on GPU
    enforce_eager: bool | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("torch", "vllm"):
            raise ValueError(
                f"unknown inference engine kind {self.kind!r}; choose one of ['torch', 'vllm']"
            )
        _check_choice("dtype", self.dtype, _DTYPES)
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """The adapter a trainer trains (``train.lora``)."""

    r: int = 16  # rank of A [r, in] and B [out, r], >= 1
    alpha: float = 32.0  # scale of the update: W = W0 + (alpha / r) B A, in (0, MAX_LORA_ALPHA]
    dropout: float = 0.0  # dropout on the adapter's input in the loss forward, [0, 1)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        if not (
            self.r >= 1
            and math.isfinite(self.alpha)
            and 0 < self.alpha <= MAX_LORA_ALPHA
            and 0.0 <= self.dropout < 1.0
        ):
            raise ValueError(
                f"lora needs r >= 1, alpha finite in (0, {MAX_LORA_ALPHA:g}] and dropout in "
                f"[0, 1), got r={self.r}, alpha={self.alpha}, dropout={self.dropout}"
            )
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the linear layers to adapt")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


@dataclass(frozen=True, kw_only=True)
class TrainEngineConfig:
    """How to build a training engine (``kind`` "torch", "fsdp" or "deepspeed").

    One ``train_step`` = ``n_minibatches`` optimizer steps; log-probs are taken at
    ``temperature`` (the rollout sampling temperature; 1.0 when rollouts are greedy).
    """

    kind: Literal["torch", "fsdp", "deepspeed"]  # Torch- | FSDP- | DeepSpeedTrainEngine
    model_path: str  # local HF model directory to start from
    lr: float  # AdamW learning rate (per optimizer step), > 0
    weight_decay: float = 0.0  # AdamW decoupled weight decay, >= 0
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW moment decay rates, each in [0, 1)
    grad_clip: float = 1.0  # max global grad L2 norm per optimizer step; <= 0 = no clipping
    # the objective's settings, read as they are: the run's `AlgoSettings` (loss, loss_norm,
    # clip eps, imp-weight cap, decoupled...) or a plain `PPOLossConfig`
    loss_cfg: LossSettings = field(default_factory=PPOLossConfig)
    temperature: float = 1.0  # log-probs are log_softmax(logits / temperature), > 0
    n_minibatches: int = 1  # optimizer steps per train_step (contiguous splits), >= 1
    prox_logp: Literal["recompute", "loglinear"] = "recompute"  # how prox_logp is obtained
    device: str = "cpu"  # torch device; fsdp: "cuda" means cuda:$LOCAL_RANK; deepspeed ignores it
    dtype: str = "float32"  # weights and compute dtype: float32 | bfloat16 | float16
    seed: int = 0  # torch RNG seed at construction
    packing: Literal["ffd", "fixed"] = "ffd"  # micro-batching: FFD packed rows | padded chunks
    fixed_mb_size: int = 8  # sequences per micro-batch when packing == "fixed", >= 1
    attn_implementation: str = "varlen"  # "varlen" (ours) or an HF name: sdpa, eager, ...
    share_prompts: bool = True  # varlen + ffd: a prompt shared by seqs is run once per row
    zero_stage: int = 2  # DeepSpeed ZeRO stage 1..3 (deepspeed only; 0 has no non-finite guard)
    gradient_checkpointing: bool = False  # recompute decoder layers in backward (fsdp, deepspeed)
    activation_offload: bool = False  # saved activations to pinned CPU memory (fsdp, CUDA only)
    lora: LoraSpec | None = None  # train a LoRA adapter only (deepspeed: ZeRO-1/2); None = full

    def __post_init__(self) -> None:
        if self.kind not in ("torch", "fsdp", "deepspeed"):
            raise ValueError(
                f"unknown train engine kind {self.kind!r}; "
                "choose one of ['deepspeed', 'fsdp', 'torch']"
            )
        _check_choice("dtype", self.dtype, _DTYPES)
        _check_choice("prox_logp", self.prox_logp, ("recompute", "loglinear"))
        _check_choice("packing", self.packing, ("ffd", "fixed"))
        _check_choice("zero_stage", self.zero_stage, (1, 2, 3))
        _check_choice("loss_cfg.loss_norm", self.loss_cfg.loss_norm, LOSS_NORMS)
        if self.loss_cfg.loss_norm == "constant" and not self.loss_cfg.loss_norm_tokens:
            raise ValueError("loss_cfg.loss_norm 'constant' needs loss_norm_tokens >= 1")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.temperature <= 0:
            raise ValueError(
                f"temperature must be > 0 (use 1.0 for greedy rollouts), got {self.temperature}"
            )
        if self.lora is not None and self.kind == "deepspeed" and self.zero_stage == 3:
            raise ValueError(
                "lora on deepspeed needs zero_stage 1 or 2 (ZeRO-3 partitions the base weights "
                "the adapter is fingerprinted against)"
            )
        if self.n_minibatches < 1 or self.fixed_mb_size < 1:
            raise ValueError(
                "n_minibatches and fixed_mb_size must be >= 1, got "
                f"{self.n_minibatches} and {self.fixed_mb_size}"
            )
