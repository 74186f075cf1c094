"""The trainer's writes to a disk that fills up or fails: classify, pause, say so once, retry,
go on by itself once the write lands.

Every write of the trainer (weights, checkpoints, `metrics.jsonl`, `eval.jsonl`,
`summary.json`, the final model) goes through `StorageGuard.write`.

Invariants:
- only storage errors pause (`storage_error`): an `OSError` with ENOSPC or EDQUOT anywhere in
  the exception's chain (`__cause__` / `__context__`: `torch.save` into a file object reports
  ENOSPC as a `RuntimeError` whose context it is) is `storage_full`; another filesystem
  `OSError` (EACCES, EROFS, EIO, ...) raised as such, or one of those errnos in the chain, is
  `write_failed`. Writers that keep only the message are read by it: safetensors' "No space
  left on device (os error 28)" is `storage_full`; torch's path-based writer ("unexpected pos",
  "iostream error") is `write_failed`, or `storage_full` when the path's disk has under 1 MiB
  free. Anything else (a programming error, a bus outage: `TimeoutError`, `ConnectionError`)
  is re-raised at once;
- a write that fails with a storage error is retried in place (its caller waits), with backoff
  from `first_delay_s` doubling to `max_delay_s`, until it lands: nothing after it (an ack)
  happens meanwhile, so what is acked is on disk;
- one pause, one pair of events, however many writes fail and retry during it: the first
  failure emits `storage_full` / `write_failed` (what, path, bytes needed, free bytes, error,
  `since`); retries are logged only; once a write lands and no other write is failing,
  `storage_recovered` (`paused_s`, `retries`, the same `since`) ends the pause;
- events are published in order in the background: a bus that cannot store them (its own disk
  full: the server refuses the publish until its store is writable again) never blocks or fails
  a write; a refused event is retried with backoff for up to `event_patience_s`, so the pause
  reaches the events stream once the server stores again (it is on the same disk, often);
- with `give_up_s`, a pause longer than that raises `StorageWriteError` (naming the path, the
  cause and the way out) instead of retrying again.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import structlog

log = structlog.get_logger()
T = TypeVar("T")
Kind = Literal["storage_full", "write_failed"]
Emit = Callable[..., Awaitable[None]]  # emit(event_type, **detail): `Bus.event`

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# errnos that make a wrapped OSError (found in the chain, not raised as such) a failed write; a
# FileNotFoundError some library caught on the way to a ValueError is not one
CHAINED_IO_ERRNOS = FULL_ERRNOS | {errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
# OSError subclasses that are no disk's doing: outages, signals, processes
NOT_STORAGE = (
    ConnectionError,
    TimeoutError,
    BlockingIOError,
    InterruptedError,
    ChildProcessError,
    ProcessLookupError,
)
# what writers that drop the errno leave in the message (lower case): safetensors' Rust
# `io::Error` ("... (os error 28)"), torch's C++ stream writer
FULL_MESSAGES = (
    "no space left on device",
    "disk quota exceeded",
    "(os error 28)",
    "(os error 122)",
)
WRITER_MESSAGES = ("unexpected pos", "iostream error", "pytorchstreamwriter failed writing")
NEARLY_FULL_BYTES = 2**20  # a message-only write failure with less free than this: full
FIRST_DELAY_S, MAX_DELAY_S = 1.0, 30.0
# a storage event the bus refused is retried this long (its server's store may sit on the disk
# that filled up: the launcher restarts it once there is room)
EVENT_PATIENCE_S, EVENT_MAX_DELAY_S = 600.0, 5.0


class StorageWriteError(RuntimeError):
    """Writes failed for longer than `give_up_s`: the trainer must not go on."""


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc`, then every exception it was raised from or while handling (each once)."""
    out: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return out


