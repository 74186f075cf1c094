"""A pure, deterministic event-driven simulator of admission (controller) and intake (trainer).

It exists to property-test the staleness rule end to end, crashes included; no asyncio, no bus.
Given a ``SimConfig`` (seed included) the event sequence is fully determined.

Actors and what survives a crash:
- controller: publishes task ``cursor`` with msg-id = task id while ``can_admit(admitted -
  dropped, version, η, B)``, then persists ``(admitted, cursor)`` in a separate event. A crash
  in between loses the in-memory increment; after a restart it re-publishes the same task id,
  which the stream de-duplicates (``dedup=True``), so it never over-admits.
- rollout workers: each has a speed; a slow one (a straggler) keeps its task across many
  version bumps. A task's ``min_token_version`` is the version when generation started
  (generation is interruptible: later tokens are newer). A crashed worker's task is redelivered
  and regenerated from scratch.
- trainer: when ``>= B`` samples wait, takes the B oldest (by task id = admission seq), drops
  the stale ones (``is_fresh``; a drop returns the slot), keeps the fresh ones in memory, and
  once ``B`` fresh groups are held trains on the B oldest and bumps the version. Version and
  drop/train counters are persisted atomically with the acks; a crash returns the un-acked
  fresh groups to the stream (redelivery).

Invariants (checked by ``tests/unit/algo/test_staleness_property.py`` after every event):
- ``outstanding = published - dropped <= (version + η + 1) * B``;
- every trained sample has staleness ``<= η``;
- ``published == trained + dropped + in_flight``.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from areal.algo.staleness import admission_capacity, can_admit, is_fresh, sample_staleness

__all__ = ["AdmissionSim", "SimConfig", "SimTask", "TrainedSample"]

STRAGGLER_SPEEDS = (0.02, 0.1, 0.5, 1.0)  # relative chance per event that a worker finishes


@dataclass(frozen=True)
class SimConfig:
    max_staleness: int
    batch_size: int
    n_workers: int = 3
    seed: int = 0
    controller_crash_weight: float = 0.05
    trainer_crash_weight: float = 0.05
    worker_crash_weight: float = 0.02
    dedup: bool = True  # publish with msg-id = task id; False models the bug it prevents
    intake_check: bool = True  # False models a trainer that skips the freshness check


@dataclass
class SimTask:
    task_id: int  # = admission seq (dataset cursor at admission)
    min_token_version: int = -1  # set when a worker starts generating


@dataclass(frozen=True)
class TrainedSample:
    task_id: int
    min_token_version: int
    version: int  # trainer version when it was trained on

    @property
    def staleness(self) -> int:
        return sample_staleness(self.version, self.min_token_version)


@dataclass
class AdmissionSim:
    cfg: SimConfig
    # persisted: controller KV (admitted counter + dataset cursor) and trainer checkpoint
    kv_admitted: int = 0
    kv_cursor: int = 0
    version: int = 0
    n_dropped: int = 0
    # controller memory
    ctl_alive: bool = True
    ctl_admitted: int = 0
    ctl_cursor: int = 0
    ctl_unpersisted: bool = False
    # ground truth of the stream and the workers
    n_published: int = 0  # tasks that entered the system (duplicates too when dedup is off)
    published_ids: set[int] = field(default_factory=set)
    queue: deque[SimTask] = field(default_factory=deque)
    workers: list[SimTask | None] = field(default_factory=list)
    speeds: list[float] = field(default_factory=list)
    pending: list[SimTask] = field(default_factory=list)  # finished, not yet taken by trainer
    fresh: list[SimTask] = field(default_factory=list)  # trainer memory, un-acked
    trained: list[TrainedSample] = field(default_factory=list)
    n_events: int = 0
    rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.cfg.batch_size < 1 or self.cfg.n_workers < 1:
            raise ValueError("SimConfig needs batch_size >= 1 and n_workers >= 1")
        self.rng = random.Random(self.cfg.seed)
        self.workers = [None] * self.cfg.n_workers
        self.speeds = [self.rng.choice(STRAGGLER_SPEEDS) for _ in range(self.cfg.n_workers)]

    # ---- derived quantities -------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        return self.n_published - self.n_dropped

    @property
    def capacity(self) -> int:
        return admission_capacity(self.version, self.cfg.max_staleness, self.cfg.batch_size)

    @property
    def in_flight(self) -> int:
        running = sum(t is not None for t in self.workers)
        return len(self.queue) + running + len(self.pending) + len(self.fresh)

    # ---- events ---------------------------------------------------------------------------
    def _admit(self) -> None:
        tid = self.ctl_cursor
        if not (self.cfg.dedup and tid in self.published_ids):
            self.published_ids.add(tid)
            self.n_published += 1
            self.queue.append(SimTask(tid))
        self.ctl_unpersisted = True

    def _persist(self) -> None:
        self.ctl_admitted += 1
        self.ctl_cursor += 1
        self.kv_admitted, self.kv_cursor = self.ctl_admitted, self.ctl_cursor
        self.ctl_unpersisted = False

    def _controller_crash(self) -> None:
        self.ctl_alive = False
        self.ctl_unpersisted = False

    def _controller_restart(self) -> None:
        self.ctl_admitted, self.ctl_cursor = self.kv_admitted, self.kv_cursor
        self.ctl_alive = True

    def _worker_start(self, w: int) -> None:
        task = self.queue.popleft()
        task.min_token_version = self.version
        self.workers[w] = task

    def _worker_finish(self, w: int) -> None:
        task = self.workers[w]
        assert task is not None
        self.pending.append(task)
        self.workers[w] = None

    def _worker_crash(self, w: int) -> None:
        task = self.workers[w]
        assert task is not None
        self.queue.appendleft(SimTask(task.task_id))  # redelivered, regenerated from scratch
        self.workers[w] = None

    def _is_fresh(self, task: SimTask) -> bool:
        if not self.cfg.intake_check:
            return True
        return is_fresh(self.version, task.min_token_version, self.cfg.max_staleness)

    def _trainer_intake(self) -> None:
        b = self.cfg.batch_size
        self.pending.sort(key=lambda t: t.task_id)
        taken, self.pending = self.pending[:b], self.pending[b:]
        candidates = self.fresh + taken  # held groups may have gone stale since intake
        self.fresh = [t for t in candidates if self._is_fresh(t)]
        self.n_dropped += len(candidates) - len(self.fresh)
        if len(self.fresh) >= b:
            self.fresh.sort(key=lambda t: t.task_id)
            batch, self.fresh = self.fresh[:b], self.fresh[b:]
            self.trained += [
                TrainedSample(t.task_id, t.min_token_version, self.version) for t in batch
            ]
            self.version += 1

    def _trainer_crash(self) -> None:
        self.pending += self.fresh  # un-acked groups are redelivered
        self.fresh = []

    def enabled_events(self) -> list[tuple[str, float, Callable[[], None]]]:
        """(name, weight, action) of every event that may happen now, in a fixed order."""
        cfg = self.cfg
        ev: list[tuple[str, float, Callable[[], None]]] = []
        if self.ctl_alive:
            if self.ctl_unpersisted:
                ev.append(("persist", 3.0, self._persist))
            elif can_admit(
                self.ctl_admitted - self.n_dropped, self.version, cfg.max_staleness, cfg.batch_size
            ):
                ev.append(("admit", 3.0, self._admit))
            ev.append(("controller_crash", cfg.controller_crash_weight, self._controller_crash))
        else:
            ev.append(("controller_restart", 1.0, self._controller_restart))
        for w, task in enumerate(self.workers):
            if task is None:
                if self.queue:
                    ev.append((f"worker_start_{w}", 2.0, lambda w=w: self._worker_start(w)))
            else:
                ev.append(
                    (f"worker_finish_{w}", self.speeds[w], lambda w=w: self._worker_finish(w))
                )
                ev.append(
                    (
                        f"worker_crash_{w}",
                        cfg.worker_crash_weight,
                        lambda w=w: self._worker_crash(w),
                    )
                )
        if len(self.pending) >= cfg.batch_size:
            ev.append(("trainer_intake", 2.0, self._trainer_intake))
        ev.append(("trainer_crash", cfg.trainer_crash_weight, self._trainer_crash))
        return [e for e in ev if e[1] > 0]

    def step(self) -> str:
        """Run one randomly chosen enabled event and return its name."""
        events = self.enabled_events()
        if not events:
            raise RuntimeError(f"no event enabled after {self.n_events} events (deadlock)")
        name, _, action = self.rng.choices(events, weights=[e[1] for e in events])[0]
        action()
        self.n_events += 1
        return name

    def run_until_version(self, target: int, max_events: int) -> bool:
        """Step until ``version >= target``; False if ``max_events`` ran out first."""
        for _ in range(max_events):
            if self.version >= target:
                return True
            self.step()
        return self.version >= target
