"""Liveness: which workers went silent (frozen), and what their silence cost the run.

A pure state machine: heartbeats, starts, stops and training steps in (each with the observer's
clock `now`, in seconds), decisions out (`Frozen`, `Recovered`). No I/O, no clock; the launcher
(`areal.launch.watchdog`) feeds it from the bus and acts on what it decides.

Invariants:
- a worker heard from is `Frozen` once it has been silent for `frozen_after_s` or more (the
  bound itself counts) of time in which the observer heard others; one started by the observer
  that has sent no heartbeat since that (re)start is judged from the start, against the longer
  `startup_s` (model load, warm start, waiting for its role lock; never below the first);
- blindness is not silence: while nobody at all has been heard for `blind_after_s` (the server
  is away, or the observer itself stalled) nobody is judged, and such a gap is taken out of every
  worker's silence, so an outage of the bus never names every worker frozen. A watchdog that
  hears no one judges no one;
- each silence is reported once; a heartbeat from the worker, or from its restart under the same
  worker id, ends it. The episode then closes with `Recovered` at the first new training step
  (a step number higher than any before), with how long the worker was out (`down_s`) and the
  longest stretch the run went without a new step from the freeze on (`held_s`);
- a stopped worker (it said so, or its process exited) is not judged until it starts or beats
  again; a late heartbeat or stop of an earlier incarnation (another pid) changes nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

HEARTBEAT_S = 2.0  # every worker's heartbeat period (`areal.services.common.heartbeat_loop`)
# the smallest frozen_after_s: two beats may come late on a busy host, a third missed is a freeze
MIN_FROZEN_AFTER_S = 2.5 * HEARTBEAT_S
# nobody heard for this long: the observer cannot hear (several workers beat every HEARTBEAT_S)
BLIND_AFTER_S = 1.5 * HEARTBEAT_S
PROGRESS_KEPT = 4096  # times of the latest new training steps kept (to measure held_s)


@dataclass(frozen=True)
class WatchdogPolicy:
    frozen_after_s: float  # silence (s) that names a worker frozen
    startup_s: float  # the same for a worker with no heartbeat since its (re)start
    blind_after_s: float = BLIND_AFTER_S


@dataclass(frozen=True)
class Frozen:
    """Worker `worker_id` has been silent `silent_s` (heard time): since its last heartbeat, or
    since its (re)start when `heard` is False."""

    worker_id: str
    role: str
    silent_s: float
    heard: bool
    pid: int | None
    host: str | None


@dataclass(frozen=True)
class Recovered:
    """A frozen worker (or its restart) beat again and the run made a new step since."""

    worker_id: str
    role: str
    down_s: float  # its last heartbeat (or start) before the freeze -> its first one after
    held_s: float  # the longest time without a new training step, from the freeze to now


@dataclass
class _Episode:
    silent_from: float  # observer time of its last heartbeat (or start) before the freeze
    last_progress: float  # the latest new training step seen (or silent_from)
    held_s: float = 0.0
    back_at: float | None = None


@dataclass
class _Worker:
    role: str
    since: float  # heard clock at its last heartbeat, or at its (re)start
    silent_from: float  # observer clock of the same moment
    heard: bool  # a heartbeat since its (re)start
    pid: int | None = None
    host: str | None = None
    judged: bool = True  # False once stopped
    reported: bool = False  # this silence was reported
    episode: _Episode | None = None  # open from the report until Recovered


class Watchdog:
    def __init__(self, policy: WatchdogPolicy) -> None:
        self.policy = policy
        self._workers: dict[str, _Worker] = {}
        self._last: float | None = None  # the latest `now` seen
        self._last_heard: float | None = None  # the latest heartbeat from anyone
        self._blind_s = 0.0  # gaps in which nobody was heard, taken out of every silence
        self._best_step = -1
        self._progress: deque[float] = deque(maxlen=PROGRESS_KEPT)

    # ------------------------------------------------------------------ clock
    def _advance(self, now: float) -> None:
        if self._last is not None and now < self._last:
            raise ValueError(f"the observer's clock went back: {now} < {self._last}")
        self._last = now

    def _heard_clock(self, now: float) -> float:
        """Observer time less every gap in which nobody was heard (an ongoing one included)."""
        ongoing = 0.0
        if self._last_heard is not None and now - self._last_heard > self.policy.blind_after_s:
            ongoing = now - self._last_heard
        return now - self._blind_s - ongoing

    def blind(self, now: float) -> bool:
        """Nobody heard within `blind_after_s` (or ever): no one can be judged."""
        return self._last_heard is None or now - self._last_heard > self.policy.blind_after_s

    # ------------------------------------------------------------------ inputs
    def started(self, worker_id: str, role: str, now: float, pid: int | None = None) -> None:
        """The observer (re)started `worker_id`: judged from now against `startup_s` until its
        first heartbeat. An open episode stays open: the restart's first beat ends it."""
        self._advance(now)
        old = self._workers.get(worker_id)
        self._workers[worker_id] = _Worker(
            role,
            since=self._heard_clock(now),
            silent_from=now,
            heard=False,
            pid=pid,
            host=old.host if old else None,
            episode=old.episode if old else None,
        )

    def beat(
        self, worker_id: str, role: str, now: float, pid: int | None = None, host: str | None = None
    ) -> None:
        self._advance(now)
        if self._last_heard is not None and now - self._last_heard > self.policy.blind_after_s:
            self._blind_s += now - self._last_heard  # nobody was heard: no one was silent
        self._last_heard = now
        w = self._workers.get(worker_id)
        if w is None:  # not started by the observer (joined from elsewhere): judged from now on
            w = self._workers[worker_id] = _Worker(role, since=0.0, silent_from=now, heard=True)
        elif not w.judged and (pid is None or pid == w.pid):
            return  # a late beat of a stopped incarnation
        if w.episode is not None and w.episode.back_at is None:
            w.episode.back_at = now
        w.since, w.silent_from, w.heard = self._heard_clock(now), now, True
        w.pid, w.host, w.judged, w.reported = pid if pid is not None else w.pid, host, True, False
        w.role = role

    def stopped(self, worker_id: str, now: float, pid: int | None = None) -> None:
        """`worker_id` stopped (its process exited, or it said so): not judged until it starts
        or beats again. A stop of another pid than the one last seen is an earlier incarnation's."""
        self._advance(now)
        w = self._workers.get(worker_id)
        if w is not None and (pid is None or w.pid is None or pid == w.pid):
            w.judged = False

    def step(self, step: int, now: float) -> list[Recovered]:
        """The trainer finished step `step`; a new one (higher than any before) is progress, and
        closes the episodes of workers that are back."""
        self._advance(now)
        if step <= self._best_step:
            return []  # a step redone after a trainer restart is not progress
        self._best_step = step
        self._progress.append(now)
        out = []
        for wid, w in self._workers.items():
            ep = w.episode
            if ep is None:
                continue
            ep.held_s = max(ep.held_s, now - ep.last_progress)
            ep.last_progress = now
            if ep.back_at is not None:
                out.append(Recovered(wid, w.role, ep.back_at - ep.silent_from, ep.held_s))
                w.episode = None
        return out

    # ------------------------------------------------------------------ decisions
    @property
    def _startup_s(self) -> float:
        return max(self.policy.startup_s, self.policy.frozen_after_s)

    def tick(self, now: float) -> list[Frozen]:
        """Workers found frozen now (each silence once)."""
        self._advance(now)
        if self.blind(now):
            return []
        heard_now = self._heard_clock(now)
        out = []
        for wid, w in self._workers.items():
            if not w.judged or w.reported:
                continue
            silent_s = heard_now - w.since
            if silent_s < (self.policy.frozen_after_s if w.heard else self._startup_s):
                continue
            w.reported = True
            if w.episode is None:
                w.episode = self._open(w.silent_from)
            out.append(Frozen(wid, w.role, silent_s, w.heard, w.pid, w.host))
        return out

    def _open(self, silent_from: float) -> _Episode:
        """An episode from `silent_from`, counting the steps already made since then."""
        before = [t for t in self._progress if t <= silent_from]
        after = [t for t in self._progress if t > silent_from]
        ep = _Episode(silent_from, last_progress=before[-1] if before else silent_from)
        for t in after:
            ep.held_s = max(ep.held_s, t - ep.last_progress)
            ep.last_progress = t
        return ep

    def frozen(self) -> list[str]:
        """Workers whose freeze is reported and who have not beaten since."""
        return [wid for wid, w in self._workers.items() if w.reported]
