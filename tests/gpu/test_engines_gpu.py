"""GPU engines (vllm inference, deepspeed training). They need a CUDA GPU and the optional
extras, so they are skipped, with that reason, on CPU-only machines such as CI's."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs pip install 'areal-bus[vllm]'"
)
def test_vllm_engine_records_logp_and_switches_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from areal.data.tiny_model import build_tiny_model
    from areal.engines.base import GenRequest, SamplingParams, WeightUpdate
    from areal.engines.config import InferenceEngineConfig
    from areal.engines.factory import make_inference_engine
    from areal.engines.torch_train import export_state_dict

    path = build_tiny_model(tmp_path / "m", seed=0)
    eng = make_inference_engine(
        InferenceEngineConfig(kind="vllm", model_path=str(path), dtype="bfloat16")
    )
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    reqs = [GenRequest(key=f"r{i}", prompt_ids=[5, 6, 7]) for i in range(4)]
    outs = eng.generate(reqs, params=params)
    assert all(len(o.behav_logp) == len(o.output_ids) == len(o.versions) for o in outs)
    model = AutoModelForCausalLM.from_pretrained(path)
    eng.load_weights(WeightUpdate(version=1, state_dict=export_state_dict(model)))
    assert eng.version == 1


@needs_cuda
@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs pip install 'areal-bus[deepspeed]'"
)
def test_deepspeed_engine_single_gpu_step_raises_positive_adv_logp(tmp_path, monkeypatch):
    from areal.algo.loss import PPOLossConfig
    from areal.bus.embedded import free_port
    from areal.data.tiny_model import build_tiny_model
    from areal.engines.base import TrainSeq
    from areal.engines.config import TrainEngineConfig
    from areal.engines.factory import make_train_engine

    for k, v in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(k, v)
    path = build_tiny_model(tmp_path / "m", seed=0)
    eng = make_train_engine(
        TrainEngineConfig(
            kind="deepspeed",
            model_path=str(path),
            lr=1e-3,
            loss_cfg=PPOLossConfig(),
            dtype="float32",
            zero_stage=2,
        )
    )

    def seq(adv: float) -> TrainSeq:
        out = torch.tensor([7, 8, 9, 2])
        return TrainSeq(
            prompt_ids=torch.tensor([5, 6]),
            output_ids=out,
            behav_logp=torch.full((4,), -3.0),
            versions=torch.zeros(4, dtype=torch.long),
            adv=adv,
        )

    seqs = [seq(1.0), seq(1.0)]
    before = sum(float(x.sum()) for x in eng.compute_logp(seqs, 1024))
    stats = eng.train_step(seqs, 1024)
    after = sum(float(x.sum()) for x in eng.compute_logp(seqs, 1024))
    assert eng.version == 1 and stats["n_tokens"] > 0
    assert after > before
    assert stats["entropy"] > 0.0 and stats["approx_kl"] >= 0.0
