"""Typed run state in the run's KV bucket: pydantic models in, pydantic models out.

Invariants:
- a value is the model's JSON (`model_dump_json`); `get` validates it as the model the caller
  names and raises `StateDecodeError` (naming the key and the bucket) when it does not
  validate: a corrupt or foreign value is an error, never mistaken for "no state yet";
- `get` returns None only when the key has no value (never written, deleted or purged);
- `KVWatch.wait` reports writes made after the watch started (the value current at its start is
  not a change); a timeout is a normal answer (False), never an exception;
- a `KVWatch` creates nothing on the server: it follows the key's subject by direct gets
  (`areal.bus.follow`), so a reconnect, a restarted server or a failover delays a write's
  report, never loses it.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from nats.aio.client import Client
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ValidationError

from areal.bus.errors import StateDecodeError
from areal.bus.follow import StoredMsg, StreamFollower, follow_stream, last_seq

T = TypeVar("T", bound=BaseModel)


class KVWatch:
    """Changes of one key after the watch started (create it before reading the key).

    A `StreamFollower` of the key's subject from the sequence after its current value: every
    later write (or delete) is read by sequence, whatever happened to the connection meanwhile,
    and a core subscription on the subject wakes it at once. No consumer is made (no role may
    create one: `areal.bus.nats_config`)."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()
        self._follower: StreamFollower | None = None
        self._stopped = False
        self.reopened = 0  # times a caller said a write went unreported (`reopen`)

    @classmethod
    async def open(cls, nc: Client, bucket: str, key: str) -> KVWatch:
        watch = cls()
        stream, subject = f"KV_{bucket}", f"$KV.{bucket}.{key}"

        async def on_write(_msg: StoredMsg) -> None:
            watch._changed.set()

        start = await last_seq(nc, stream, subject) + 1
        watch._follower = await follow_stream(nc, stream, subject, on_write, start_seq=start)
        return watch

    def reopen(self) -> None:
        """The caller read a write this watch did not report yet (it is on its way: reads are
        by sequence): the next `wait` says True at once."""
        self.reopened += 1
        self._changed.set()

    async def wait(self, timeout_s: float) -> bool:
        """True when the key was written (or deleted) since the watch started or the last True;
        False when `timeout_s` passed without a change, or the watch is stopped."""
        if self._stopped:
            return False
        if not self._changed.is_set():
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, timeout_s))
            except asyncio.TimeoutError:
                return False
        self._changed.clear()
        return not self._stopped

    async def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._changed.set()
            if self._follower is not None:
                await self._follower.unsubscribe()


class RunStateKV:
    """The run-state bucket of one run, typed."""

    def __init__(self, kv: KeyValue, bucket: str, nc: Client) -> None:
        self._kv, self.bucket, self._nc = kv, bucket, nc

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

    async def watch(self, key: str) -> KVWatch:
        """A watch of `key` (see `KVWatch`)."""
        return await KVWatch.open(self._nc, self.bucket, key)
