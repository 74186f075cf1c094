"""One controller and one trainer per run: a renewed lock in the run's KV bucket.

Two trainers on one run would each take part of the rewards stream and publish versions of
their own; two controllers would admit every task twice. Replicas of rollout and reward are
interchangeable; these two roles are not. So each holds `lock.<role>` (`RoleLockState`) while
it serves the run, and a second instance refuses to start with the holder's identity.

Invariants:
- at most one holder per role and run: the key is taken by create (nobody holds it) or by a
  compare-and-set on the revision read, after that revision stood still (no renewal) for
  `nats.role_lock_ttl_s` by the taker's own monotonic clock (no clock is compared across
  hosts); a restart under the holder's worker id (the launcher restarts a worker under its id)
  waits only 2 renewal periods: a live duplicate with the same id renews within one;
- a holder renews every ttl/5 with a compare-and-set; if the key moved and is no longer its
  own (its `token`), it lost the lock (`RoleLockLost`): the worker stops with an error. The
  window in which two could act is one renewal period, and only after a holder stalled for a
  whole ttl;
- a second instance that sees the holder renew gets `RoleLockHeld` at once (within one renewal
  period), naming the holder and the fix; it is a deterministic failure (not restarted);
- a clean stop deletes the lock (compare-and-set), so the next start takes it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from collections.abc import Awaitable
from dataclasses import dataclass, field

import structlog

from areal.bus.client import Bus
from schemas.state import ROLE_LOCK_PREFIX, RoleLockState

log = structlog.get_logger()

POLL_S = 0.25  # how often a waiting instance re-reads the lock
SAME_ID_PERIODS = 2.0  # renewal periods a restart under the holder's worker id waits


class RoleLockHeld(Exception):
    """Another live instance of this role serves the run."""


class RoleLockLost(Exception):
    """This instance's lock was taken over (it stalled past the ttl, or a duplicate with its
    worker id took over): it must stop serving the run."""


def lock_key(role: str) -> str:
    return f"{ROLE_LOCK_PREFIX}{role}"


@dataclass
class RoleLock:
    """The lock of `role` for this process; `acquire`, then `renew_forever`, then `release`."""

    bus: Bus
    role: str
    worker_id: str
    ttl_s: float
    state: RoleLockState = field(init=False)
    revision: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.key = lock_key(self.role)
        self.state = RoleLockState(
            worker_id=self.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            token=secrets.token_hex(8),
        )

    @property
    def period_s(self) -> float:
        return self.ttl_s / 5

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Take the lock, waiting out a dead holder: True once held, False when `stop` was set
        first; `RoleLockHeld` when a live holder renews it."""
        loop = asyncio.get_running_loop()
        seen: tuple[int, float] | None = None  # (revision, when this process first saw it)
        while not stop.is_set():
            got = await self.bus.kv_get_rev(self.key, RoleLockState)
            if got is None:
                rev = await self.bus.kv_create_rev(self.key, self.state)
                if rev is not None or await self._is_mine():
                    self.revision = rev if rev is not None else self.revision
                    log.info("role_lock_acquired", role=self.role, key=self.key)
                    return True
                continue  # someone created it first: read who
            holder, rev = got
            if holder.token == self.state.token:  # our own create, its answer was lost
                self.revision = rev
                return True
            now = loop.time()
            if seen is None or seen[0] != rev:
                if seen is not None:  # it moved while this process watched: a live holder
                    raise RoleLockHeld(self._held_message(holder))
                seen = (rev, now)
                log.info(
                    "role_lock_waiting",
                    role=self.role,
                    holder=holder.worker_id,
                    host=holder.host,
                    pid=holder.pid,
                    takeover_after_s=round(self._wait_s(holder), 1),
                )
            elif now - seen[1] >= self._wait_s(holder):
                new = await self.bus.kv_update(self.key, self.state, last=rev)
                if new is not None or await self._is_mine():
                    self.revision = new if new is not None else self.revision
                    log.warning(
                        "role_lock_taken_over",
                        role=self.role,
                        previous=holder.worker_id,
                        host=holder.host,
                        pid=holder.pid,
                        stale_s=round(now - seen[1], 1),
                    )
                    return True
                continue  # another instance took it over first: it moved, so it is live
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)
        return False

    def _wait_s(self, holder: RoleLockState) -> float:
        if holder.worker_id == self.worker_id:
            return min(self.ttl_s, SAME_ID_PERIODS * self.period_s)
        return self.ttl_s

    async def refuse_if_held(self) -> None:
        """A cheap look before a long prepare (loading a model): `RoleLockHeld` when the lock
        is renewed within 1.5 renewal periods; returns when it is free or stands still (its
        holder may be dead: `acquire` decides later, after the prepare)."""
        got = await self.bus.kv_get_rev(self.key, RoleLockState)
        if got is None:
            return
        loop = asyncio.get_running_loop()
        until = loop.time() + 1.5 * self.period_s
        while loop.time() < until:
            await asyncio.sleep(POLL_S)
            now = await self.bus.kv_get_rev(self.key, RoleLockState)
            if now is None:
                return
            if now[1] != got[1]:
                raise RoleLockHeld(self._held_message(now[0]))

    async def _is_mine(self) -> bool:
        """After a write whose answer may have been lost: whether the key holds our token
        (and then take its revision)."""
        got = await self.bus.kv_get_rev(self.key, RoleLockState)
        if got is not None and got[0].token == self.state.token:
            self.revision = got[1]
            return True
        return False

    def _held_message(self, holder: RoleLockState) -> str:
        return (
            f"config error: run {self.bus.names.run_id!r} already has a {self.role}: worker "
            f"{holder.worker_id!r} on host {holder.host!r} (pid {holder.pid}) holds "
            f"{self.key!r} and renews it; a run has one controller and one trainer (scale "
            "rollout and reward instead). Stop that one first, or give this one another "
            f"run_id. (A holder that died is taken over after nats.role_lock_ttl_s = "
            f"{self.ttl_s:g} s.)"
        )

    async def renew(self) -> None:
        """One renewal; `RoleLockLost` when the key is no longer ours."""
        self.state = self.state.model_copy(update={"renewals": self.state.renewals + 1})
        rev = await self.bus.kv_update(self.key, self.state, last=self.revision)
        if rev is not None:
            self.revision = rev
            return
        if await self._is_mine():  # the write went through, its answer was lost
            return
        got = await self.bus.kv_get_rev(self.key, RoleLockState)
        who = "nobody" if got is None else f"worker {got[0].worker_id!r} on {got[0].host!r}"
        raise RoleLockLost(
            f"config error: the {self.role} lock of run {self.bus.names.run_id!r} was taken "
            f"over ({who} holds it now): this {self.role} stalled for more than "
            f"nats.role_lock_ttl_s = {self.ttl_s:g} s, or a second one was started with its "
            "worker id; it stops so the run has one"
        )

    async def renew_forever(self, stop: asyncio.Event) -> None:
        """Renew every period until `stop`; on `RoleLockLost` set `stop` and raise it."""
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.period_s)
            if stop.is_set():
                return
            try:
                await self.renew()
            except RoleLockLost:
                stop.set()
                raise
            except Exception as e:  # the bus rides out outages; keep renewing, never go quiet
                log.warning("role_lock_renew_failed", role=self.role, error=repr(e))

    async def serve(self, run: Awaitable[object], stop: asyncio.Event) -> None:
        """Await `run` (the role's service, which returns once `stop` is set) while renewing;
        release at the end. `RoleLockLost` (after the service stopped) when it was taken."""
        renewer = asyncio.create_task(self.renew_forever(stop))
        lost: list[BaseException | None] = []
        try:
            await run
        finally:
            if not renewer.done():
                renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                lost = await asyncio.gather(renewer, return_exceptions=True)
            await self.release()
        if lost and isinstance(lost[0], RoleLockLost):
            raise lost[0]

    async def release(self) -> None:
        """Delete the lock if it is still ours (best effort: a holder that cannot release is
        taken over after the ttl)."""
        with contextlib.suppress(Exception):
            if await self.bus.kv_delete(self.key, last=self.revision):
                log.info("role_lock_released", role=self.role)
