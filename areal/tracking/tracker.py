"""Hand the trainer's records to experiment trackers without ever holding the trainer back.

Invariants:
- `Tracker.log_step` / `log_eval` only put the record on each tracker's bounded queue
  (`put_nowait`): constant time, never blocking, never raising. A full queue drops the record
  for that tracker and counts it (`TrackerStats.dropped`), with one warning per tracker;
- each tracker (`Backend`) lives on a daemon thread of its own, which opens it (handing it the
  run's config, once), writes every record and closes it: a slow or hung tracker delays neither
  the trainer nor the other trackers;
- a tracker that raises anywhere (its import, opening, a write, closing) warns once
  (`tracker_failed`, naming the tracker and the fix) and is switched off: whatever it still
  had or gets is dropped and counted; nothing it raises reaches the caller;
- `close(timeout_s)` lets every thread write what is queued and close its tracker, waiting for
  all of them together at most `timeout_s`; a thread still busy then is left behind (it is a
  daemon: the process still exits) and reported (`tracker_abandoned`).
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

log = structlog.get_logger()


@dataclass(frozen=True)
class Record:
    """Scalars of one step record or eval round, named `train/<field>` or `eval/<field>`,
    at `step` on the axis `axis` (`train/step`, or `eval/version` for an eval round)."""

    axis: str
    step: int
    values: dict[str, float]


class Backend(Protocol):
    """One tracker. Its methods run on the tracker's own thread only, and may raise."""

    name: str

    def open(self, config: dict[str, Any]) -> None: ...
    def log(self, rec: Record) -> None: ...
    def close(self) -> None: ...
    def fix(self, error: BaseException) -> str:
        """What the user can do about `error` (one clause, for the warning)."""
        ...


@dataclass
class TrackerStats:
    logged: int = 0  # records the tracker took
    dropped: int = 0  # records it never got: its queue was full, or it had failed
    error: str | None = None  # why it was switched off
    abandoned: bool = False  # still busy when close() gave up waiting


