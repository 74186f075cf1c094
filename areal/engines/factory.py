"""Build engines from their typed configs; heavy back-ends (vllm, deepspeed) are imported lazily.

A missing optional back-end fails with a RuntimeError that names the exact pip command; an
unknown kind is already refused when the config is built (``areal.engines.config``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from areal.engines.base import InferenceEngine, TrainEngine
from areal.engines.config import InferenceEngineConfig, TrainEngineConfig

__all__ = [
    "InferenceEngineConfig",
    "TrainEngineConfig",
    "make_inference_engine",
    "make_train_engine",
]

# kind -> (module, class, the optional dependency it needs or None)
_INFERENCE = {
    "torch": ("areal.engines.torch_infer", "TorchInferenceEngine", None),
    "vllm": ("areal.engines.vllm_infer", "VLLMInferenceEngine", "vllm"),
}
_TRAIN = {
    "torch": ("areal.engines.torch_train", "TorchTrainEngine", None),
    "fsdp": ("areal.engines.fsdp_train", "FSDPTrainEngine", None),
    "deepspeed": ("areal.engines.deepspeed_train", "DeepSpeedTrainEngine", "deepspeed"),
}


def _build(
    table: dict[str, tuple[str, str, str | None]],
    role: str,
    cfg: InferenceEngineConfig | TrainEngineConfig,
) -> Any:
    if cfg.kind not in table:  # unreachable for a config built normally; kept for safety
        raise ValueError(f"unknown {role} engine kind {cfg.kind!r}; choose one of {sorted(table)}")
    module, cls, extra = table[cfg.kind]
    if extra is not None and importlib.util.find_spec(extra) is None:
        raise RuntimeError(
            f"the {cfg.kind!r} {role} engine needs the optional dependency {extra!r}: "
            f"pip install 'areal-bus[{extra}]'"
        )
    return getattr(importlib.import_module(module), cls)(cfg)


def make_inference_engine(cfg: InferenceEngineConfig) -> InferenceEngine:
    """The inference engine of ``cfg.kind`` ("torch" | "vllm"), built from ``cfg``."""
    return _build(_INFERENCE, "inference", cfg)


def make_train_engine(cfg: TrainEngineConfig) -> TrainEngine:
    """The training engine of ``cfg.kind`` ("torch" | "fsdp" | "deepspeed"), built from ``cfg``."""
    return _build(_TRAIN, "train", cfg)
