"""What the trainer keeps of an earlier incarnation's steps when it starts: only those a
written checkpoint covers. Checkpoints come every `train.checkpoint_every` steps, so a trainer
can die with steps trained after the last one, or before the first one; those steps are redone
from redelivered samples, and their records must go from `metrics.jsonl` (else the file would
hold step 1 twice)."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_trainer_publish import make_trainer

pytestmark = pytest.mark.integration


def write_steps(path, steps: list[int]) -> None:
    path.write_text("".join(json.dumps({"step": s, "reward_mean": 0.5}) + "\n" for s in steps))


async def test_steps_of_an_incarnation_that_died_before_its_first_checkpoint_are_dropped(
    buses, model_dir, tmp_path
):
    trainer_bus, _ = buses
    write_steps(tmp_path / "metrics.jsonl", [1, 2, 3])  # trained, never checkpointed
    svc = make_trainer(trainer_bus, model_dir, tmp_path)
    await svc.restore()
    assert svc.intake.state.step == 0
    assert svc.metrics.records() == []  # step 1 is redone, and recorded once


async def test_steps_after_the_last_checkpoint_are_dropped(buses, model_dir, tmp_path):
    trainer_bus, _ = buses
    first = make_trainer(trainer_bus, model_dir, tmp_path)
    await first.restore()
    first.engine.version = first.intake.state.version = first.intake.state.step = 2
    await first.checkpoints.save(first.intake, background=False)  # covers steps 1-2
    write_steps(tmp_path / "metrics.jsonl", [1, 2, 3, 4])  # 3-4 died with it
    second = make_trainer(trainer_bus, model_dir, tmp_path)
    await second.restore()
    assert second.intake.state.step == 2
    assert [r["step"] for r in second.metrics.records()] == [1, 2]
