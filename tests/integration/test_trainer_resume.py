"""What the trainer keeps of an earlier incarnation's steps when it starts: only those a
written checkpoint covers. Checkpoints come every `train.checkpoint_every` steps, so a trainer
can die with steps trained after the last one, or before the first one; those steps are redone
from redelivered samples, and their records must go from `metrics.jsonl` (else the file would
hold step 1 twice). And a restart that rolls the version forward past weights its checkpoint
does not cover counts the versions it skips, so admission keeps counting steps."""

from __future__ import annotations

import json

import pytest

from areal.core.admission import Admission, AdmissionPolicy
from areal.services.trainer import TrainerService
from schemas.state import TrainerState
from tests.integration.test_trainer_publish import make_trainer, run_state

pytestmark = pytest.mark.integration


def write_steps(path, steps: list[int]) -> None:
    path.write_text("".join(json.dumps({"step": s, "reward_mean": 0.5}) + "\n" for s in steps))


def next_step(svc: TrainerService) -> None:
    """What a train step leaves (`Intake.commit_step`, here of an empty batch): one more step
    and one more version."""
    svc.engine.version += 1
    svc.intake.commit_step([], version=svc.engine.version, wall_s=0.0)


async def publish(svc: TrainerService) -> None:
    await svc._publish_weights()
    await svc.publish_settled()  # announced, then the run state


def admit_all(adm: Admission, st: TrainerState) -> None:
    for seq in adm.admissible(st):
        adm.published(seq)


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


async def test_a_version_rollforward_counts_the_versions_it_skips(buses, model_dir, tmp_path):
    """A trainer that dies after announcing weights its checkpoint does not cover comes back
    on a version past them, and its steps no longer equal its version. Admission counts steps
    (`published_steps` = `version - versions_skipped`), so it still allows (η + 1) * B tasks
    beyond those trained, not (η + 1 + skipped) * B, for the rest of the run."""
    trainer_bus, _ = buses
    B, eta = 1, 1  # make_trainer's intake policy
    adm = Admission(AdmissionPolicy(batch_size=B, max_staleness=eta, total_steps=100))
    first = make_trainer(trainer_bus, model_dir, tmp_path)
    await first.restore()  # v0
    next_step(first)
    await publish(first)  # v1
    await first.checkpoints.save(first.intake, background=False)  # covers step 1
    next_step(first)
    await publish(first)  # v2, and the trainer dies before its next checkpoint
    st = await run_state(trainer_bus)
    assert (st.version, st.versions_skipped, st.step) == (2, 0, 2)
    admit_all(adm, st)
    assert adm.state.admitted == (2 + eta + 1) * B

    second = make_trainer(trainer_bus, model_dir, tmp_path)
    await second.restore()  # step 1 again, on v3: v2 (its step is redone) and v3 skipped
    st = await run_state(trainer_bus)
    assert (st.version, st.versions_skipped, st.step, st.published_steps) == (3, 2, 1, 1)
    assert list(adm.admissible(st)) == []  # what was admitted for step 2 waits for its redo
    next_step(second)
    await publish(second)  # v4 = step 2
    await second.checkpoints.save(second.intake, background=False)
    st = await run_state(trainer_bus)
    assert (st.version, st.versions_skipped, st.step, st.published_steps) == (4, 2, 2, 2)
    saved = second.checkpoints.load()
    assert saved is not None and saved.trainer.versions_skipped == 2
    assert saved.trainer.version - saved.trainer.versions_skipped == saved.trainer.step == 2

    third = make_trainer(trainer_bus, model_dir, tmp_path)
    await third.restore()  # its checkpoint covers v4: nothing newer to skip
    st = await run_state(trainer_bus)
    assert (st.version, st.versions_skipped, st.step) == (4, 2, 2)
    next_step(third)
    await publish(third)  # v5 = step 3
    st = await run_state(trainer_bus)
    admit_all(adm, st)
    assert st.step == 3 and adm.state.admitted == (st.step + eta + 1) * B  # not + 2 skipped


async def test_a_rollforward_without_a_checkpoint_skips_every_version_announced(
    buses, model_dir, tmp_path
):
    trainer_bus, _ = buses
    first = make_trainer(trainer_bus, model_dir, tmp_path)
    await first.restore()  # v0
    next_step(first)
    await publish(first)  # v1, and the trainer dies before its first checkpoint
    second = make_trainer(trainer_bus, model_dir, tmp_path)
    await second.restore()  # step 0 redone on v2
    st = await run_state(trainer_bus)
    assert (st.version, st.versions_skipped, st.step, st.published_steps) == (2, 2, 0, 0)
    adm = Admission(AdmissionPolicy(batch_size=1, max_staleness=1, total_steps=100))
    assert list(adm.admissible(st)) == [0, 1]  # (0 + 1 + 1) * 1


async def test_a_checkpoint_from_before_versions_skipped_is_read_right(buses, model_dir, tmp_path):
    """A checkpoint written before `versions_skipped` existed, by a run that had rolled its
    version forward already, names version 3 at step 1 and no skipped versions: the restore
    counts the 2 versions beyond the steps as skipped, so admission counts steps from then on."""
    trainer_bus, _ = buses
    first = make_trainer(trainer_bus, model_dir, tmp_path)
    await first.restore()  # v0
    first.engine.version = 2  # as after an earlier rollforward (v1 skipped, then v2 announced)
    await publish(first)
    first.intake.state.versions_skipped = 0  # what the old code kept
    next_step(first)  # step 1 on v3
    await publish(first)
    await first.checkpoints.save(first.intake, background=False)
    path = first.checkpoints.dir / "trainer_state.json"
    saved = json.loads(path.read_text())
    del saved["trainer"]["versions_skipped"]  # the old file format
    path.write_text(json.dumps(saved))

    second = make_trainer(trainer_bus, model_dir, tmp_path)
    await second.restore()
    st = await run_state(trainer_bus)
    assert (st.version, st.versions_skipped, st.step, st.published_steps) == (3, 2, 1, 1)
