"""RunState: everything the monitors show, folded from bus messages. Pure (no I/O, no clock).

`areal top`, the Prometheus exporter and the tests all fold the same messages through this
module, so a number means the same thing everywhere. Invariants:
- folding is idempotent per step (a replayed step record replaces, never double-counts) and
  order-tolerant (history replay and live messages may interleave);
- every derived figure takes `now` as an argument, so it is testable without a clock;
- rates come from counters and timestamps carried by the messages themselves (heartbeat
  counters, step `wall_s`), so a replayed history yields the same rates as watching live;
- a storage pause (`storage_full` / `write_failed` ... `storage_recovered`, keyed by worker
  and the pause's `since`) is open until its recovery is folded, in whichever order they come.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from areal.monitor.format import expand
from schemas import (
    DeadLetter,
    Event,
    Message,
    MetricRecord,
    Sample,
    SampleGroup,
    ScoredGroup,
    ScoredSample,
)

LIVE_S = 10.0  # a worker heard from within this many seconds is live
SEEN_S = 120.0  # a worker heard from within this many seconds is still listed
RATE_WINDOW_S = 20.0
STEP_RATE_WINDOW = 5  # steps
ROLES = ("controller", "rollout", "reward", "trainer")
STORAGE_PAUSED = ("storage_full", "write_failed")
WATCHDOG_EVENTS = ("worker_frozen", "worker_recovered")  # the launcher's, about a worker


@dataclass
class WorkerView:
    role: str
    worker_id: str
    last_seen: float
    values: dict[str, Any] = field(default_factory=dict)  # latest heartbeat values
    # (time, cumulative samples, cumulative tokens) from heartbeats
    counters: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=64))
    # its latest `worker_frozen` report (the watchdog's), until it or its restart beats again
    frozen: dict[str, Any] | None = None

    @property
    def idle_frac(self) -> float | None:
        busy = self.values.get("busy_frac")
        return None if busy is None else max(0.0, 1.0 - float(busy))

    def rate(self, now: float, window_s: float = RATE_WINDOW_S) -> tuple[float, float] | None:
        """(samples/s, tokens/s) over the window, from the heartbeat counters."""
        pts = [p for p in self.counters if p[0] >= now - window_s]
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
            dt = pts[-1][0] - pts[0][0]
            return (pts[-1][1] - pts[0][1]) / dt, (pts[-1][2] - pts[0][2]) / dt
        return None


@dataclass
class RunState:
    run_id: str = ""
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    workers: dict[str, WorkerView] = field(default_factory=dict)
    admission: dict[str, Any] = field(default_factory=dict)
    events: Counter[str] = field(default_factory=Counter)
    recent_events: deque[tuple[float, str, str]] = field(default_factory=lambda: deque(maxlen=8))
    dlq: Counter[str] = field(default_factory=Counter)
    dlq_reasons: dict[str, str] = field(default_factory=dict)  # stage -> latest reason
    queues: dict[str, dict[str, Any]] = field(default_factory=dict)  # stream -> QueueStats dict
    kv: dict[str, dict] = field(default_factory=dict)
    evals: dict[int, dict[str, Any]] = field(default_factory=dict)  # eval round -> its record
    finished: dict[str, Any] | None = None  # the run_finished detail, until a new launch
    # a launch (`run_started`, e.g. --resume extending a finished run) came after the last
    # run_finished: the trainer's `done` in KV is the earlier launch's until it resets it
    relaunched: bool = False
    # observed work-queue traffic: role -> [(time, tokens)], and when observation began
    activity: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    observing_since: float | None = None
    # storage pauses: "<worker>@<since>" -> the pause's event detail (+ "recovered": its detail)
    storage: dict[str, dict[str, Any]] = field(default_factory=dict)

    # ------------------------------------------------------------------ folding
    def fold(self, msg: Message, received_at: float | None = None) -> None:
        if isinstance(msg, SampleGroup | ScoredGroup):
            for part in expand(msg):
                self.fold(part, received_at)
        elif isinstance(msg, MetricRecord):
            self.fold_metric(msg)
        elif isinstance(msg, Event):
            self.fold_event(msg)
        elif isinstance(msg, DeadLetter):
            self.fold_dead_letter(msg)
        elif isinstance(msg, ScoredSample) and received_at is not None:
            self.fold_activity(
                "reward", msg.reward_worker_id, received_at, len(msg.sample.output_ids)
            )
        elif isinstance(msg, Sample) and received_at is not None:
            self.fold_activity("rollout", msg.worker_id, received_at, len(msg.output_ids))

    def _worker(self, role: str, worker_id: str, t: float) -> WorkerView:
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = WorkerView(role, worker_id, t)
        w.last_seen = max(w.last_seen, t)
        return w

    def fold_metric(self, rec: MetricRecord) -> None:
        w = self._worker(rec.role, rec.worker_id, rec.time)
        v = rec.values
        if rec.type == "heartbeat":
            if w.frozen is not None and rec.time > w.frozen["_time"]:
                w.frozen = None  # it (or its restart) beats again
            if not w.values or rec.time >= w.values.get("_time", 0.0):
                w.values = {**v, "_time": rec.time}
            if "samples" in v or "tokens" in v:
                w.counters.append((rec.time, float(v.get("samples", 0)), float(v.get("tokens", 0))))
                w.counters = deque(sorted(w.counters), maxlen=w.counters.maxlen)
        elif rec.type == "step" and "step" in v:
            self.steps[int(v["step"])] = {**v, "_time": rec.time}
        elif rec.type == "eval" and "round" in v:
            self.evals[int(v["round"])] = {**v, "_time": rec.time}
        elif rec.type == "admission" and rec.time >= self.admission.get("_time", 0.0):
            self.admission = {**v, "_time": rec.time}

    def fold_event(self, ev: Event) -> None:
        self.events[ev.type] += 1
        self.recent_events.append((ev.time, ev.type, ev.worker_id))
        if ev.type in WATCHDOG_EVENTS:
            self.fold_watchdog(ev)
        elif ev.worker_id and ev.role != "launcher":  # the launcher is no worker
            self._worker(ev.role, ev.worker_id, ev.time)
        if ev.type == "run_finished":
            self.finished, self.relaunched = dict(ev.detail), False
        elif ev.type == "run_started":
            self.finished, self.relaunched = None, True
        if ev.type in (*STORAGE_PAUSED, "storage_recovered") and "since" in ev.detail:
            pause = self.storage.setdefault(f"{ev.worker_id}@{ev.detail['since']}", {})
            if ev.type == "storage_recovered":
                pause["recovered"] = dict(ev.detail)
            else:
                pause.update(ev.detail, kind=ev.type, worker_id=ev.worker_id)

    def fold_watchdog(self, ev: Event) -> None:
        """The launcher's watchdog about a worker (`detail.worker_id`): mark it frozen, or not.
        The launcher itself is no worker, and the report is no sign of life of the worker."""
        wid, role = ev.detail.get("worker_id"), ev.detail.get("role")
        if not isinstance(wid, str) or not isinstance(role, str):
            return
        w = self.workers.get(wid)
        if ev.type == "worker_recovered":
            if w is not None and w.frozen is not None and ev.time >= w.frozen["_time"]:
                w.frozen = None
            return
        if w is None:
            silent_s = float(ev.detail.get("silent_s") or 0.0)
            w = self.workers[wid] = WorkerView(role, wid, ev.time - silent_s)
        if w.frozen is None or ev.time >= w.frozen["_time"]:
            w.frozen = {**ev.detail, "_time": ev.time}

    def fold_dead_letter(self, dl: DeadLetter) -> None:
        self.dlq[dl.stage] += 1
        self.dlq_reasons[dl.stage] = dl.reason

    def fold_activity(self, role: str, worker_id: str, t: float, tokens: int) -> None:
        """A pipeline message seen on a work-queue stream (by a core subscription)."""
        self.activity.setdefault(role, deque(maxlen=100_000)).append((t, tokens))
        if worker_id:
            self._worker(role, worker_id, t)

    def set_queues(self, stats: dict[str, dict[str, Any]]) -> None:
        self.queues = stats

    # ------------------------------------------------------------------ derived
    def is_finished(self) -> bool:
        """The run ended: its run_finished event, or its trainer's `done` when no launch began
        after the last run_finished (events replay in stream order)."""
        done = bool(self.kv.get("trainer", {}).get("done"))
        return self.finished is not None or (done and not self.relaunched)

    def storage_pause(self) -> dict[str, Any] | None:
        """The storage pause under way (the latest, if several workers pause), or None."""
        open_ = [p for p in self.storage.values() if "recovered" not in p and "kind" in p]
        return max(open_, key=lambda p: float(p["since"]), default=None)

    def last_storage_recovery(self) -> dict[str, Any] | None:
        """The detail of the latest `storage_recovered` (`paused_s`, `path`, ...), or None."""
        done = [p["recovered"] for p in self.storage.values() if "recovered" in p]
        return max(done, key=lambda r: float(r["since"]), default=None)

    def step_records(self) -> list[dict[str, Any]]:
        return [self.steps[k] for k in sorted(self.steps)]

    @property
    def last_step(self) -> dict[str, Any] | None:
        return self.steps[max(self.steps)] if self.steps else None

    @property
    def version(self) -> int:
        candidates = [int(s.get("version", 0)) for s in self.steps.values()]
        candidates += [
            int(w.values.get("version", 0))
            for w in self.workers.values()
            if w.role == "trainer" and w.values
        ]
        candidates.append(int(self.kv.get("trainer", {}).get("version", 0)))
        return max(candidates)

    def step_rate(self, window: int = STEP_RATE_WINDOW) -> float | None:
        """Steps per second over the last `window` steps (by the trainer's wall clock)."""
        recs = self.step_records()[-(window + 1) :]
        if len(recs) < 2:
            return None
        dt = float(recs[-1].get("wall_s", 0)) - float(recs[0].get("wall_s", 0))
        return (len(recs) - 1) / dt if dt > 0 else None

    def reward_series(self, key: str = "reward_mean") -> list[float]:
        return [float(r[key]) for r in self.step_records() if r.get(key) is not None]

    def eval_series(self) -> list[tuple[int, float]]:
        """(policy version, held-out reward) of every evaluation round seen, by round."""
        return [
            (int(r["version"]), float(r["eval_reward"]))
            for _, r in sorted(self.evals.items())
            if r.get("eval_reward") is not None
        ]

    def staleness_totals(self, key: str = "staleness_hist") -> dict[int, int]:
        """Sample lag -> count, summed over every step seen."""
        out: Counter[int] = Counter()
        for rec in self.steps.values():
            for lag, n in (rec.get(key) or {}).items():
                out[int(lag)] += int(n)
        return dict(sorted(out.items()))

    def workers_by_role(self, now: float, within_s: float = SEEN_S) -> dict[str, list[WorkerView]]:
        out: dict[str, list[WorkerView]] = {}
        for w in sorted(self.workers.values(), key=lambda w: w.worker_id):
            if now - w.last_seen <= within_s:
                out.setdefault(w.role, []).append(w)
        return out

    def live_workers(self, now: float) -> dict[str, list[WorkerView]]:
        return self.workers_by_role(now, LIVE_S)

    def throughput(
        self, now: float, window_s: float = RATE_WINDOW_S
    ) -> dict[str, tuple[float, float]]:
        """Role -> (samples/s, tokens/s): heartbeat counters, else observed traffic, else steps."""
        out: dict[str, tuple[float, float]] = {}
        for role, workers in self.live_workers(now).items():
            rates = [r for w in workers if (r := w.rate(now, window_s)) is not None]
            if rates:
                out[role] = (sum(r[0] for r in rates), sum(r[1] for r in rates))
        for role, seen in self.activity.items():
            if role in out or self.observing_since is None:
                continue
            span = min(window_s, now - self.observing_since)
            recent = [tok for t, tok in seen if t >= now - span]
            if span > 0:
                out[role] = (len(recent) / span, sum(recent) / span)
        recs = self.step_records()[-(STEP_RATE_WINDOW + 1) :]
        if len(recs) >= 2:
            dt = float(recs[-1].get("wall_s", 0)) - float(recs[0].get("wall_s", 0))
            if dt > 0:
                n = sum(int(r.get("samples", 0)) for r in recs[1:])
                tok = sum(int(r.get("tokens", 0)) for r in recs[1:])
                out["trainer"] = (n / dt, tok / dt)
        return out

    def idle(self, now: float) -> dict[str, float]:
        """Role -> mean idle fraction (1 - busy_frac) of its live workers."""
        out: dict[str, float] = {}
        for role, workers in self.live_workers(now).items():
            fr = [f for w in workers if (f := w.idle_frac) is not None]
            if fr:
                out[role] = sum(fr) / len(fr)
        last = self.last_step
        if "trainer" not in out and last and last.get("trainer_idle_frac") is not None:
            out["trainer"] = float(last["trainer_idle_frac"])
        return out

    def weight_times(self, now: float) -> dict[str, float | None]:
        """Trainer publish time (last, mean) and rollout load time per load (mean over workers)."""
        pub = [
            float(r["weights_publish_s"])
            for r in self.step_records()
            if r.get("weights_publish_s") is not None
        ]
        loads = [
            w.values["weight_load_s"] / w.values["weight_loads"]
            for ws in self.live_workers(now).values()
            for w in ws
            if w.values.get("weight_loads")
        ]
        return {
            "publish_last_s": pub[-1] if pub else None,
            "publish_mean_s": sum(pub) / len(pub) if pub else None,
            "load_mean_s": sum(loads) / len(loads) if loads else None,
        }

    def dlq_counts(self) -> dict[str, int]:
        """Stage -> dead letters stored (stream per-subject counts), or folded when unknown."""
        counts = dict(self.dlq)
        for subject, n in (self.queues.get("dlq", {}).get("subjects") or {}).items():
            stage = subject.rsplit(".", 1)[-1]
            counts[stage] = max(counts.get(stage, 0), int(n))
        return dict(sorted(counts.items()))

    def interrupted_frac(self) -> tuple[float | None, float | None]:
        """(last step, mean over steps) fraction of samples that were interrupted."""
        fr = [
            float(r["interrupted_frac"])
            for r in self.step_records()
            if r.get("interrupted_frac") is not None
        ]
        return (fr[-1], sum(fr) / len(fr)) if fr else (None, None)
