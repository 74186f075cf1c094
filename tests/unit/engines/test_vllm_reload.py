"""The vLLM engine's weight switch around its failures, with vLLM itself faked (no GPU, no vllm
import): only a reload that broke off makes `generate` refuse; a temp write that fails (no space
in /dev/shm) never touched the model, so generation goes on under the old version; a /dev/shm
too small for the weights is passed over for the system temp dir."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from areal.engines import vllm_infer
from areal.engines.base import SamplingParams, WeightUpdate
from areal.engines.vllm_infer import VLLMInferenceEngine, _Loop
from areal.engines.weights_check import spec_of

WEIGHTS = {"w": torch.ones(4, 4), "ids": torch.arange(3)}


class FakeLLM:
    """The `AsyncLLM` calls a switch makes; the reload RPC fails while `rpc_error` is set."""

    def __init__(self) -> None:
        self.reloads: list[str] = []  # the dirs reloaded from
        self.labels: list[str] = []
        self.rpc_error: Exception | None = None

    async def pause_generation(self, **kw: object) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def collective_rpc(self, method: str, args: tuple[str]) -> None:
        assert method == "areal_reload_weights"
        if self.rpc_error is not None:
            raise self.rpc_error
        assert (Path(args[0]) / "model.safetensors").is_file()
        self.reloads.append(args[0])

    async def update_weight_version(self, version: str) -> None:
        self.labels.append(version)


@pytest.fixture
def engine() -> Iterator[VLLMInferenceEngine]:
    """The engine's own logic on a `FakeLLM` (its `__init__` would start vLLM)."""
    eng = object.__new__(VLLMInferenceEngine)
    eng.version, eng.last_switch_s = 0, {}
    eng._dtype, eng._lock, eng._closed = torch.float32, threading.RLock(), False
    eng._reload_failed, eng.llm, eng._loop = False, FakeLLM(), _Loop()
    eng._tied, eng._spec, eng.max_batch_size = False, (spec_of(WEIGHTS), frozenset()), 4
    yield eng
    eng._loop.stop()


def test_a_failed_temp_write_leaves_the_engine_generating(engine, monkeypatch) -> None:
    def no_space(state_dict, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(engine, "_write_weights", no_space)
    with pytest.raises(OSError, match="No space"):
        engine.load_weights(WeightUpdate(1, WEIGHTS))
    assert engine.llm.reloads == [] and engine.version == 0  # the model was never touched
    assert engine.generate([], params=SamplingParams()) == []  # not refused


def test_a_failed_reload_refuses_generation_until_a_good_load(engine) -> None:
    engine.llm.rpc_error = RuntimeError("worker died mid-reload")
    with pytest.raises(RuntimeError, match="mid-reload"):
        engine.load_weights(WeightUpdate(1, WEIGHTS))
    assert engine.version == 0
    with pytest.raises(RuntimeError, match="last weight reload after v0 failed"):
        engine.generate([], params=SamplingParams())  # the model may hold a mix of v0 and v1
    engine.llm.rpc_error = None
    engine.load_weights(WeightUpdate(1, WEIGHTS))  # the retry
    assert (engine.version, engine.llm.labels) == (1, ["1"])
    assert engine.generate([], params=SamplingParams()) == []


def test_weights_bytes_in_the_engine_dtype_without_a_tied_head(engine) -> None:
    # w: 16 floats as bfloat16 (2 bytes) = 32; ids: 3 int64 (8 bytes) = 24
    engine._dtype = torch.bfloat16
    assert engine._nbytes(WEIGHTS) == 32 + 24
    engine._tied = True  # a tied lm_head is not written: vLLM reads the embedding
    assert engine._nbytes({**WEIGHTS, "lm_head.weight": torch.ones(8, 8)}) == 32 + 24


@pytest.mark.skipif(
    not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)), reason="no /dev/shm"
)
def test_a_dev_shm_too_small_for_the_weights_falls_back_to_the_temp_dir(monkeypatch) -> None:
    free = 64 * 2**20  # docker's default /dev/shm
    monkeypatch.setattr(
        vllm_infer.shutil, "disk_usage", lambda p: SimpleNamespace(total=free, used=0, free=free)
    )
    assert vllm_infer._shm_dir(2**20) == "/dev/shm"
    assert vllm_infer._shm_dir(3 * 2**30) is None  # a 1.5B model in bf16: the temp dir
