"""The reward worker's process pool: scores batches, each sample within its own timeout.

Invariants:
- Per-sample timeout: a pool call runs `areal.rewards.scoring.score_items`, which interrupts a
  sample's scorer after `timeout_s` (reward 0, `"timeout after Xs"`) and goes on with the rest of
  the batch in the same call; the pool is not touched.
- Backstop: a call still unanswered after `len(items) * timeout_s + slack_s` is hung somewhere
  the alarm cannot reach (C code, a blocked signal). Its pool is killed and rebuilt
  (`n_resets` += 1) and the batch is re-scored one sample per call, so only the culprit scores 0.
  The same holds for a call whose process died (a scorer that crashed it). A dead process
  breaks every call of its pool, so a sample whose call a crash broke may be innocent (with
  `workers` > 1, another call's scorer may have crashed it): it is scored once more in
  quarantine, a pool of one process that runs one call at a time, where a crash (or a hang)
  can only be its own. Only there is a crash blamed on a sample.
- A call broken because another call already replaced the pool is not anyone's fault: it is
  retried on the new pool, never blamed on its samples.
- `score` returns one outcome per item, in order; it raises only for what is not a scorer's
  failure (e.g. the pool was closed).
- The scoring processes die with the worker that owns them, SIGKILL included
  (`areal.proc.die_with_parent`); so does multiprocessing's resource tracker, which exits once
  no process holds its pipe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import multiprocessing as mp
import os
import signal
from concurrent.futures.process import BrokenProcessPool

from areal.proc import die_with_parent
from areal.rewards.scoring import Item, Scored, score_items, timeout_error

BACKSTOP_SLACK_S = 5.0  # on top of len(items) * timeout_s: process start, imports, IPC
_MAX_TRIES = 3  # calls of one batch (or sample) broken by other calls' pool resets


class _Failed(Exception):
    """This call hung past its deadline or lost its process: `error` says which."""

    def __init__(self, error: str, seconds: float, *, crashed: bool = False) -> None:
        super().__init__(error)
        self.error, self.seconds, self.crashed = error, seconds, crashed


class _Replaced(Exception):
    """This call's pool was replaced by another call's reset while it ran."""


class ScoringPool:
    """`workers` spawned scoring processes for the reward fn `fn_name` (a registry spec)."""

    def __init__(
        self, fn_name: str, *, workers: int, timeout_s: float, slack_s: float = BACKSTOP_SLACK_S
    ) -> None:
        self.fn_name, self.workers = fn_name, workers
        self.timeout_s, self.slack_s = timeout_s, slack_s
        self.n_calls = 0  # pool calls made
        self.n_resets = 0  # pools killed and rebuilt (backstop deadlines, dead processes)
        self._executor = self._new_executor(workers)
        self._closed = False
        self._quarantine: cf.ProcessPoolExecutor | None = None  # made at its first use
        self._quarantine_lock = asyncio.Lock()

    def _new_executor(self, workers: int) -> cf.ProcessPoolExecutor:
        # The scoring processes die with this worker, SIGKILL included (no orphaned pools).
        return cf.ProcessPoolExecutor(
            workers,
            mp_context=mp.get_context("spawn"),
            initializer=die_with_parent,
            initargs=(signal.SIGKILL, os.getpid()),
        )

    async def score(self, items: list[Item]) -> list[Scored]:
        """Score a batch in one call; after a hang or a crash, each item alone (see module)."""
        if len(items) > 1:
            try:
                return await self._call_retrying(items)
            except _Failed:
                pass  # a hang or a dead process somewhere in the batch: find the culprit
        return [await self._score_alone(item) for item in items]

    async def _score_alone(self, item: Item) -> Scored:
        try:
            return (await self._call_retrying([item]))[0]
        except _Failed as e:
            if not e.crashed:
                return (0.0, e.error, e.seconds)
        # a crash broke its call, maybe another call's: only a crash in quarantine is its own
        return await self._score_quarantined(item)

    async def _score_quarantined(self, item: Item) -> Scored:
        """`item` on the quarantine pool, one call at a time: its crash or hang is its own."""
        async with self._quarantine_lock:
            if self._closed:
                raise RuntimeError("the scoring pool is closed")
            if self._quarantine is None:
                self._quarantine = self._new_executor(1)
            self.n_calls += 1
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(
                self._quarantine, score_items, self.fn_name, [item], self.timeout_s
            )
            try:
                return (await asyncio.wait_for(fut, self.timeout_s + self.slack_s))[0]
            except asyncio.TimeoutError:
                self._reset_quarantine()
                return (0.0, timeout_error(self.timeout_s), self.timeout_s)
            except BrokenProcessPool as e:
                if self._closed:
                    raise RuntimeError("the scoring pool was closed during the call") from e
                self._reset_quarantine()
                return (0.0, f"scoring failed: {type(e).__name__}: {e}", 0.0)

    def _reset_quarantine(self) -> None:
        if self._quarantine is not None:
            _kill(self._quarantine)
            self._quarantine = None
            self.n_resets += 1

    async def _call_retrying(self, items: list[Item]) -> list[Scored]:
        """`_call`, again on the new pool while other calls' resets break this one."""
        for _ in range(_MAX_TRIES):
            try:
                return await self._call(items)
            except _Replaced:
                continue
        raise _Failed(f"scoring failed: the pool was reset {_MAX_TRIES} times under it", 0.0)

    async def _call(self, items: list[Item]) -> list[Scored]:
        if self._closed:
            raise RuntimeError("the scoring pool is closed")
        executor = self._executor
        deadline_s = len(items) * self.timeout_s + self.slack_s
        self.n_calls += 1
        loop = asyncio.get_running_loop()
        try:
            fut = loop.run_in_executor(executor, score_items, self.fn_name, items, self.timeout_s)
            return await asyncio.wait_for(fut, deadline_s)
        except asyncio.TimeoutError as e:
            self._reset(executor)  # the call may be running still: kill it
            raise _Failed(timeout_error(self.timeout_s), self.timeout_s) from e
        except BrokenProcessPool as e:
            if self._closed:
                raise RuntimeError("the scoring pool was closed during the call") from e
            if executor is not self._executor:
                raise _Replaced from e
            self._reset(executor)
            error = f"scoring failed: {type(e).__name__}: {e}"
            raise _Failed(error, 0.0, crashed=True) from e

    def _reset(self, executor: cf.ProcessPoolExecutor) -> None:
        """Kill `executor`'s processes and replace it, unless another call already did."""
        if executor is not self._executor or self._closed:
            return
        self._executor = self._new_executor(self.workers)
        self.n_resets += 1
        _kill(executor)

    def close(self) -> None:
        """Kill the scoring processes (calls in flight raise RuntimeError); idempotent."""
        self._closed = True
        _kill(self._executor)
        if self._quarantine is not None:
            _kill(self._quarantine)


def _kill(executor: cf.ProcessPoolExecutor) -> None:
    # `_processes` is private, but the only handle on a hung worker: shutdown() alone waits for
    # the task it is running to finish, which for a hang is never.
    for proc in list((getattr(executor, "_processes", None) or {}).values()):
        proc.kill()
    executor.shutdown(wait=False, cancel_futures=True)
