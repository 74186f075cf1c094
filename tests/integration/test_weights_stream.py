"""Weights stream through the real bus (issue 12): a state dict goes out tensor by tensor, cast
to the wire dtype, through the object store or a file, and comes back straight into tensors,
never as one Python buffer the size of the blob; the trainer publishes fp32 masters as bf16
and the rollout engine loads them into its own fp32; NaN/inf is scanned once per version."""

from __future__ import annotations

import hashlib
import tracemalloc

import pytest
import torch

from areal.bus.client import Bus
from areal.bus.errors import WeightsRejected
from areal.core.intake import IntakePolicy
from areal.core.scheduling import SchedulerPolicy
from areal.data.tiny_model import build_tiny_model
from areal.engines import weights_check
from areal.engines.base import SamplingParams, WeightUpdate
from areal.engines.config import InferenceEngineConfig, TrainEngineConfig
from areal.engines.torch_infer import TorchInferenceEngine
from areal.engines.torch_train import TorchTrainEngine, export_state_dict
from areal.engines.weights_stream import SafetensorsBlob, SafetensorsSink
from areal.security.keys import RunKeys
from areal.services.rollout import RolloutService
from areal.services.trainer import TrainerOptions, TrainerService

pytestmark = pytest.mark.integration
MIB = 1 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture
async def pair(nats_url, run_id, tmp_path):
    keys = RunKeys.generate()
    weights_dir = tmp_path / "weights"
    trainer = await Bus.connect(nats_url, run_id, "trainer", "trainer-0", keys=keys)
    rollout = await Bus.connect(
        nats_url, run_id, "rollout", "rollout-0", keys=keys.public(), weights_dir=str(weights_dir)
    )
    yield trainer, rollout, str(weights_dir)
    await trainer.close()
    await rollout.close()


def big_state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = mib * MIB // 4 // 4
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(4)} | {
        "step": torch.tensor([3], dtype=torch.int64)
    }


@pytest.mark.parametrize("transport", ["object_store", "file"])
async def test_a_state_dict_streams_out_cast_and_back_into_tensors(pair, transport):
    trainer, rollout, weights_dir = pair
    state = big_state(32)  # 32 MiB of fp32 masters, 16 MiB on the wire in bf16
    blob = SafetensorsBlob(state, "bfloat16")
    file_dir = weights_dir if transport == "file" else None
    ann = await trainer.put_weights(1, blob, "bfloat16", step=1, file_dir=file_dir)
    assert ann.nbytes == blob.nbytes < 17 * MIB and ann.dtype == "bfloat16"
    assert ann.sha256 == hashlib.sha256(b"".join(bytes(c) for c in blob.chunks())).hexdigest()
    tracemalloc.start()
    try:
        got = (await rollout.fetch_weights(ann, SafetensorsSink)).state_dict()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < ann.nbytes // 2  # chunks pass through: joining them would take nbytes
    for k, v in state.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k
    assert await rollout.get_weights(ann) == b"".join(bytes(c) for c in blob.chunks())


async def test_a_blob_that_is_not_what_was_announced_is_refused_after_streaming(pair):
    trainer, rollout, _ = pair
    ann = await trainer.put_weights(1, SafetensorsBlob(big_state(1), None), "float32", step=1)
    other = await trainer.put_weights(2, SafetensorsBlob(big_state(1), "bfloat16"), "x", step=2)
    forged = ann.model_copy(update={"uri": other.uri, "nbytes": other.nbytes})
    forged = forged.model_copy(
        update={"signature": trainer.keys.sign(forged.signed_payload(trainer.names.run_id))}
    )
    with pytest.raises(WeightsRejected, match="failed verification"):
        await rollout.fetch_weights(forged, SafetensorsSink)


async def test_fp32_masters_go_out_in_bf16_and_load_into_the_fp32_rollout_once_checked(
    pair, model_dir, tmp_path, monkeypatch
):
    trainer_bus, rollout_bus, _ = pair
    engine = TorchTrainEngine(TrainEngineConfig(kind="torch", model_path=model_dir, lr=1e-4))
    opts = TrainerOptions(
        intake=IntakePolicy(batch_size=1, group_size=1, max_staleness=1),
        total_steps=1,
        max_tokens_per_mb=64,
        wire_dtype="bfloat16",
    )
    await TrainerService(trainer_bus, engine, opts, tmp_path / "out").restore()  # publishes v0
    ann = await rollout_bus.latest_weights()
    assert ann is not None and ann.dtype == "bfloat16"
    fp32_bytes = sum(t.numel() * 4 for t in export_state_dict(engine.model).values())
    assert ann.nbytes < fp32_bytes * 0.55  # half the bytes (plus the header)

    infer = TorchInferenceEngine(InferenceEngineConfig(kind="torch", model_path=model_dir))
    svc = RolloutService(
        rollout_bus,
        infer,
        lambda ids: "",
        SamplingParams(),
        policy=SchedulerPolicy(interruptible=True),
        max_concurrent_tasks=1,
    )
    scans: list[int] = []
    real = weights_check.all_finite
    monkeypatch.setattr(weights_check, "all_finite", lambda t: scans.append(1) or real(t))
    bumped = ann.model_copy(update={"version": 1})  # the rollout holds v0: offer it as v1
    bumped = bumped.model_copy(
        update={"signature": trainer_bus.keys.sign(bumped.signed_payload(trainer_bus.names.run_id))}
    )
    await svc.weights.on_weights(bumped)
    update = svc.sched.switch_between_batches(0.0)
    assert update is not None
    infer.load_weights(WeightUpdate(*update))
    n_float = sum(t.is_floating_point() for t in infer.model.state_dict().values())
    assert len(scans) == n_float  # the fetch path scanned each tensor; load_weights did not
    masters = engine.model.state_dict()
    for k, v in infer.model.state_dict().items():
        assert v.dtype == torch.float32  # the rollout's own dtype
        assert torch.equal(v, masters[k].to(torch.bfloat16).to(torch.float32)), k
