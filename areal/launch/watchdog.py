"""The launcher's watchdog: names a frozen worker, has it killed and restarted, reports the cost.

The decisions are `areal.core.watchdog.Watchdog`'s; this shell feeds it from the launcher's
bus connection (every role's heartbeats, the trainer's steps, `worker_stopped` events) and the
launcher's own starts and exits, and acts on what it decides:
- `worker_frozen` (a warning in the launcher's log and an event on the bus): role, worker id,
  pid, host, seconds silent, the bound, and what was done. A worker this launcher started is
  SIGKILLed (`kill`): the launcher's crash path restarts it, and its leases, which a frozen
  process keeps alive on the server only through its open socket (no more `in_progress`), come
  back `nats.ack_wait_s` after its last lease heartbeat. A worker joined from another host is
  only named: nothing here can restart it;
- `worker_recovered` at the first new training step after the worker (or its restart) beat
  again: `down_s` (the worker out) and `held_s` (the longest the run went without a new step).

Publishing never holds up supervision: events go out in tasks, and a failed one is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import structlog

from areal.core.watchdog import Frozen, Recovered, Watchdog, WatchdogPolicy

log = structlog.get_logger()

WATCHED_ROLES = ("controller", "trainer", "rollout", "reward")


class LauncherWatchdog:
    def __init__(
        self,
        policy: WatchdogPolicy,
        kill: Callable[[str], int | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`kill(worker_id)`: SIGKILL that worker if this launcher started it and it runs;
        the pid killed, or None."""
        self.core = Watchdog(policy)
        self.kill, self.clock = kill, clock
        self.bus: Any = None  # areal.bus.client.Bus, once attached
        self.frozen: dict[str, Frozen] = {}  # worker id -> its report, until it is back
        self.reports: list[tuple[Frozen, str]] = []  # every report, with what was done
        self.recovered: list[Recovered] = []
        self._tasks: set[asyncio.Task] = set()
        self._subs: list[Any] = []

    async def attach(self, bus: Any) -> None:
        """Listen on `bus`: heartbeats of every role, and `worker_stopped` events."""
        self.bus = bus
        self._subs.append(await bus.subscribe_metrics("*", "heartbeat", self._on_beat))
        self._subs.append(await bus.subscribe_events("worker_stopped", self._on_stopped))

    async def _on_beat(self, rec: Any) -> None:
        if rec.role not in WATCHED_ROLES:
            return
        pid, host = rec.values.get("pid"), rec.values.get("host")
        pid = pid if isinstance(pid, int) else None
        self.core.beat(rec.worker_id, rec.role, self.clock(), pid, host)
        if self.frozen.pop(rec.worker_id, None) is not None:
            log.warning("worker_back", worker=rec.worker_id, pid=pid)

    async def _on_stopped(self, ev: Any) -> None:
        pid = ev.detail.get("pid")
        self.core.stopped(ev.worker_id, self.clock(), pid if isinstance(pid, int) else None)

    # ------------------------------------------------------------------ the launcher's side
    def started(self, worker_id: str, role: str, pid: int) -> None:
        self.core.started(worker_id, role, self.clock(), pid)

    def exited(self, worker_id: str, pid: int) -> None:
        self.core.stopped(worker_id, self.clock(), pid)

    def on_step(self, step: int) -> None:
        for rec in self.core.step(step, self.clock()):
            self.recovered.append(rec)
            detail = {
                "worker_id": rec.worker_id,
                "role": rec.role,
                "down_s": round(rec.down_s, 2),
                "held_s": round(rec.held_s, 2),
                "step": step,
            }
            log.warning("worker_recovered", **detail)
            self._publish("worker_recovered", detail)

    def tick(self) -> list[Frozen]:
        """Judge now; kill what froze (if it is this launcher's). Returns the new reports."""
        found = self.core.tick(self.clock())
        for f in found:
            pid = self.kill(f.worker_id)
            action = (
                f"SIGKILLed (pid {pid}); the launcher restarts it"
                if pid is not None
                else "none: not a process of this launcher (restart it where it runs)"
            )
            self.frozen[f.worker_id] = f
            self.reports.append((f, action))
            detail = {
                "worker_id": f.worker_id,
                "role": f.role,
                "pid": f.pid if f.pid is not None else pid,
                "host": f.host,
                "silent_s": round(f.silent_s, 2),
                "since": "heartbeat" if f.heard else "start (no heartbeat yet)",
                "frozen_after_s": self.core.policy.frozen_after_s
                if f.heard
                else max(self.core.policy.startup_s, self.core.policy.frozen_after_s),
                "action": action,
            }
            log.warning("worker_frozen", **detail)
            self._publish("worker_frozen", detail)
        return found

    def report(self) -> list[str]:
        """One line per freeze, for the end of the run: who, how long, what it cost."""
        lines = []
        for f, action in self.reports:
            since = "its last heartbeat" if f.heard else "its start"
            line = f"watchdog: {f.worker_id} froze ({f.silent_s:.1f} s without a heartbeat "
            line += f"since {since}); {action.split(';')[0]}"
            rec = next((r for r in self.recovered if r.worker_id == f.worker_id), None)
            if rec is not None:
                line += f"; out {rec.down_s:.1f} s, the run held {rec.held_s:.1f} s"
            lines.append(line)
        return lines

    def _publish(self, kind: str, detail: dict[str, Any]) -> None:
        if self.bus is None:
            return
        task = asyncio.ensure_future(self._send(kind, detail))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, kind: str, detail: dict[str, Any]) -> None:
        try:
            await self.bus.event(kind, **detail)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the log line above already names the worker
            log.error("watchdog_event_failed", kind=kind, error=f"{type(e).__name__}: {e}")

    async def close(self, flush_s: float = 5.0) -> None:
        """Give pending events `flush_s` to go out, then stop listening."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=flush_s)
        for task in list(self._tasks):
            task.cancel()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
