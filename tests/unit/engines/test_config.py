"""Engine configs: frozen, keyword-only, defaults as documented, bad values refused at build."""

from __future__ import annotations

import dataclasses

import pytest

from areal.algo.loss import PPOLossConfig
from areal.engines.config import InferenceEngineConfig, TrainEngineConfig


def test_defaults():
    i = InferenceEngineConfig(kind="torch", model_path="m")
    assert (i.dtype, i.device, i.max_batch_size, i.seed) == ("float32", "cpu", 64, 0)
    t = TrainEngineConfig(kind="torch", model_path="m", lr=1e-5)
    assert t.loss_cfg == PPOLossConfig()
    assert (t.weight_decay, t.grad_clip, t.temperature, t.n_minibatches) == (0.0, 1.0, 1.0, 1)
    assert (t.prox_logp, t.packing, t.fixed_mb_size, t.zero_stage) == ("recompute", "ffd", 8, 2)
    assert t.betas == (0.9, 0.999) and t.attn_implementation == "varlen"


def test_frozen_and_keyword_only():
    cfg = InferenceEngineConfig(kind="torch", model_path="m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        InferenceEngineConfig("torch", "m")  # type: ignore[misc]
    with pytest.raises(TypeError):
        TrainEngineConfig(kind="torch", model_path="m")  # type: ignore[call-arg]  # lr required


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"dtype": "int8"}, "dtype"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ],
)
def test_inference_config_refuses_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        InferenceEngineConfig(kind="torch", model_path="m", **kw)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"lr": 0.0}, "lr"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"temperature": 0.0}, "temperature"),
        ({"n_minibatches": 0}, "n_minibatches"),
        ({"fixed_mb_size": 0}, "fixed_mb_size"),
        ({"prox_logp": "exact"}, "prox_logp"),
        ({"packing": "greedy"}, "packing"),
        ({"zero_stage": 4}, "zero_stage"),
        ({"dtype": "float64"}, "dtype"),
    ],
)
def test_train_config_refuses_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainEngineConfig(kind="torch", model_path="m", **{"lr": 1e-5, **kw})
