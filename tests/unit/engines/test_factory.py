"""Engine factory: torch kinds build from their configs, missing extras fail with the pip command."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from areal.engines.config import InferenceEngineConfig, TrainEngineConfig
from areal.engines.factory import make_inference_engine, make_train_engine
from areal.engines.torch_infer import TorchInferenceEngine
from areal.engines.torch_train import TorchTrainEngine


def test_torch_kinds(model_dir):
    infer = make_inference_engine(
        InferenceEngineConfig(kind="torch", model_path=model_dir, max_batch_size=4)
    )
    assert isinstance(infer, TorchInferenceEngine) and infer.max_batch_size == 4
    train = make_train_engine(TrainEngineConfig(kind="torch", model_path=model_dir, lr=1e-3))
    assert isinstance(train, TorchTrainEngine)
    assert train.optimizer.param_groups[0]["lr"] == 1e-3
    assert infer.version == train.version == 0


def test_unknown_kind_is_refused_by_the_config():
    with pytest.raises(ValueError, match="unknown inference engine kind 'sglang'"):
        InferenceEngineConfig(kind="sglang", model_path="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown train engine kind 'megatron'"):
        TrainEngineConfig(kind="megatron", model_path="x", lr=1e-3)  # type: ignore[arg-type]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_missing_vllm_names_the_pip_command():
    with pytest.raises(RuntimeError, match=r"pip install 'areal-bus\[vllm\]'"):
        make_inference_engine(InferenceEngineConfig(kind="vllm", model_path="x"))


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed"
)
def test_missing_deepspeed_names_the_pip_command():
    with pytest.raises(RuntimeError, match=r"pip install 'areal-bus\[deepspeed\]'"):
        make_train_engine(TrainEngineConfig(kind="deepspeed", model_path="x", lr=1e-3))


@pytest.mark.parametrize("module", ["areal.engines.vllm_infer", "areal.engines.deepspeed_train"])
def test_gpu_engine_modules_import_without_their_extras(module):
    importlib.import_module(module)  # vllm / deepspeed are imported lazily, inside the engine
