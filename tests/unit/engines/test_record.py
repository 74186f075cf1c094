"""`train.record_batches`: the batches a trainer trained on, recorded and replayed
(`areal.engines.record`). A replay through a second engine from the same start reproduces the
first one's steps exactly; the recorder changes nothing about the engine it wraps."""

from __future__ import annotations

import torch

from areal.engines.record import BatchRecorder, load_step, replay, step_files
from tests.unit.engines.helpers import train_engine
from tests.unit.engines.test_torch_train import make_seqs, with_behav


def test_a_replay_reproduces_the_recorded_steps(model_dir, tmp_path):
    ran = BatchRecorder(train_engine(model_dir), tmp_path / "batches")
    stats = []
    for step in range(3):
        seqs = with_behav(ran, make_seqs(seed=step, adv=1.0 - step))
        stats.append(ran.train_step(seqs, 16))
    assert ran.version == 3  # the wrapped engine's, read through
    files = step_files(tmp_path / "batches")
    assert [f.name for f in files] == [f"step-{v:06d}.pt" for v in (1, 2, 3)]
    seqs, budget = load_step(files[0])
    assert budget == 16 and len(seqs) == len(make_seqs())
    assert all(s.prox_logp is None for s in seqs)  # as train_step received them

    again = train_engine(model_dir)
    replayed = replay(again, tmp_path / "batches")
    for got, want in zip(replayed, stats, strict=True):
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    a, b = ran.export_state_dict(), again.export_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_redone_step_overwrites_its_record(model_dir, tmp_path):
    rec = BatchRecorder(train_engine(model_dir), tmp_path)
    rec.train_step(with_behav(rec, make_seqs(seed=1)), 16)
    rec.version = 0  # a restart from the checkpoint before that step (the engine's own field)
    assert rec._engine.version == 0
    rec.train_step(with_behav(rec, make_seqs(seed=2)), 16)
    (only,) = step_files(tmp_path)
    seqs, _ = load_step(only)
    assert torch.equal(seqs[0].prompt_ids, make_seqs(seed=2)[0].prompt_ids)


def test_an_episode_batch_is_recorded_with_its_mask_and_an_old_record_still_loads(
    model_dir, tmp_path
):
    from dataclasses import asdict, replace

    seqs = make_seqs(seed=4)
    masked = [replace(s, loss_mask=torch.arange(len(s.output_ids)) % 3 != 1) for s in seqs]
    rec = BatchRecorder(train_engine(model_dir), tmp_path)
    want = rec.train_step(with_behav(rec, masked), 16)
    (path,) = step_files(tmp_path)
    back, _ = load_step(path)
    assert all(torch.equal(a.loss_mask, b.loss_mask) for a, b in zip(back, masked, strict=True))
    got = replay(train_engine(model_dir), tmp_path)[0]
    assert got["loss"] == want["loss"] and got["n_tokens"] == want["n_tokens"]
    assert want["n_tokens"] == sum(int(s.loss_mask.sum()) for s in masked)
    # a record written before loss masks existed (no such key): every token trained
    record = torch.load(path, weights_only=True)
    record["seqs"] = [
        {k: v for k, v in asdict(s).items() if k != "loss_mask"} for s in make_seqs(seed=4)
    ]
    torch.save(record, path)
    old, _ = load_step(path)
    assert all(s.loss_mask is None for s in old)
