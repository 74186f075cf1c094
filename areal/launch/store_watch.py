"""The embedded nats-server's store on a disk that filled up: restart the server once there is
room again, so the run goes on by itself.

nats-server stops writing to a stream after a write error (a full disk) and, by design, does
not try again until it is restarted (`filestore.setWriteErr`): the publishes of every worker
then wait unanswered, even after the disk has room again. The launcher owns the embedded
server, so it watches for that (`EmbeddedNats.store_write_error`: the monitor's `/healthz`)
and restarts the server on its store and port; the workers ride through the restart as
through any outage (publishes retried with the same message ids).

Invariants:
- the store is asked at most every `poll_s`; a write error is reported once per pause
  (`storage_full`, or `write_failed` for another disk error), with the store dir and the
  server's error, and `storage_recovered` (with `paused_s` and the restarts it took) once the
  restarted server is healthy;
- the server is restarted only while the store's filesystem has `min_free_bytes` free (a
  server started on a full disk cannot even write its log), at most every `delay` (1 s
  doubling to 30 s while restarts do not heal it); a restart that fails leaves the server
  stopped (its death watch ignores a stopped server) and is tried again later.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import structlog

from areal.bus.errors import FULL_TEXTS

log = structlog.get_logger()

POLL_S = 2.0
MIN_FREE_BYTES = 16 * 2**20
FIRST_DELAY_S, MAX_DELAY_S = 1.0, 30.0


class Store(Protocol):
    """What the watch needs of `EmbeddedNats`."""

    store_dir: Path

    def store_write_error(self) -> str | None: ...
    def restart(self) -> object: ...


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


class StoreWatch:
    def __init__(
        self,
        server: Store,
        *,
        poll_s: float = POLL_S,
        min_free_bytes: int = MIN_FREE_BYTES,
        free_bytes: Callable[[Path], int] = _free_bytes,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.server, self.poll_s, self.min_free_bytes = server, poll_s, min_free_bytes
        self._free_bytes, self._clock = free_bytes, clock
        self.failed_since: float | None = None  # when the write error was first seen
        self.restarts = 0  # restarts in the pause under way
        self.pauses = 0
        self._next_check = 0.0
        self._next_restart = 0.0
        self._delay = FIRST_DELAY_S
        self._restarted = False  # restarted since the last look: a healthy answer ends the pause
        self._waiting_logged = False

    def check(self) -> None:
        """One look (call it often: it acts at most every `poll_s`, or when a restart is due)."""
        now = self._clock()
        if now < self._next_check:
            return
        self._next_check = now + self.poll_s
        if self.failed_since is None:
            error = self.server.store_write_error()
            if error is not None:
                self._failed(now, error)
                self._try_restart(now)
            return
        if self._restarted:
            if self.server.store_write_error() is None:
                self._recovered(now)
                return
            self._restarted = False  # the restart did not heal it: the next one waits longer
        self._try_restart(now)

    def _failed(self, now: float, error: str) -> None:
        self.failed_since, self.restarts, self._delay = now, 0, FIRST_DELAY_S
        self.pauses += 1
        self._next_restart = now
        self._restarted = self._waiting_logged = False
        kind = "storage_full" if any(t in error.lower() for t in FULL_TEXTS) else "write_failed"
        store = str(self.server.store_dir)
        log.error(kind, what="nats_store", path=store, error=error[:500])
        print(
            f"the embedded nats-server cannot write its store ({error[:200]}); it is restarted "
            f"once {store} has room again (workers wait meanwhile)",
            file=sys.stderr,
        )

    def _try_restart(self, now: float) -> None:
        if now < self._next_restart:
            self._next_check = min(self._next_check, self._next_restart)
            return
        store = self.server.store_dir
        try:
            free = self._free_bytes(store)
        except OSError:
            free = 0
        if free < self.min_free_bytes:
            if not self._waiting_logged:
                self._waiting_logged = True
                log.warning("nats_store_waiting_for_space", path=str(store), free_bytes=free)
            self._next_check = min(self._next_check, now + FIRST_DELAY_S)  # room may come soon
            return
        self.restarts += 1
        self._next_restart = now + self._delay
        self._delay = min(self._delay * 2, MAX_DELAY_S)
        try:
            self.server.restart()  # a failed start leaves it stopped: its death watch skips it
        except (OSError, RuntimeError) as e:  # TimeoutError is an OSError
            log.warning("nats_server_restart_failed", error=f"{type(e).__name__}: {e}"[:300])
            self._next_check = min(self._next_check, self._next_restart)
            return
        self._restarted = True
        self._next_check = min(self._next_check, self._clock() + 0.5)  # healthy now?
        log.warning("nats_server_restarted", reason="store write error", restarts=self.restarts)

    def _recovered(self, now: float) -> None:
        assert self.failed_since is not None
        paused_s = now - self.failed_since
        log.warning(
            "storage_recovered",
            what="nats_store",
            path=str(self.server.store_dir),
            paused_s=round(paused_s, 2),
            restarts=self.restarts,
        )
        print(
            f"the embedded nats-server writes its store again ({paused_s:.1f} s after the "
            f"error, {self.restarts} restart(s))",
            file=sys.stderr,
        )
        self.failed_since = None
        self._restarted = False