def _is_disk_error(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno is not None and not isinstance(e, NOT_STORAGE)


def storage_error(exc: BaseException) -> tuple[Kind, BaseException] | None:
    """(kind, the exception that says so) when `exc` is a full or failing disk, else None
    (module invariants; the "nearly full" refinement is `StorageGuard`'s, which knows the path)."""
    chain = _chain(exc)
    for e in chain:
        if _is_disk_error(e) and e.errno in FULL_ERRNOS:
            return "storage_full", e
    if _is_disk_error(exc):
        return "write_failed", exc
    for e in chain[1:]:
        if _is_disk_error(e) and e.errno in CHAINED_IO_ERRNOS:
            return "write_failed", e
    for e in chain:
        if isinstance(e, NOT_STORAGE):
            continue
        text = str(e).lower()
        if any(m in text for m in FULL_MESSAGES):
            return "storage_full", e
        if any(m in text for m in WRITER_MESSAGES):
            return "write_failed", e
    return None


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem of `path` (its nearest existing parent); None if unknown
    (not a local path, or statvfs failed)."""
    p = Path(path)
    if "://" in str(path):
        return None
    for d in (p, *p.parents):
        if d.exists():
            with contextlib.suppress(OSError):
                return shutil.disk_usage(d).free
            return None
    return None


def tree_bytes(path: str | os.PathLike) -> int:
    """Bytes of the file `path`, or of every file under the dir `path` (0 when absent)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(p):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


@dataclass
class Pause:
    """A stretch of time in which some write kept failing."""

    kind: Kind
    what: str
    path: str
    since: float  # wall clock (s since the epoch) of the first failure
    started: float  # monotonic clock of the first failure
    retries: int = 0


class StorageGuard:
    """Runs writes; a storage error pauses the caller, retries, and reports the pause once."""

    def __init__(
        self,
        emit: Emit | None = None,
        *,
        first_delay_s: float = FIRST_DELAY_S,
        max_delay_s: float = MAX_DELAY_S,
        give_up_s: float | None = None,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        event_patience_s: float = EVENT_PATIENCE_S,
    ) -> None:
        self._emit = emit
        self.event_patience_s = event_patience_s
        self.first_delay_s, self.max_delay_s, self.give_up_s = first_delay_s, max_delay_s, give_up_s
        self._sleep, self._wall, self._monotonic = sleep, wall, monotonic
        self.pause: Pause | None = None  # the pause under way, if any
        self.pauses = 0  # pauses so far (each reported once)
        self.failures = 0  # failed write attempts so far (each logged)
        self.paused_s = 0.0  # time spent in pauses that ended
        self._failing: set[int] = set()  # writes now between a failure and their retry
        self._tokens = 0
        self._last_emit: asyncio.Task[None] | None = None

    async def write(
        self,
        what: str,
        path: str | os.PathLike,
        op: Callable[[], Awaitable[T]],
        *,
        needs_bytes: int | None = None,
    ) -> T:
        """`await op()` until it does not fail with a storage error (module invariants).
        `what` names the write (`weights`, `checkpoint`, `metrics`, ...), `path` where it goes,
        `needs_bytes` about how much it writes (for the event; None when unknown)."""
        self._tokens += 1
        token, delay = self._tokens, self.first_delay_s
        try:
            while True:
                try:
                    result = await op()
                except Exception as e:
                    found = storage_error(e)
                    if found is None:
                        raise
                    self._failed(token, what, str(path), needs_bytes, found, delay)
                    await self._sleep(delay)
                    delay = min(delay * 2, self.max_delay_s)
                    continue
                self._landed(token)
                return result
        finally:
            self._failing.discard(token)

    async def write_sync(
        self,
        what: str,
        path: str | os.PathLike,
        fn: Callable[..., T],
        *args: Any,
        needs_bytes: int | None = None,
    ) -> T:
        """`write` of a blocking `fn(*args)`, run in a thread."""
        return await self.write(
            what, path, lambda: asyncio.to_thread(fn, *args), needs_bytes=needs_bytes
        )

    def _failed(
        self,
        token: int,
        what: str,
        path: str,
        needs_bytes: int | None,
        found: tuple[Kind, BaseException],
        retry_in_s: float,
    ) -> None:
        kind, cause = found
        free = free_bytes(path)
        no_errno = not isinstance(cause, OSError)  # a writer that kept only the message
        if kind == "write_failed" and no_errno and free is not None and free < NEARLY_FULL_BYTES:
            kind = "storage_full"
        self._failing.add(token)
        self.failures += 1
        error = f"{type(cause).__name__}: {cause}"[:500]
        now = self._monotonic()
        pause = self.pause
        if pause is None:
            pause = self.pause = Pause(kind, what, path, since=self._wall(), started=now)
            self.pauses += 1
            detail = {
                "what": what,
                "path": path,
                "needs_bytes": needs_bytes,
                "free_bytes": free,
                "error": error,
                "since": pause.since,
            }
            log.error(kind, **detail, note="training paused: retried until the write lands")
            self._publish(kind, detail)
        else:
            pause.retries += 1
            log.warning(
                "storage_write_retry",
                what=what,
                path=path,
                error=error,
                retries=pause.retries,
                paused_s=round(now - pause.started, 1),
                retry_in_s=retry_in_s,
            )
        if self.give_up_s is not None and now - pause.started + retry_in_s > self.give_up_s:
            raise StorageWriteError(
                f"{what} to {path} failed for {self.give_up_s:g} s ({error}); nothing since the "
                "last checkpoint was acked: free disk space or fix the directory's permissions, "
                "then `areal run ... --resume`"
            ) from None

    def _landed(self, token: int) -> None:
        self._failing.discard(token)
        pause = self.pause
        if pause is None or self._failing:
            return
        self.pause = None
        paused_s = self._monotonic() - pause.started
        self.paused_s += paused_s
        detail = {
            "kind": pause.kind,
            "what": pause.what,
            "path": pause.path,
            "paused_s": round(paused_s, 2),
            "retries": pause.retries,
            "since": pause.since,
        }
        log.warning("storage_recovered", **detail)
        self._publish("storage_recovered", detail)

    def _publish(self, event: str, detail: dict[str, Any]) -> None:
        """Publish `event` after the ones before it, in the background; retried while the bus
        refuses it (module invariants)."""
        if self._emit is None:
            return
        emit, prev, patience = self._emit, self._last_emit, self.event_patience_s

        async def publish() -> None:
            if prev is not None:
                with contextlib.suppress(BaseException):
                    await prev
            loop = asyncio.get_running_loop()
            deadline, delay, tries = loop.time() + patience, 0.5, 0
            while True:
                try:
                    await emit(event, **detail)
                except Exception as e:  # noqa: BLE001 - the pause is logged; retried below
                    tries += 1
                    last = loop.time() + delay > deadline
                    if tries == 1 or last:
                        log.warning(
                            "storage_event_not_published",
                            event_type=event,
                            error=repr(e)[:300],
                            retrying=not last,
                        )
                    if last:
                        return
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, EVENT_MAX_DELAY_S)
                    continue
                if tries:
                    log.info("storage_event_published", event_type=event, tries=tries + 1)
                return

        self._last_emit = asyncio.ensure_future(publish())

    async def drain(self, timeout_s: float | None = None) -> None:
        """Wait (at most `timeout_s`) for the events handed to the bus to be published or
        given up; they go on in the background after a timeout."""
        if self._last_emit is not None:
            await asyncio.wait({self._last_emit}, timeout=timeout_s)