def scalars(rec: dict[str, Any], *, skip: tuple[str, ...] = ()) -> dict[str, float]:
    """Numeric fields of a record; nested dicts (`staleness_hist`) flattened with '/'."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        if k in skip or k.startswith("_"):
            continue
        if isinstance(v, bool | int | float):
            out[k] = float(v)
        elif isinstance(v, dict):
            for kk, vv in v.items():
                if isinstance(vv, int | float) and not isinstance(vv, bool):
                    out[f"{k}/{kk}"] = float(vv)
    return out


def step_record(rec: dict[str, Any]) -> Record:
    """A `metrics.jsonl` step record as `train/<field>` scalars at its step."""
    values = scalars(rec, skip=("step",))
    return Record("train/step", int(rec["step"]), {f"train/{k}": v for k, v in values.items()})


def eval_record(rec: dict[str, Any]) -> Record:
    """An `eval.jsonl` round as `eval/<field>` scalars (`eval_reward` -> `eval/reward`) at the
    policy version it evaluated."""
    values = scalars(rec, skip=("version", "time"))
    return Record(
        "eval/version",
        int(rec.get("version", 0)),
        {f"eval/{k.removeprefix('eval_')}": v for k, v in values.items()},
    )


_END = object()


class _Lane:
    """One backend: its queue, its thread and its counts."""

    def __init__(self, backend: Backend, config: dict[str, Any], queue_size: int) -> None:
        self.backend, self.config = backend, config
        self.q: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self.stats = TrackerStats()
        self._lock = threading.Lock()
        self._warned_full = False
        self.failed = threading.Event()
        ctx = contextvars.copy_context()  # the worker's bound log context (role, worker_id)
        self.thread = threading.Thread(
            target=ctx.run, args=(self._serve,), name=f"areal-tracker-{backend.name}", daemon=True
        )

    def put(self, item: Any) -> None:
        if self.failed.is_set():
            self._drop(1)
            return
        try:
            self.q.put_nowait(item)
        except queue.Full:
            self._drop(1)
            if not self._warned_full:
                self._warned_full = True
                log.warning(
                    "tracker_queue_full",
                    tracker=self.backend.name,
                    queue_size=self.q.maxsize,
                    fix="records for it are dropped and counted while it catches up; "
                    "raise tracking.queue_size or drop the tracker",
                )

    def _drop(self, n: int) -> None:
        with self._lock:
            self.stats.dropped += n

    def _serve(self) -> None:
        b = self.backend
        item: Any = None
        try:
            b.open(self.config)
            while (item := self.q.get()) is not _END:
                b.log(item)
                self.stats.logged += 1
                item = None
            b.close()
        except Exception as e:
            self._fail(e, lost=int(item is not None and item is not _END))

    def _fail(self, e: Exception, *, lost: int) -> None:
        self.failed.set()
        self.stats.error = f"{type(e).__name__}: {e}"[:500]
        try:
            fix = self.backend.fix(e)
        except Exception:
            fix = "see the error"
        log.warning(
            "tracker_failed",
            tracker=self.backend.name,
            error=self.stats.error,
            fix=f"{fix}; it is off for the rest of this run, training goes on",
        )
        n = lost  # the record it failed on, and what it had queued, will never be written
        while True:
            try:
                if self.q.get_nowait() is not _END:
                    n += 1
            except queue.Empty:
                break
        self._drop(n)


class Tracker:
    """The trainer's handle on its trackers: `start()`, `log_step` / `log_eval` per record,
    `close()` at the end (each safe to call from the event loop: none waits on a tracker but
    `close`, which the caller runs in a thread)."""

    def __init__(
        self,
        backends: list[Backend],
        *,
        config: dict[str, Any],
        queue_size: int = 1000,
        close_timeout_s: float = 10.0,
    ) -> None:
        self.lanes = [_Lane(b, config, queue_size) for b in backends]
        self.close_timeout_s = close_timeout_s
        self._started = self._closed = False

    @property
    def names(self) -> list[str]:
        return [lane.backend.name for lane in self.lanes]

    def start(self) -> None:
        if not self._started:
            self._started = True
            for lane in self.lanes:
                lane.thread.start()
            log.info("tracking_started", trackers=self.names)

    def log_step(self, rec: dict[str, Any]) -> None:
        self._put(step_record, rec)

    def log_eval(self, rec: dict[str, Any]) -> None:
        self._put(eval_record, rec)

    def _put(self, convert: Any, rec: dict[str, Any]) -> None:
        if self._closed or not self.lanes:
            return
        try:
            item = convert(rec)
        except Exception as e:  # a record without its axis: never the trainer's problem
            log.warning("tracker_record_skipped", error=repr(e)[:200])
            return
        for lane in self.lanes:
            lane.put(item)

    def stats(self) -> dict[str, TrackerStats]:
        return {lane.backend.name: lane.stats for lane in self.lanes}

    def close(self, timeout_s: float | None = None) -> dict[str, TrackerStats]:
        """Write what is queued and close every tracker, waiting `timeout_s` (default
        `close_timeout_s`) at most in all (blocking: run it off the event loop); the counts
        per tracker."""
        timeout_s = self.close_timeout_s if timeout_s is None else timeout_s
        if self._closed:
            return self.stats()
        self._closed = True
        waiting = []  # lanes whose queue is full: the end marker waits for room
        for lane in self.lanes:
            if lane.thread.is_alive():
                try:
                    lane.q.put_nowait(_END)
                except queue.Full:
                    waiting.append(lane)
        deadline = time.monotonic() + timeout_s
        for lane in self.lanes:
            if lane in waiting:
                with contextlib.suppress(queue.Full):
                    lane.q.put(_END, timeout=max(0.0, deadline - time.monotonic()))
            if self._started:
                lane.thread.join(max(0.0, deadline - time.monotonic()))
            if lane.thread.is_alive():
                lane.stats.abandoned = True
                log.warning(
                    "tracker_abandoned",
                    tracker=lane.backend.name,
                    queued=lane.q.qsize(),
                    waited_s=timeout_s,
                    fix="it did not finish within tracking.close_timeout_s: its last records "
                    "may be missing; raise the timeout, or check the tracker's server",
                )
            # what is still queued will not be written (an abandoned or failed tracker)
            with lane.q.mutex:
                left = sum(1 for item in lane.q.queue if item is not _END)
            lane._drop(left)
        if self.lanes:
            log.info(
                "tracking_closed",
                **{
                    name: {k: v for k, v in vars(s).items() if v is not None and v is not False}
                    for name, s in self.stats().items()
                },
            )
        return self.stats()
