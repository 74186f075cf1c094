"""The episode host: runs a workflow's episodes on the event loop and feeds their generations
into the engine's continuous batch.

One episode per sample the scheduler starts (`Request`: sample `index` of a task). The
workflow awaits `generate(ids)`; the host queues a `GenRequest` keyed `<task>/<index>#<turn>`,
which the generating thread takes at its next token boundary (`take_turns`), so many episodes
decode together and a tool wait frees the row for others. The engine's finished output comes
back on the loop (`turn_finished`) and resolves the episode's await.

Invariants:
- every episode ends in exactly one of: `on_done(request, episode)`, `on_failed(request,
  traceback)` (the workflow raised: that costs only its own task), or a cancel (its task was
  given up: `cancel_task`, `cancel_all`);
- a generation that finishes after its episode was cancelled is dropped (its tokens are never
  filed), and a cancelled episode's queued turns never reach the engine;
- a workflow marked `direct` (one generation from the prompt: `single_turn`) runs without a
  coroutine: `direct_request` hands the engine the prompt at once, and the finished generation
  becomes the episode (`workflow.episode`), with the same outcomes as above;
- thread-safety: `direct_request`, `take_turns` and `turn_finished` may be called from the
  generating thread; everything else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import Awaitable, Callable

import structlog

from areal.core.scheduling import Request
from areal.engines.base import GenOutput, GenRequest
from areal.workflows.api import Episode, Generation, RolloutWorkflow
from schemas import Task

log = structlog.get_logger()

OnDone = Callable[[Request, Episode], None]
OnFailed = Callable[[Request, str], Awaitable[None]]


class _EpisodeGen:
    """The `Generator` one episode sees."""

    def __init__(self, host: EpisodeHost, key: str) -> None:
        self._host, self._key, self.turns = host, key, 0

    async def generate(self, ids: list[int], *, max_new_tokens: int | None = None) -> Generation:
        if not ids:
            raise ValueError("generate needs at least one token of context")
        key = f"{self._key}#{self.turns}"
        self.turns += 1
        return await self._host.submit(GenRequest(key, list(ids), max_new_tokens))


class EpisodeHost:
    def __init__(
        self,
        workflow: RolloutWorkflow,
        on_done: OnDone,
        on_failed: OnFailed,
        wake: Callable[[], None],
    ) -> None:
        self.workflow, self._on_done, self._on_failed, self._wake = (
            workflow,
            on_done,
            on_failed,
            wake,
        )
        self._lock = threading.Lock()
        self._queued: list[GenRequest] = []  # turns waiting for the engine (guarded)
        self._waiting: dict[str, asyncio.Future[Generation]] = {}  # turn key -> its await
        self._episodes: dict[str, asyncio.Task[None]] = {}  # sample key -> its episode
        self._direct: dict[str, Request] = {}  # turn key -> its sample (direct workflows; guarded)
        self.direct = bool(getattr(workflow, "direct", False))
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ event loop
    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._episodes) + len(self._direct)

    def start(self, request: Request, task: Task) -> None:
        """Run the workflow's episode for `request` (on the loop)."""
        if request.key in self._episodes:
            return
        t = asyncio.ensure_future(self._run(request, task))
        self._episodes[request.key] = t

    async def _run(self, request: Request, task: Task) -> None:
        gen = _EpisodeGen(self, request.key)
        try:
            episode = await self.workflow.arun_episode(gen, task, request.index)
            if not isinstance(episode, Episode):
                raise TypeError(
                    f"{type(self.workflow).__name__}.arun_episode returned "
                    f"{type(episode).__name__}, not an Episode"
                )
        except asyncio.CancelledError:
            raise
        except Exception:  # the workflow's bug: its own task only
            self._episodes.pop(request.key, None)
            await self._on_failed(request, traceback.format_exc(limit=20))
            return
        self._episodes.pop(request.key, None)
        self._on_done(request, episode)

    async def submit(self, req: GenRequest) -> Generation:
        assert self._loop is not None
        fut: asyncio.Future[Generation] = self._loop.create_future()
        self._waiting[req.key] = fut
        with self._lock:
            self._queued.append(req)
        self._wake()
        try:
            return await fut
        finally:
            self._waiting.pop(req.key, None)

    def _resolve(self, out: GenOutput) -> None:
        with self._lock:
            request = self._direct.pop(out.key, None)
        if request is not None:
            self._on_done(request, self.workflow.episode(_generation(out)))  # type: ignore[attr-defined]
            return
        fut = self._waiting.get(out.key)
        if fut is None or fut.done():  # its episode was cancelled meanwhile
            return
        fut.set_result(_generation(out))

    def cancel_task(self, task_id: str) -> None:
        """Give up `task_id`'s episodes: their queued turns are dropped, their awaits cancelled."""
        prefix = f"{task_id}/"
        with self._lock:
            self._queued = [r for r in self._queued if not r.key.startswith(prefix)]
            for key in [k for k in self._direct if k.startswith(prefix)]:
                del self._direct[key]
        for key in [k for k in self._episodes if k.startswith(prefix)]:
            self._episodes.pop(key).cancel()

    def cancel_all(self) -> None:
        with self._lock:
            self._queued.clear()
            self._direct.clear()
        for t in self._episodes.values():
            t.cancel()
        self._episodes.clear()

    async def close(self) -> None:
        tasks = list(self._episodes.values())
        self.cancel_all()
        for t in tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
            except Exception as e:  # noqa: BLE001 - closing: say so, go on
                log.warning("episode_close_failed", error=repr(e))

    # ------------------------------------------------------------------ generating thread
    def has_turns(self) -> bool:
        with self._lock:
            return bool(self._queued)

    def direct_request(self, request: Request, task: Task) -> GenRequest:
        """Generating thread: the one generation of a `direct` workflow's episode."""
        key = f"{request.key}#0"
        with self._lock:
            self._direct[key] = request
        return GenRequest(key, task.prompt_ids.to_list())

    def take_turns(self) -> list[GenRequest]:
        """Turns queued by episodes, for the engine to admit now."""
        with self._lock:
            out, self._queued = self._queued, []
        return out

    def turn_finished(self, out: GenOutput) -> None:
        """Generating thread: a turn's generation is done; its episode resumes on the loop."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._resolve, out)


def _generation(out: GenOutput) -> Generation:
    return Generation(
        output_ids=list(out.output_ids),
        behav_logp=list(out.behav_logp),
        versions=list(out.versions),
        finish_reason=out.finish_reason,
        n_interrupts=out.n_interrupts,
        n_reprefill_tokens=out.n_reprefill_tokens,
    )
