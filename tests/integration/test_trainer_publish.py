"""The trainer's weights publish off the step's critical path (issue 17): a small model's
weights are copied to host memory when the step ends and uploaded, announced and followed by
the run state while the next step trains. What that must not cost: the version that goes out is
the one the step produced (not the tensors as the next step left them), versions go out in
order, a failed upload stops the trainer, and the run state never names a version whose weights
are not announced (the controller refuses such a state)."""

from __future__ import annotations

import pytest
import torch

from areal.bus.client import Bus
from areal.core.intake import IntakePolicy
from areal.engines.config import TrainEngineConfig
from areal.engines.torch_train import TorchTrainEngine, export_state_dict
from areal.engines.weights_stream import SafetensorsBlob, SafetensorsSink, host_copy
from areal.services.trainer import TrainerOptions, TrainerService
from schemas.state import TRAINER_KEY, TrainerState

pytestmark = pytest.mark.integration


def make_trainer(bus: Bus, model_dir: str, out, **opts) -> TrainerService:
    engine = TorchTrainEngine(TrainEngineConfig(kind="torch", model_path=model_dir, lr=1e-4))
    options = TrainerOptions(
        intake=IntakePolicy(batch_size=1, group_size=1, max_staleness=1),
        total_steps=2,
        max_tokens_per_mb=64,
        **opts,
    )
    return TrainerService(bus, engine, options, out)


def end_step(svc: TrainerService, version: int) -> dict[str, torch.Tensor]:
    """What a train step leaves: a new version; returns a copy of the weights it produced."""
    svc.engine.version = svc.intake.state.version = svc.intake.state.step = version
    return {k: v.clone() for k, v in export_state_dict(svc.engine.model).items()}


async def run_state(bus: Bus) -> TrainerState:
    state = await bus.kv_get(TRAINER_KEY, TrainerState)
    assert state is not None
    return state


async def test_the_overlapped_upload_ships_the_step_s_weights_not_what_the_next_step_made(
    buses, model_dir, tmp_path
):
    trainer_bus, rollout_bus = buses
    svc = make_trainer(trainer_bus, model_dir, tmp_path)
    await svc.restore()  # publishes v0 (in line: nothing else runs yet)
    assert (await rollout_bus.latest_weights()).version == 0
    produced = end_step(svc, 1)
    await svc._publish_weights()
    assert svc._publishing is not None  # the upload runs in the background ...
    with torch.no_grad():  # ... while the next step already changes the live tensors
        for p in svc.engine.model.parameters():
            p.add_(1.0)
    await svc.publish_settled()
    ann = await rollout_bus.latest_weights()
    assert ann is not None and ann.version == 1
    got = (await rollout_bus.fetch_weights(ann, SafetensorsSink)).state_dict()
    assert got.keys() == produced.keys()
    for k, v in produced.items():
        assert torch.equal(got[k], v), k
    assert (await run_state(trainer_bus)).version == 1  # the state follows the announcement


async def test_the_run_state_never_names_a_version_whose_weights_are_not_announced(
    buses, model_dir, tmp_path
):
    trainer_bus, _ = buses
    svc = make_trainer(trainer_bus, model_dir, tmp_path)
    await svc.restore()
    end_step(svc, 2)  # trained, not yet announced (a checkpoint landing now publishes the state)
    await svc._publish_state()
    state = await run_state(trainer_bus)
    assert state.version == 0 and state.step == 2


async def test_a_failed_upload_raises_at_the_next_publish_and_is_never_announced(
    buses, model_dir, tmp_path, monkeypatch
):
    trainer_bus, rollout_bus = buses
    svc = make_trainer(trainer_bus, model_dir, tmp_path)
    await svc.restore()

    async def store_down(*args, **kwargs):
        raise RuntimeError("object store down")

    monkeypatch.setattr(trainer_bus, "put_weights", store_down)
    end_step(svc, 1)
    await svc._publish_weights()  # the failure happens in the background
    end_step(svc, 2)
    with pytest.raises(RuntimeError, match="object store down"):
        await svc._publish_weights()  # ... and stops the trainer before v2 goes out
    assert (await rollout_bus.latest_weights()).version == 0
    assert (await run_state(trainer_bus)).version == 0


async def test_weights_over_the_limit_are_published_in_line_streamed(buses, model_dir, tmp_path):
    trainer_bus, rollout_bus = buses
    svc = make_trainer(trainer_bus, model_dir, tmp_path, overlap_publish_max_bytes=0)
    await svc.restore()
    end_step(svc, 1)
    await svc._publish_weights()
    assert svc._publishing is None
    assert (await rollout_bus.latest_weights()).version == 1
    assert (await run_state(trainer_bus)).version == 1


def test_host_copy_is_the_blob_s_bytes_and_independent_of_its_tensors():
    state = {"w": torch.arange(6, dtype=torch.float32), "n": torch.tensor([7])}
    blob = SafetensorsBlob(state, "bfloat16")
    want = b"".join(bytes(c) for c in blob.chunks())
    copy = host_copy(blob)
    state["w"].add_(100.0)
    assert copy.nbytes == blob.nbytes and b"".join(bytes(c) for c in copy.chunks()) == want
