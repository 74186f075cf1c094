"""Trainer checkpoints: the engine's state plus the intake's `CheckpointState`, written in step
order, optionally in the background; the messages a checkpoint covers are acked after it lands.

Invariants:
- a lease is acked only after the checkpoint that covers its effect is on disk (`ack after
  durable`), and only then does the intake learn the checkpoint is written;
- checkpoints land in step order (each write awaits the previous one);
- `trainer_state.json` is replaced atomically, after the engine state, so a crash mid-write
  leaves the previous checkpoint whole;
- a checkpoint taken while the engine is unchanged since its last save (e.g. to make group
  retirements durable between steps) writes only `trainer_state.json`;
- `on_written` runs after each checkpoint lands (the trainer publishes its run state then).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from areal.bus.client import Lease
from areal.core.intake import Intake
from areal.engines.base import TrainEngine
from schemas.state import CheckpointState

STATE_FILE = "trainer_state.json"


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Checkpointer:
    def __init__(
        self, engine: TrainEngine, ckpt_dir: Path, on_written: Callable[[], Awaitable[None]]
    ) -> None:
        self.engine, self.dir, self.on_written = engine, ckpt_dir, on_written
        self._last: asyncio.Task | None = None
        self._saved_version: int | None = None  # engine version of the last engine save
        self.last_write_s = 0.0  # duration of the last write (+ acks)

    def load(self) -> CheckpointState | None:
        path = self.dir / STATE_FILE
        if not path.exists():
            return None
        return CheckpointState.model_validate_json(path.read_text())

    async def load_engine(self) -> None:
        await asyncio.to_thread(self.engine.load_checkpoint, str(self.dir / "engine"))
        self._saved_version = self.engine.version

    async def save(self, intake: Intake[Lease], *, background: bool) -> None:
        """Checkpoint now. In the background variant only the engine snapshot is taken here (the
        next step may then change the weights); writing and acking run in a task chained after
        the previous checkpoint's (`flush` waits for them)."""
        ckpt, leases = intake.checkpoint()
        engine_changed = self._saved_version != self.engine.version
        self._saved_version = self.engine.version
        snapshot_fn = getattr(self.engine, "snapshot_checkpoint", None)
        if not background or snapshot_fn is None or not engine_changed:
            await self._write(self._last, intake, ckpt, leases, engine_changed, None)
            self._last = None
            return
        snap = await asyncio.to_thread(snapshot_fn)
        self._last = asyncio.create_task(
            self._write(self._last, intake, ckpt, leases, engine_changed, snap)
        )

    async def _write(
        self,
        prev: asyncio.Task | None,
        intake: Intake[Lease],
        ckpt: CheckpointState,
        leases: list[Lease],
        engine_changed: bool,
        snap: Any,
    ) -> None:
        if prev is not None:
            await prev
        t0 = time.perf_counter()
        self.dir.mkdir(parents=True, exist_ok=True)
        engine_path = str(self.dir / "engine")
        if snap is not None:
            await asyncio.to_thread(self.engine.write_checkpoint, snap, engine_path)
        elif engine_changed:
            await asyncio.to_thread(self.engine.save_checkpoint, engine_path)
        await asyncio.to_thread(write_text_atomic, self.dir / STATE_FILE, ckpt.model_dump_json())
        for lease in leases:
            # best effort: an ack that does not arrive is a redelivery, de-duplicated by the
            # intake against this checkpoint's done tasks
            with contextlib.suppress(Exception):
                await lease.ack()
        intake.checkpoint_written(ckpt)
        await self.on_written()
        self.last_write_s = time.perf_counter() - t0

    async def flush(self) -> None:
        """Wait for background checkpoints (and their acks) to land."""
        if self._last is not None:
            await self._last
