"""Trainer checkpoints: the engine's state plus the intake's `CheckpointState`, written in step
order, optionally in the background; the messages a checkpoint covers are acked after it lands.

Invariants:
- a lease is acked only after the checkpoint that covers its effect is on disk (`ack after
  durable`: its files and the renames that name them are fsync'ed, so a crash of the host
  after the acks still finds them), and only then does the intake learn the checkpoint is
  written;
- checkpoints land in step order (a save starts only after the previous write landed);
- the engine state and `trainer_state.json` are one pair: an engine state that changed is
  written under a new name (`engine-<version>`), then `trainer_state.json`, which names it, is
  replaced atomically, and only then is the previous engine state removed. A crash anywhere in
  between (a rank SIGKILLed mid-checkpoint) leaves the previous pair whole: a resume never
  pairs new weights with an older step count (which would train a step twice);
- a checkpoint taken while the engine is unchanged since its last save (e.g. to make group
  retirements durable between steps) writes only `trainer_state.json`;
- `on_written` runs after each checkpoint lands (the trainer publishes its run state then);
- at most one checkpoint is in flight: a save waits for the previous write to land first, so
  a disk that stops taking writes pauses training (and acking) instead of letting the trainer
  run ahead of what a resume can restore, and snapshots never pile up in memory;
- a write that fails (`OSError`: a full disk, a read-only or unwritable dir) is retried in
  place with backoff, logged loudly each time (`checkpoint_write_failed`) and once more when
  it lands (`checkpoint_write_recovered`); after `retry_s` it raises `CheckpointWriteError`
  naming the dir and the cause, and the trainer stops. Nothing it covers was acked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from areal.bus.client import Lease
from areal.core.intake import Intake
from areal.engines.base import TrainEngine
from schemas.state import CheckpointState

STATE_FILE = "trainer_state.json"
log = structlog.get_logger()


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` at once, durably: the new file is on disk before it takes the
    name, and the rename is on disk before this returns (a crash of the host, not only of the
    process, then leaves the old file or the new one, never an empty one)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """Flush `path` to disk: a file, or a directory with every file and directory under it
    (their contents and their entries). An engine writes its checkpoint its own way (torch,
    DeepSpeed, DCP); this makes any of them durable before the messages it covers are acked."""
    if path.is_dir():
        for root, _dirs, files in os.walk(path):
            for name in files:
                _fsync(os.path.join(root, name))
            _fsync(root)
    else:
        _fsync(str(path))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriteError(RuntimeError):
    """Checkpoints could not be written for `retry_s`: the trainer must not go on."""


class Checkpointer:
    def __init__(
        self,
        engine: TrainEngine,
        ckpt_dir: Path,
        on_written: Callable[[], Awaitable[None]],
        *,
        retry_s: float = 300.0,
    ) -> None:
        self.engine, self.dir, self.on_written = engine, ckpt_dir, on_written
        self.retry_s = retry_s
        self.write_failures = 0  # failed write attempts so far (each one logged)
        self._last: asyncio.Task | None = None
        self._saved_version: int | None = None  # engine version of the last engine save
        self._engine_dir = "engine"  # the engine state the last written (or loaded) state names
        self.last_write_s = 0.0  # duration of the last write (+ acks)

    def load(self) -> CheckpointState | None:
        path = self.dir / STATE_FILE
        if not path.exists():
            return None
        state = CheckpointState.model_validate_json(path.read_text())
        self._engine_dir = state.engine_dir
        return state

    async def load_engine(self) -> None:
        """The engine state the loaded `trainer_state.json` names (`load` first)."""
        await asyncio.to_thread(self.engine.load_checkpoint, str(self.dir / self._engine_dir))
        self._saved_version = self.engine.version

    async def save(self, intake: Intake[Lease], *, background: bool) -> None:
        """Checkpoint now, once the previous checkpoint has landed. In the background variant
        only the engine snapshot is taken here (the next step may then change the weights);
        writing and acking run in a task (`flush` waits for it)."""
        await self.flush()  # one checkpoint in flight: a failing disk pauses training here
        ckpt, leases = intake.checkpoint()
        engine_changed = self._saved_version != self.engine.version
        self._saved_version = self.engine.version
        name = f"engine-{self.engine.version:08d}" if engine_changed else self._engine_dir
        ckpt = ckpt.model_copy(update={"engine_dir": name})
        snapshot_fn = getattr(self.engine, "snapshot_checkpoint", None)
        if not background or snapshot_fn is None or not engine_changed:
            await self._write(intake, ckpt, leases, engine_changed, None)
            return
        snap = await asyncio.to_thread(snapshot_fn)
        self._last = asyncio.create_task(self._write(intake, ckpt, leases, engine_changed, snap))

    async def _write(
        self,
        intake: Intake[Lease],
        ckpt: CheckpointState,
        leases: list[Lease],
        engine_changed: bool,
        snap: Any,
    ) -> None:
        t0 = time.perf_counter()
        await self._write_files(ckpt, engine_changed, snap)
        for lease in leases:
            # best effort: an ack that does not arrive is a redelivery, de-duplicated by the
            # intake against this checkpoint's done tasks
            with contextlib.suppress(Exception):
                await lease.ack()
        intake.checkpoint_written(ckpt)
        await self.on_written()
        self.last_write_s = time.perf_counter() - t0

    async def _write_files(self, ckpt: CheckpointState, engine_changed: bool, snap: Any) -> None:
        """The engine state, then `trainer_state.json`, retried on `OSError` (module invariants)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_s
        delay, failures = 1.0, 0
        while True:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                engine_path = str(self.dir / ckpt.engine_dir)
                if snap is not None:
                    await asyncio.to_thread(self.engine.write_checkpoint, snap, engine_path)
                elif engine_changed:
                    await asyncio.to_thread(self.engine.save_checkpoint, engine_path)
                if snap is not None or engine_changed:  # on disk before the state names it
                    await asyncio.to_thread(fsync_path, Path(engine_path))
                state = ckpt.model_dump_json()
                await asyncio.to_thread(write_text_atomic, self.dir / STATE_FILE, state)
                self._engine_dir = ckpt.engine_dir
                await asyncio.to_thread(self._remove_other_engine_states)
            except OSError as e:
                failures += 1
                self.write_failures += 1
                reason = f"{type(e).__name__}: {e}"
                if loop.time() + delay > deadline:
                    raise CheckpointWriteError(
                        f"checkpoints to {self.dir} failed for {self.retry_s:.0f} s ({reason}); "
                        "nothing since the last checkpoint was acked: free disk space or fix the "
                        "directory's permissions, then `areal run ... --resume`"
                    ) from None
                log.error(
                    "checkpoint_write_failed",
                    dir=str(self.dir),
                    step=ckpt.trainer.step,
                    error=reason,
                    retry_in_s=delay,
                    gives_up_in_s=round(deadline - loop.time()),
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 15.0)
                continue
            if failures:
                log.warning("checkpoint_write_recovered", step=ckpt.trainer.step, failures=failures)
            return

    def _remove_other_engine_states(self) -> None:
        """Every engine state but the one `trainer_state.json` names (after it was replaced)."""
        for path in self.dir.glob("engine*"):
            if path.name == self._engine_dir:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    async def flush(self) -> None:
        """Wait for background checkpoints (and their acks) to land; re-raises a write's
        `CheckpointWriteError`."""
        if self._last is not None:
            last, self._last = self._last, None
            await last
