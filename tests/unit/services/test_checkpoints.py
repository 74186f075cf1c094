"""Checkpoint durability: a write failing on a full disk is retried in place (nothing acked
meanwhile), at most one checkpoint is in flight, a write that keeps failing past the storage
guard's `give_up_s` stops the trainer with the reason, and any other error raises at once.

A stand-in engine whose writes fail as `torch.save` does on a full disk (a RuntimeError whose
context is the ENOSPC) a set number of times; the intake is the real one, the leases are
recorders. The storage guard's backoff sleeps take no wall-clock time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from areal.core.intake import Intake, IntakePolicy
from areal.services.checkpoints import STATE_FILE, Checkpointer
from areal.services.storage import StorageGuard, StorageWriteError
from schemas import ScoredSample
from tests.factories import make_sample


def torch_save_failure(path: str) -> RuntimeError:
    """What `torch.save` into a file raises when the disk fills: the ENOSPC is its context."""
    try:
        try:
            raise OSError(28, "No space left on device", path)
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")  # noqa: B904
    except RuntimeError as e:
        return e


class FlakyEngine:
    """Writes fail as on a full disk `failures` times (leaving a partial file), then succeed."""

    def __init__(self, failures: int) -> None:
        self.failures, self.version, self.writes = failures, 0, 0
        self.seen_before_failure: list[bool] = []  # did the partial state of a failure go?
        self.on_failure: Callable[[], None] = lambda: None

    def save_checkpoint(self, path: str) -> None:
        if self.failures:
            self.seen_before_failure.append(Path(path).exists())
            self.on_failure()
            self.failures -= 1
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / "partial").write_bytes(b"x" * 100)
            raise torch_save_failure(path)
        self.writes += 1
        Path(path).mkdir(parents=True, exist_ok=True)

    def snapshot_checkpoint(self) -> dict:
        return {"version": self.version}

    def write_checkpoint(self, snap: dict, path: str) -> None:
        self.save_checkpoint(path)


class Recorder:
    def __init__(self) -> None:
        self.acked = False

    async def ack(self) -> None:
        self.acked = True


def filed_intake(lease: Recorder | None = None) -> tuple[Intake[Recorder], Recorder]:
    intake: Intake[Recorder] = Intake(IntakePolicy(batch_size=1, group_size=1, max_staleness=0))
    lease = lease or Recorder()
    sample = make_sample(3, task_id="t0", task_seq=0, sample_idx=0, group_size=1)
    scored = ScoredSample(sample=sample, reward=1.0)
    intake.file([scored], lease)
    batch = intake.take_batch().batch
    assert batch is not None
    intake.commit_step(batch, version=1, wall_s=0.0)  # trained: its lease awaits a checkpoint
    return intake, lease


async def noop() -> None:
    return None


def fast_guard(**kw) -> StorageGuard:
    return StorageGuard(sleep=_fast_sleep, **kw)


async def test_a_failing_write_is_retried_and_acks_only_once_it_lands(tmp_path):
    engine = FlakyEngine(failures=3)
    acked_while_failing: list[bool] = []
    guard = fast_guard()
    ckpt = Checkpointer(engine, tmp_path / "ckpt", noop, storage=guard)
    intake, lease = filed_intake()
    engine.version = 1
    engine.on_failure = lambda: acked_while_failing.append(lease.acked)
    await ckpt.save(intake, background=True)
    await ckpt.flush()
    assert engine.writes == 1 and guard.failures == 3 and guard.pauses == 1
    assert acked_while_failing == [False, False, False]  # nothing acked before it landed
    assert lease.acked and (tmp_path / "ckpt" / STATE_FILE).is_file()
    # each failed attempt's partial engine state was removed before the retry (its space back)
    assert engine.seen_before_failure == [False, False, False]
    assert not (tmp_path / "ckpt" / "engine-00000001" / "partial").exists()


async def test_a_write_that_keeps_failing_past_give_up_s_stops_with_the_reason(tmp_path):
    engine = FlakyEngine(failures=10**6)
    # backoff 1 s, then 2 s would pass the 2.5 s budget: two tries
    ckpt = Checkpointer(engine, tmp_path / "ckpt", noop, storage=fast_guard(give_up_s=2.5))
    intake, lease = filed_intake()
    engine.version = 1
    await ckpt.save(intake, background=True)
    with pytest.raises(StorageWriteError, match=r"No space left on device.*--resume"):
        await ckpt.flush()
    assert not lease.acked and not (tmp_path / "ckpt" / STATE_FILE).exists()


async def test_an_engine_s_programming_error_is_raised_at_once(tmp_path):
    class BrokenEngine(FlakyEngine):
        def save_checkpoint(self, path: str) -> None:
            raise KeyError("optimizer")

    guard = fast_guard()
    ckpt = Checkpointer(BrokenEngine(0), tmp_path / "ckpt", noop, storage=guard)
    intake, lease = filed_intake()
    ckpt.engine.version = 1
    with pytest.raises(KeyError, match="optimizer"):
        await ckpt.save(intake, background=False)
    assert guard.failures == 0 and not lease.acked


async def test_the_next_save_waits_for_the_write_in_flight(tmp_path):
    release = asyncio.Event()
    order: list[str] = []

    class SlowEngine(FlakyEngine):
        def write_checkpoint(self, snap: dict, path: str) -> None:
            order.append(f"write {snap['version']}")
            Path(path).mkdir(parents=True, exist_ok=True)

    engine = SlowEngine(failures=0)

    async def on_written() -> None:
        await release.wait()  # the first checkpoint lands only when released
        order.append("landed")

    ckpt = Checkpointer(engine, tmp_path / "ckpt", on_written)
    intake, _ = filed_intake()
    engine.version = 1
    await ckpt.save(intake, background=True)
    engine.version = 2
    second = asyncio.ensure_future(ckpt.save(intake, background=True))
    await asyncio.sleep(0.05)
    assert not second.done()  # blocked behind the first write: no second snapshot yet
    release.set()
    await second
    await ckpt.flush()
    assert order == ["write 1", "landed", "write 2", "landed"]


_real_sleep = asyncio.sleep


async def _fast_sleep(delay: float, *a, **kw) -> None:
    await _real_sleep(0)  # the retry backoff, without the wall-clock wait


class VersionEngine:
    """Its checkpoint is a file holding its version; `load_checkpoint` reads it back."""

    def __init__(self) -> None:
        self.version = 0

    def save_checkpoint(self, path: str) -> None:
        Path(path).write_text(str(self.version))

    def load_checkpoint(self, path: str) -> None:
        self.version = int(Path(path).read_text())


async def test_a_crash_between_the_engine_and_the_state_write_keeps_the_previous_pair(
    tmp_path, monkeypatch
):
    """A rank SIGKILLed mid-checkpoint: the new engine state is on disk, the new
    trainer_state.json is not. The resume must pair the old state with the old engine state
    (new weights with an older step count would train that step twice)."""
    import areal.services.checkpoints as ck

    engine, d = VersionEngine(), tmp_path / "ckpt"
    ckpt = Checkpointer(engine, d, noop)
    intake, _ = filed_intake()
    engine.version = 1
    await ckpt.save(intake, background=False)
    assert [p.name for p in d.glob("engine*")] == ["engine-00000001"]

    def crash(path: Path, text: str) -> None:
        raise SystemExit("killed between the two writes")

    engine.version = 2  # the next step trained
    monkeypatch.setattr(ck, "write_text_atomic", crash)
    with pytest.raises(SystemExit):
        await ckpt.save(intake, background=False)
    assert sorted(p.name for p in d.glob("engine*")) == ["engine-00000001", "engine-00000002"]
    monkeypatch.undo()

    engine2 = VersionEngine()
    fresh = Checkpointer(engine2, d, noop)
    state = fresh.load()
    assert state is not None and state.engine_dir == "engine-00000001"
    await fresh.load_engine()
    assert engine2.version == 1  # the weights of the state's step, not the newer ones
    engine2.version = 2  # the resumed trainer redoes step 2, then checkpoints it
    await fresh.save(intake, background=False)
    assert [p.name for p in d.glob("engine*")] == ["engine-00000002"]  # the stale one went
    assert fresh.load().engine_dir == "engine-00000002"


class FileEngine(FlakyEngine):
    """Writes a real engine state: a directory with a file in it (as DeepSpeed or DCP do)."""

    def save_checkpoint(self, path: str) -> None:
        super().save_checkpoint(path)
        (Path(path) / "model.pt").write_bytes(b"weights")


async def test_a_checkpoint_is_fsynced_before_what_it_covers_is_acked(tmp_path, monkeypatch):
    """A crash of the host (not only of the process) after the acks must still find the
    checkpoint: its engine files, the state file and the renames that name them are flushed to
    disk first."""
    import os

    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    engine, d = FileEngine(failures=0), tmp_path / "ckpt"

    class OrderedLease(Recorder):
        async def ack(self) -> None:
            synced.append("ack")
            await super().ack()

    intake, _ = filed_intake(OrderedLease())
    ckpt = Checkpointer(engine, d, noop)
    engine.version = 1
    await ckpt.save(intake, background=True)
    await ckpt.flush()
    engine_dir = d / "engine-00000001"
    assert "ack" in synced
    before_ack = synced[: synced.index("ack")]
    for path in (engine_dir / "model.pt", engine_dir, d / STATE_FILE, d):
        assert str(path) in before_ack, (path, synced)
