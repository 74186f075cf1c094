"""Fixtures of the trainer-service tests (`test_trainer_publish`, `test_trainer_resume`): a
tiny model dir, and a trainer's and a rollout worker's bus on one run (the rollout verifies
what the trainer signs)."""

from __future__ import annotations

import pytest

from areal.bus.client import Bus
from areal.data.tiny_model import build_tiny_model
from areal.security.keys import RunKeys


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture
async def buses(nats_url, run_id):
    keys = RunKeys.generate()
    trainer = await Bus.connect(nats_url, run_id, "trainer", "trainer-0", keys=keys)
    rollout = await Bus.connect(nats_url, run_id, "rollout", "rollout-0", keys=keys.public())
    yield trainer, rollout
    await trainer.close()
    await rollout.close()
