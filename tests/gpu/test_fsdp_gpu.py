"""FSDPTrainEngine on one CUDA GPU (nccl, a 1-rank group in a spawned process): bf16 compute
with fp32 master weights, gradient checkpointing and activation offload. Skipped, with the
reason, on machines without a GPU; the multi-rank numbers are checked over gloo on the CPU
(`tests/unit/engines/test_fsdp_train.py`)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPES = [(3, 5), (7, 2), (1, 9), (4, 4), (2, 1), (5, 6), (6, 3)]


def _seqs():
    from areal.engines.base import TrainSeq

    g = torch.Generator().manual_seed(1)
    return [
        TrainSeq(
            prompt_ids=torch.randint(1, 60, (p,), generator=g),
            output_ids=torch.randint(1, 60, (t,), generator=g),
            behav_logp=torch.zeros(t),
            versions=torch.zeros(t, dtype=torch.long),
            adv=1.0,
        )
        for p, t in SHAPES
    ]


def _one_gpu_rank(model_dir: str, port: int, queue) -> None:
    import os

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from safetensors.torch import load

    from areal.engines.config import TrainEngineConfig
    from areal.engines.fsdp_train import FSDPTrainEngine

    eng = FSDPTrainEngine(
        TrainEngineConfig(
            kind="fsdp",
            model_path=model_dir,
            lr=1e-3,
            device="cuda",
            dtype="bfloat16",
            gradient_checkpointing=True,
            activation_offload=True,
        )
    )
    before = [lp.sum().item() for lp in eng.compute_logp(_seqs(), 64)]
    stats = [eng.train_step(_seqs(), 64) for _ in range(3)]
    after = [lp.sum().item() for lp in eng.compute_logp(_seqs(), 64)]
    weights = load(eng.export_safetensors())
    queue.put(
        {
            "device": str(eng.device),
            "master_dtypes": sorted({str(p.dtype) for p in eng.model.parameters()}),
            "export_dtypes": sorted({str(t.dtype) for t in weights.values()}),
            "skipped": sum(s["skipped_minibatches"] for s in stats),
            "gain": sum(after) - sum(before),
        }
    )


@needs_cuda
def test_fsdp_on_one_gpu_trains_in_bf16_on_fp32_master_weights(tmp_path):
    from areal.bus.embedded import free_port
    from areal.data.tiny_model import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "m", seed=0))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_one_gpu_rank, args=(model_dir, free_port(), queue))
    proc.start()
    res = queue.get(timeout=600)  # hang guard
    proc.join(60)
    assert proc.exitcode == 0
    assert res["device"] == "cuda:0"
    assert res["master_dtypes"] == ["torch.float32"]  # the optimizer steps fp32 shards
    assert res["export_dtypes"] == ["torch.bfloat16"]  # what rollout workers load
    assert res["skipped"] == 0
    assert res["gain"] > 0  # positive advantages: the sampled tokens got likelier
