"""Small pieces every service uses: heartbeats, a periodic stats log line and a busy-time meter.

A heartbeat names its process (`pid`, `host`), so the watchdog that finds it silent
(`areal.core.watchdog`) can say which process froze, on which host."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import structlog

from areal.bus.client import Bus
from areal.core.watchdog import HEARTBEAT_S

log = structlog.get_logger()


class BusyMeter:
    """Fraction of wall time spent working (the rest is idle: waiting for input)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.busy_s = 0.0
        self._since: float | None = None

    def start(self) -> None:
        self._since = time.monotonic()

    def stop(self) -> None:
        if self._since is not None:
            self.busy_s += time.monotonic() - self._since
            self._since = None

    def busy_frac(self) -> float:
        running = time.monotonic() - self._since if self._since is not None else 0.0
        wall = max(1e-9, time.monotonic() - self.t0)
        return min(1.0, (self.busy_s + running) / wall)


async def heartbeat_loop(
    bus: Bus,
    stats: Callable[[], dict[str, Any]],
    stop: asyncio.Event,
    period_s: float = HEARTBEAT_S,
) -> None:
    """Publish `metrics.<role>.heartbeat` every period until stopped (for `areal top` and the
    watchdog)."""
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    while not stop.is_set():
        with contextlib.suppress(Exception):
            await bus.metric("heartbeat", {**stats(), **me})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)


async def stats_log_loop(
    event: str,
    stats: Callable[[], dict[str, Any]],
    stop: asyncio.Event,
    period_s: float,
) -> None:
    """Log `event` with `stats()` every `period_s` until stopped, skipping a period in which
    nothing changed (an idle replica does not fill its log); the caller logs the final counts."""
    last: dict[str, Any] | None = None
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)
        if stop.is_set():
            return
        now = stats()
        if now != last:
            log.info(event, **now)
            last = now
