"""Small pieces every service uses: heartbeats and a busy-time meter.

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

from areal.bus.client import Bus
from areal.core.watchdog import HEARTBEAT_S


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
