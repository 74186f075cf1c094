"""Build engines by kind from config; heavy back-ends (vllm, deepspeed) are imported lazily.

A missing optional back-end fails with a RuntimeError that names the exact pip command.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from areal.engines.base import InferenceEngine, TrainEngine

__all__ = ["make_inference_engine", "make_train_engine"]

# kind -> (module, class, the optional dependency it needs or None)
_INFERENCE = {
    "torch": ("areal.engines.torch_infer", "TorchInferenceEngine", None),
    "vllm": ("areal.engines.vllm_infer", "VLLMInferenceEngine", "vllm"),
}
_TRAIN = {
    "torch": ("areal.engines.torch_train", "TorchTrainEngine", None),
    "deepspeed": ("areal.engines.deepspeed_train", "DeepSpeedTrainEngine", "deepspeed"),
}


def _build(
    table: dict[str, tuple[str, str, str | None]], role: str, kind: str, kw: dict[str, Any]
) -> Any:
    if kind not in table:
        raise ValueError(f"unknown {role} engine kind {kind!r}; choose one of {sorted(table)}")
    module, cls, extra = table[kind]
    if extra is not None and importlib.util.find_spec(extra) is None:
        raise RuntimeError(
            f"the {kind!r} {role} engine needs the optional dependency {extra!r}: "
            f"pip install 'areal-bus[{extra}]'"
        )
    return getattr(importlib.import_module(module), cls)(**kw)


def make_inference_engine(kind: str, **kw: Any) -> InferenceEngine:
    """``kind``: "torch" | "vllm"; keyword arguments go to the engine's constructor."""
    return _build(_INFERENCE, "inference", kind, kw)


def make_train_engine(kind: str, **kw: Any) -> TrainEngine:
    """``kind``: "torch" | "deepspeed"; keyword arguments go to the engine's constructor."""
    return _build(_TRAIN, "train", kind, kw)
