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
- a write that fails on a full or failing disk (ENOSPC anywhere in the error's chain, as
  `torch.save` reports it, or another filesystem `OSError`) is retried in place through the
  trainer's `StorageGuard` (`areal.services.storage`: one `storage_full` / `write_failed`
  event per pause, `storage_recovered` when it lands) until it lands. Nothing it covers was
  acked meanwhile. Any other error raises at once.
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
from areal.services.storage import StorageGuard, tree_bytes
from schemas.state import CheckpointState

STATE_FILE = "trainer_state.json"
log = structlog.get_logger()


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` at once, durably: the new file is on disk before it takes the
    name, and the rename is on disk before this returns (a crash of the host, not only of the
    process, then leaves the old file or the new one, never an empty one)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: a partial temp file holds space for nothing
        raise
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


def _remove(path: Path) -> None:
    """Delete the file or dir `path` (best effort; absent is fine)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class Checkpointer:
    def __init__(
        self,
        engine: TrainEngine,
        ckpt_dir: Path,
        on_written: Callable[[], Awaitable[None]],
        *,
        storage: StorageGuard | None = None,
    ) -> None:
        self.engine, self.dir, self.on_written = engine, ckpt_dir, on_written
        self.storage = storage or StorageGuard()
        self._last: asyncio.Task | None = None
        self._saved_version: int | None = None  # engine version of the last engine save
        self._engine_dir = "engine"  # the engine state the last written (or loaded) state names
        self.last_write_s = 0.0  # duration of the last write (+ acks)
        self.last_bytes: int | None = None  # size of the last engine state written (or found)

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
        """The engine state, then `trainer_state.json`, through the storage guard (module
        invariants); the bytes it needs are about those of the last engine state."""
        if self.last_bytes is None:
            found = await asyncio.to_thread(tree_bytes, self.dir / self._engine_dir)
            self.last_bytes = found or None
        await self.storage.write(
            "checkpoint",
            self.dir,
            lambda: self._write_once(ckpt, engine_changed, snap),
            needs_bytes=self.last_bytes if (snap is not None or engine_changed) else None,
        )

    async def _write_once(self, ckpt: CheckpointState, engine_changed: bool, snap: Any) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        engine_path = str(self.dir / ckpt.engine_dir)
        if snap is not None or engine_changed:
            try:
                if snap is not None:
                    await asyncio.to_thread(self.engine.write_checkpoint, snap, engine_path)
                else:
                    await asyncio.to_thread(self.engine.save_checkpoint, engine_path)
                await asyncio.to_thread(fsync_path, Path(engine_path))  # before the state names it
            except Exception:
                if ckpt.engine_dir != self._engine_dir:  # a partial new state: give its space back
                    await asyncio.to_thread(_remove, Path(engine_path))
                raise
            self.last_bytes = await asyncio.to_thread(tree_bytes, engine_path) or None
        state = ckpt.model_dump_json()
        await asyncio.to_thread(write_text_atomic, self.dir / STATE_FILE, state)
        self._engine_dir = ckpt.engine_dir
        await asyncio.to_thread(self._remove_other_engine_states)

    def _remove_other_engine_states(self) -> None:
        """Every engine state but the one `trainer_state.json` names (after it was replaced)."""
        for path in self.dir.glob("engine*"):
            if path.name != self._engine_dir:
                _remove(path)

    async def flush(self) -> None:
        """Wait for background checkpoints (and their acks) to land; re-raises a write's
        error (`StorageWriteError` after the guard's `give_up_s`)."""
        if self._last is not None:
            last, self._last = self._last, None
            await last
