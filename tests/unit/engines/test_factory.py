"""Engine factory: torch kinds build, unknown kinds and missing extras fail with a clear message."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from areal.engines.factory import make_inference_engine, make_train_engine
from areal.engines.torch_infer import TorchInferenceEngine
from areal.engines.torch_train import TorchTrainEngine


def test_torch_kinds(model_dir):
    assert isinstance(
        make_inference_engine("torch", model_path=model_dir, max_batch_size=4), TorchInferenceEngine
    )
    assert isinstance(make_train_engine("torch", model_path=model_dir, lr=1e-3), TorchTrainEngine)


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown inference engine kind 'sglang'"):
        make_inference_engine("sglang")
    with pytest.raises(ValueError, match="unknown train engine kind"):
        make_train_engine("megatron")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_missing_vllm_names_the_pip_command():
    with pytest.raises(RuntimeError, match=r"pip install 'areal-bus\[vllm\]'"):
        make_inference_engine("vllm", model_path="x")


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed"
)
def test_missing_deepspeed_names_the_pip_command():
    with pytest.raises(RuntimeError, match=r"pip install 'areal-bus\[deepspeed\]'"):
        make_train_engine("deepspeed", model_path="x")


@pytest.mark.parametrize("module", ["areal.engines.vllm_infer", "areal.engines.deepspeed_train"])
def test_gpu_engine_modules_import_without_their_extras(module):
    importlib.import_module(module)  # vllm / deepspeed are imported lazily, inside the engine
