"""Typed run state in the run's KV bucket: pydantic models in, pydantic models out.

Invariants:
- a value is the model's JSON (`model_dump_json`); `get` validates it as the model the caller
  names and raises `StateDecodeError` (naming the key and the bucket) when it does not
  validate: a corrupt or foreign value is an error, never mistaken for "no state yet";
- `get` returns None only when the key has no value (never written, deleted or purged);
- `KVWatch.wait` reports writes made after the watch started (the value current at its start is
  not a change); a timeout is a normal answer (False), never an exception;
- a `KVWatch` outlives its server-side consumer: after the connection reconnected (a restarted
  server, a failover to another cluster node), or when told with `reopen()`, it opens a new one
  and its next `wait` says True (a write may have been missed meanwhile: read the key again).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ValidationError

from areal.bus.errors import StateDecodeError

T = TypeVar("T", bound=BaseModel)


class KVWatch:
    """Changes of one key after the watch started (create it before reading the key).

    The library's watcher is an ephemeral ordered consumer on the server. A restarted server, or
    the death of the cluster node that held it, loses it, and the library notices only after two
    missed 5 s heartbeats: 10-20 s in which writes go unreported, and a caller that waits for
    them (the controller, for each new policy version) crawls on its fallback timeouts. So the
    watch opens a new consumer when the connection has reconnected since it opened its own, and
    when a caller that saw a write it did not report says so (`reopen`)."""

    def __init__(
        self,
        open_watcher: Callable[[], Awaitable[KeyValue.KeyWatcher]],
        reconnects: Callable[[], int],
    ) -> None:
        self._open_watcher, self._reconnects = open_watcher, reconnects
        self._watcher: KeyValue.KeyWatcher | None = None
        self._opened_at = -1  # the connection's reconnect count when the watcher was opened
        self._initial_done = False  # the watcher first replays the current value, then None
        self._stopped = False
        self.reopened = 0  # consumers opened after the first

    @classmethod
    async def open(
        cls,
        open_watcher: Callable[[], Awaitable[KeyValue.KeyWatcher]],
        reconnects: Callable[[], int],
    ) -> KVWatch:
        watch = cls(open_watcher, reconnects)
        watch._opened_at = reconnects()
        watch._watcher = await open_watcher()
        return watch

    def reopen(self) -> None:
        """The caller read a write this watch did not report: its consumer is likely gone.
        The next `wait` opens a new one and says True."""
        self._opened_at = -1

    async def _renew(self) -> bool:
        """Replace the watcher; False when the server cannot make one now (try again later)."""
        old, self._watcher = self._watcher, None
        if old is not None:
            with contextlib.suppress(nats.errors.Error):  # its consumer may be gone already
                await old.stop()
        opened_at = self._reconnects()
        try:
            self._watcher = await self._open_watcher()
        except (nats.errors.Error, asyncio.TimeoutError):
            return False
        self._opened_at, self._initial_done = opened_at, False
        self.reopened += 1
        return True

    async def wait(self, timeout_s: float) -> bool:
        """True when the key was written (or deleted) since the watch started or the last True,
        or may have been (the watch had to reopen); False when `timeout_s` passed without a
        change, or the watch is stopped."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._stopped:
            remaining = deadline - loop.time()
            if self._watcher is None or self._opened_at != self._reconnects():
                if await self._renew():
                    return True
                if remaining <= 0:
                    return False
                await asyncio.sleep(min(0.5, remaining))  # the server is not back yet
                continue
            if remaining <= 0:
                return False
            try:
                entry = await self._watcher.updates(timeout=remaining)
            except nats.errors.TimeoutError:
                return False
            if entry is None:  # end of the replay of the value current at the start
                self._initial_done = True
            elif isinstance(entry, KeyValue.Entry):
                if self._initial_done:
                    return True
            else:  # the library's stop sentinel
                self._stopped = True
        return False

    async def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            if self._watcher is not None:
                await self._watcher.stop()


class RunStateKV:
    """The run-state bucket of one run, typed."""

    def __init__(self, kv: KeyValue, bucket: str) -> None:
        self._kv, self.bucket = kv, bucket

    async def get(self, key: str, model: type[T]) -> T | None:
        got = await self.get_rev(key, model)
        return None if got is None else got[0]

    async def get_rev(self, key: str, model: type[T]) -> tuple[T, int] | None:
        """`get`, with the revision the value was written at (for `update` / `delete`)."""
        try:
            entry = await self._kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if not entry.value:  # a delete/purge marker read directly
            return None
        try:
            return model.model_validate_json(entry.value), entry.revision
        except ValidationError as e:
            errs = "; ".join(
                f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}"
                for err in e.errors()[:5]
            )
            raise StateDecodeError(
                f"run state {key!r} in KV bucket {self.bucket} is not a valid "
                f"{model.__name__}: {errs} (written by another areal-bus version? start a new "
                "run id, or delete the key)"
            ) from None

    async def put(self, key: str, value: BaseModel) -> None:
        await self._kv.put(key, value.model_dump_json().encode())

    async def create(self, key: str, value: BaseModel) -> bool:
        """Write `key` only if it has no value yet; True if this call wrote it."""
        return await self.create_rev(key, value) is not None

    async def create_rev(self, key: str, value: BaseModel) -> int | None:
        """`create`: the revision written, None when `key` already has a value."""
        try:
            return await self._kv.create(key, value.model_dump_json().encode())
        except KeyWrongLastSequenceError:
            return None

    async def update(self, key: str, value: BaseModel, last: int) -> int | None:
        """Write `key` only if its revision is still `last` (compare-and-set): the revision
        written, None when someone else wrote it since."""
        try:
            return await self._kv.update(key, value.model_dump_json().encode(), last=last)
        except KeyWrongLastSequenceError:
            return None

    async def delete(self, key: str, last: int) -> bool:
        """Delete `key` only if its revision is still `last`; True if this call deleted it."""
        try:
            await self._kv.delete(key, last=last)
        except KeyWrongLastSequenceError:
            return False
        return True

    async def watch(self, key: str, reconnects: Callable[[], int]) -> KVWatch:
        """A watch of `key`; `reconnects` counts the connection's reconnects (see `KVWatch`)."""
        return await KVWatch.open(lambda: self._kv.watch(key), reconnects)
