"""Rollout scheduling: which tasks join the running batch, when to switch weights, and what a
redelivered task means.

A pure state machine, generic over the handle `H` of a task's message (a bus lease in
production) and the payload `W` of a weight update (a state dict). Not thread-safe: the rollout
service calls it under one lock, from its event loop and from the generating thread (at token
boundaries). Time is an argument (`now`, monotonic seconds), never read here.

Invariants:
- a task's requests start only once weights of at least its admission version are loaded (or,
  when interruptible, are switched to at this same boundary): `max_staleness: 0` is truly
  synchronous;
- interruptible: a pending update is switched to at a token boundary, at most once per
  `interrupt_min_interval_s`; not interruptible: with an update pending nothing new starts, the
  running batch drains on the old weights, and the update is applied between batches;
- a version counts as loaded only while the engine holds it: a switch the engine fails
  (`switch_failed`) takes the scheduler back to the engine's version, and the update is pending
  again for a retry (unless a newer one came meanwhile), so a failed load never uses up a
  version. Requests started at a boundary on the strength of that switch are the caller's to
  hand back (`fail_all`: the rollout does, as the engine's `generate` raises with the load);
- a redelivery of a task still being generated here is adopted, not acked: its handle is kept
  with the task and settled when the task's samples are all published (acking it at once would
  lose the task if this worker then died);
- every handle given to `on_task` comes back exactly once, from `sample_published` (ack) or
  `task_failed` (hand back);
- needed first (`SchedulerPolicy.needed_first`): while a task the trainer needs for its next
  batch still has a sample to generate here, no request of a later batch starts. With weights v
  loaded (or switched to at this boundary), the trainer's next batch is the one admitted at a
  version `<= v - max_staleness` (admission lets batch k in at version k - η), so those tasks'
  requests start (in queue order, wherever they are in the queue) and the others wait until
  every such task has all its samples generated (`sample_generated`). The trainer waits for
  that batch's slowest answers; decoding them alone, not beside the next batch's rows, ends
  that wait sooner. It never holds a request of a needed task, so it cannot stall: the held
  requests start when the last needed sample here finishes. With `max_staleness: 0` every task
  is needed: nothing changes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

__all__ = ["Joined", "Request", "Scheduler", "SchedulerPolicy"]

H = TypeVar("H")
W = TypeVar("W")


@dataclass(frozen=True)
class SchedulerPolicy:
    interruptible: bool
    interrupt_min_interval_s: float = 0.0
    needed_first: bool = False  # the trainer's next batch before later ones (invariants)
    max_staleness: int = 0  # η, which says which batch is the trainer's next (needed_first)


@dataclass(frozen=True)
class Request:
    """One sample to generate: sample `index` of task `task_id`."""

    task_id: str
    index: int
    admitted_version: int

    @property
    def key(self) -> str:
        return f"{self.task_id}/{self.index}"


class Joined(Enum):
    NEW = "new"  # its G requests are queued
    ADOPTED = "adopted"  # a redelivery of a task in progress here: handle kept with it


@dataclass
class _Task(Generic[H]):
    remaining: set[int]  # sample indices not yet published
    admitted_version: int
    ungenerated: set[int]  # sample indices queued or being generated here
    handles: list[H] = field(default_factory=list)


class Scheduler(Generic[H, W]):
    def __init__(self, policy: SchedulerPolicy, version: int = 0) -> None:
        self.policy = policy
        self.version = version  # loaded in the engine
        self.pending: tuple[int, W] | None = None  # newest fetched, not yet loaded
        self.queue: deque[Request] = deque()
        self.tasks: dict[str, _Task[H]] = {}
        self.last_switch = -float("inf")

    # ------------------------------------------------------------------ tasks
    def on_task(self, task_id: str, group_size: int, admitted_version: int, handle: H) -> Joined:
        task = self.tasks.get(task_id)
        if task is not None:
            task.handles.append(handle)
            return Joined.ADOPTED
        indices = set(range(group_size))
        self.tasks[task_id] = _Task(indices, admitted_version, set(indices), [handle])
        self.queue.extend(Request(task_id, i, admitted_version) for i in range(group_size))
        return Joined.NEW

    def is_active(self, task_id: str) -> bool:
        return task_id in self.tasks

    def sample_generated(self, task_id: str, index: int) -> None:
        """Generating thread: sample `index` of `task_id` has finished generating (it may not be
        published yet); the `needed_first` hold ends with a batch's last such sample."""
        task = self.tasks.get(task_id)
        if task is not None:
            task.ungenerated.discard(index)

    def sample_published(self, task_id: str, index: int) -> list[H]:
        """Sample `index` of `task_id` is on the bus; returns the task's handles once all G
        indices are (ack them). A second copy of an index (e.g. from an attempt that failed and
        was handed back, then redelivered here) counts once."""
        task = self.tasks.get(task_id)
        if task is None:
            return []
        task.remaining.discard(index)
        task.ungenerated.discard(index)
        if task.remaining:
            return []
        del self.tasks[task_id]
        return task.handles

    def task_failed(self, task_id: str) -> list[H]:
        """Give up on a task here: its queued requests go, its handles come back (nak them)."""
        task = self.tasks.pop(task_id, None)
        self.queue = deque(r for r in self.queue if r.task_id != task_id)
        return task.handles if task is not None else []

    def fail_all(self) -> list[H]:
        """The engine failed: every task goes back."""
        handles = [h for tid in list(self.tasks) for h in self.task_failed(tid)]
        self.queue.clear()
        return handles

    # ------------------------------------------------------------------ weights
    @property
    def known_version(self) -> int:
        return max(self.version, self.pending[0] if self.pending else -1)

    def offer_weights(self, version: int, payload: W) -> bool:
        """Newly fetched weights; False (ignored) unless newer than any known version."""
        if version <= self.known_version:
            return False
        self.pending = (version, payload)
        return True

    def needed_version(self) -> int | None:
        """The admission version the head of the queue waits for, when no known weights are
        new enough (the service then looks for a missed announcement); else None."""
        if self.queue and self.queue[0].admitted_version > self.known_version:
            return self.queue[0].admitted_version
        return None

    def _may_switch(self, now: float) -> bool:
        return now - self.last_switch >= self.policy.interrupt_min_interval_s

    def switch_at_boundary(self, now: float) -> tuple[int, W] | None:
        """Generating thread, at a token boundary: the update to switch to now, if any."""
        if not self.policy.interruptible or self.pending is None or not self._may_switch(now):
            return None
        return self._take(now)

    def switch_between_batches(self, now: float) -> tuple[int, W] | None:
        """Before a generate call: the pending update, applied with no batch running."""
        return self._take(now) if self.pending is not None else None

    def _take(self, now: float) -> tuple[int, W]:
        assert self.pending is not None
        update, self.pending = self.pending, None
        self.version = update[0]
        self.last_switch = now
        return update

    def switch_failed(self, update: tuple[int, W], engine_version: int) -> None:
        """The engine did not load `update` (from a switch) and holds `engine_version`: that is
        the loaded version again, and `update` is pending again for a retry unless a newer
        update is. When to retry is the caller's (it backs off; time is not read here)."""
        self.version = engine_version
        if engine_version < update[0] and (self.pending is None or self.pending[0] < update[0]):
            self.pending = update

    def take_requests(self, now: float, max_n: int | None = None) -> list[Request]:
        """Generating thread, at a token boundary: queued requests that may start now.

        Not interruptible with an update pending: none (the batch drains, then switches).
        Otherwise requests whose admission version is loaded, or is being switched to at this
        boundary (interruptible, pending, switch allowed now), in queue order; with
        `needed_first`, only those of the trainer's next batch while it has samples to generate
        here (the module invariants).
        """
        if self.pending is not None and not self.policy.interruptible:
            return []
        ready = self.version
        if self.pending is not None and self._may_switch(now):
            ready = max(ready, self.pending[0])
        needed = self.needed_limit(ready)
        if needed is not None:  # pick the needed requests out, wherever they are queued
            out = [r for r in self.queue if r.admitted_version <= needed][:max_n]
            if out:  # rebuild the queue only when something leaves it
                taken = set(out)
                self.queue = deque(r for r in self.queue if r not in taken)
            return out
        out: list[Request] = []
        while self.queue and self.queue[0].admitted_version <= ready:
            if max_n is not None and len(out) >= max_n:
                break
            out.append(self.queue.popleft())
        return out

    def needed_limit(self, ready: int) -> int | None:
        """With `needed_first` and weights `ready`: the newest admission version of the
        trainer's next batch, while a task of it has samples to generate here; else None."""
        if not self.policy.needed_first:
            return None
        limit = ready - self.policy.max_staleness
        if any(t.ungenerated and t.admitted_version <= limit for t in self.tasks.values()):
            return limit
        return None
