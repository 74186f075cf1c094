"""Rollout: pulls tasks, generates G samples each, publishes every finished sample at once.

Invariants:
- every generated token carries the behaviour log-prob and the policy version that produced it;
- a task is never generated with weights older than the version at which it was admitted (the
  worker waits for that version's announcement first); this makes `max_staleness: 0` truly
  synchronous;
- interruptible mode: a new weight version is fetched and verified off the event loop, then handed
  to the generating thread, which switches at the next token boundary (re-prefilling prompt +
  partial output); non-interruptible mode stops admitting new work once an update is pending,
  drains the running batch on the old weights, then switches;
- new tasks join the running batch at token boundaries (continuous batching), so a long sample
  never holds back the start of the next ones;
- a task's prompt message is acknowledged only after all its G samples are published.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import structlog

from areal.bus.client import Bus, Lease
from areal.bus.codec import pack, unpack
from areal.engines.base import GenOutput, GenRequest, InferenceEngine, SamplingParams, WeightUpdate
from areal.services.common import BusyMeter, heartbeat_loop
from schemas import Sample, Task, WeightAnnouncement
from schemas import subjects as S

log = structlog.get_logger()


@dataclass
class _InFlight:
    task: Task
    lease: Lease
    remaining: int
    done: asyncio.Future
    t_received: float = field(default_factory=time.time)


class RolloutService:
    def __init__(
        self,
        bus: Bus,
        engine: InferenceEngine,
        tokenizer,
        params: SamplingParams,
        *,
        interruptible: bool,
        max_concurrent_tasks: int,
        weights_from_bytes,
        interrupt_min_interval_s: float = 0.0,
    ) -> None:
        self.bus, self.engine, self.tokenizer, self.params = bus, engine, tokenizer, params
        self.interruptible = interruptible
        self.interrupt_min_interval_s = interrupt_min_interval_s
        self._last_switch = -float("inf")  # monotonic time of the last mid-batch switch
        self.max_concurrent_tasks = max_concurrent_tasks
        self.weights_from_bytes = weights_from_bytes
        self._lock = threading.Lock()
        self._pending: WeightUpdate | None = None
        self._weights_changed = asyncio.Event()
        self._queue: deque[tuple[_InFlight, GenRequest]] = deque()  # guarded by _lock
        self._queue_changed = asyncio.Event()
        self._inflight: dict[str, _InFlight] = {}
        self._publishes: set[asyncio.Task] = set()
        self.meter = BusyMeter()
        self.stats = {
            "samples": 0,
            "tokens": 0,
            "interrupts": 0,
            "reprefill_tokens": 0,
            "weight_load_s": 0.0,
            "weight_loads": 0,
        }

    # ------------------------------------------------------------------ weights
    @property
    def known_version(self) -> int:
        with self._lock:
            return max(self.engine.version, self._pending.version if self._pending else -1)

    async def on_weights(self, ann: WeightAnnouncement) -> None:
        if ann.version <= self.known_version:
            return
        t0 = time.perf_counter()
        try:
            data = await self.bus.get_weights(ann)
            state = await asyncio.to_thread(self.weights_from_bytes, data)
        except Exception as e:
            log.error("weights_load_failed", version=ann.version, error=str(e))
            return
        with self._lock:
            if self._pending is None or self._pending.version < ann.version:
                self._pending = WeightUpdate(version=ann.version, state_dict=state)
        self.stats["weight_load_s"] += time.perf_counter() - t0
        self.stats["weight_loads"] += 1
        log.info(
            "weights_fetched",
            version=ann.version,
            bytes=ann.nbytes,
            fetch_s=round(time.perf_counter() - t0, 3),
        )
        self._weights_changed.set()

    def _take_pending(self) -> WeightUpdate | None:
        with self._lock:
            update, self._pending = self._pending, None
        return update

    def _may_interrupt(self) -> bool:
        """Mid-batch switches are rate-limited by `interrupt_min_interval_s`: each one re-prefills
        every running row, which costs more than it saves when versions come very often."""
        return time.monotonic() - self._last_switch >= self.interrupt_min_interval_s

    def _interrupt(self) -> WeightUpdate | None:
        """Called by the generating thread at token boundaries (interruptible mode)."""
        if self._pending is None or not self._may_interrupt():
            return None
        update = self._take_pending()
        if update is not None:
            self._last_switch = time.monotonic()
        return update

    async def _apply_pending(self) -> None:
        update = self._take_pending()
        if update is not None:
            await asyncio.to_thread(self.engine.load_weights, update)
            log.info("weights_loaded", policy_version=update.version)

    async def _wait_for_version(self, version: int, stop: asyncio.Event) -> None:
        while self.known_version < version and not stop.is_set():
            self._weights_changed.clear()
            if self.known_version >= version:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._weights_changed.wait(), 2.0)
            if self.known_version < version:  # missed announcement? ask the stream
                ann = await self.bus.latest_weights()
                if ann is not None:
                    await self.on_weights(ann)

    # ------------------------------------------------------------------ tasks
    async def handle(self, task: Task, lease: Lease) -> None:
        entry = self._inflight.get(task.task_id)
        if entry is not None:  # redelivery of a task we are still generating
            await lease.ack()
            return
        entry = _InFlight(task, lease, task.group_size, asyncio.get_running_loop().create_future())
        self._inflight[task.task_id] = entry
        prompt = unpack(task.prompt_ids).tolist()
        with self._lock:
            for i in range(task.group_size):
                self._queue.append(
                    (entry, GenRequest(key=f"{task.task_id}/{i}", prompt_ids=prompt))
                )
        self._queue_changed.set()
        try:
            await entry.done
            await lease.ack()
        finally:
            self._inflight.pop(task.task_id, None)

    def _on_finished(self, loop: asyncio.AbstractEventLoop, out: GenOutput) -> None:
        """Generating thread -> event loop: publish the sample at once."""
        loop.call_soon_threadsafe(self._spawn_publish, out)

    def _spawn_publish(self, out: GenOutput) -> None:
        t = asyncio.ensure_future(self._publish_sample(out))
        self._publishes.add(t)
        t.add_done_callback(self._publishes.discard)

    async def _publish_sample(self, out: GenOutput) -> None:
        task_id, idx = out.key.rsplit("/", 1)
        entry = self._inflight.get(task_id)
        if entry is None or entry.done.done():  # its task failed and was handed back
            return
        task = entry.task
        text = self.tokenizer.decode(
            [t for t in out.output_ids if t not in self.params.stop_token_ids],
            skip_special_tokens=True,
        )
        sample = Sample(
            task_id=task_id,
            task_seq=task.seq,
            sample_idx=int(idx),
            group_size=task.group_size,
            prompt_ids=task.prompt_ids,
            output_ids=pack(out.output_ids, "int32"),
            behav_logp=pack(out.behav_logp, "float32"),
            versions=pack(out.versions, "int32"),
            output_text=text,
            answer=task.answer,
            metadata=task.metadata,
            finish_reason=out.finish_reason,
            worker_id=self.bus.worker_id,
            n_interrupts=out.n_interrupts,
            n_reprefill_tokens=out.n_reprefill_tokens,
            timings={
                "admitted_at": task.admitted_at,
                "received_at": entry.t_received,
                "finished_at": time.time(),
            },
        )
        try:
            await self.bus.publish(S.TRAJECTORIES, sample)
        except Exception as e:
            if not entry.done.done():
                entry.done.set_exception(e)
            return
        self.stats["samples"] += 1
        self.stats["tokens"] += len(out.output_ids)
        self.stats["interrupts"] += out.n_interrupts
        self.stats["reprefill_tokens"] += out.n_reprefill_tokens
        entry.remaining -= 1
        if entry.remaining == 0 and not entry.done.done():
            entry.done.set_result(None)

    def _take_requests(self) -> list[GenRequest]:
        """Generating thread, at token boundaries: queued requests that may start now.

        A request starts only once weights of its task's admission version are loaded (or, when
        interruptible, about to be loaded at this boundary); with an update pending and
        interruptible off, nothing new starts, so the running batch drains and the call ends.
        """
        with self._lock:
            if not self.interruptible and self._pending is not None:
                return []
            switching = self._pending is not None and self._may_interrupt()
            ready_version = max(self.engine.version, self._pending.version if switching else -1)
            out: list[GenRequest] = []
            while self._queue and self._queue[0][0].task.admitted_version <= ready_version:
                out.append(self._queue.popleft()[1])
            return out

    async def _generate_loop(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            with self._lock:
                head = self._queue[0][0] if self._queue else None
            if head is None:
                self._queue_changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._queue_changed.wait(), 0.5)
                continue
            await self._wait_for_version(head.task.admitted_version, stop)
            await self._apply_pending()
            self.meter.start()
            try:
                await asyncio.to_thread(
                    self.engine.generate,
                    [],
                    self.params,
                    self._interrupt if self.interruptible else None,
                    lambda out: self._on_finished(loop, out),
                    None,
                    self._take_requests,
                )
            except Exception as e:  # engine failure: hand the tasks back (nak), keep running
                log.exception("generate_failed")
                with self._lock:
                    self._queue.clear()
                for entry in list(self._inflight.values()):
                    if not entry.done.done():
                        entry.done.set_exception(RuntimeError(f"generation failed: {e}"))
            finally:
                self.meter.stop()

    def heartbeat(self) -> dict:
        return {
            **self.stats,
            "version": self.engine.version,
            "busy_frac": self.meter.busy_frac(),
            "inflight_tasks": len(self._inflight),
            "queued_seqs": len(self._queue),
        }

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.bus.subscribe_weights(self.on_weights)
        log.info(
            "rollout_started", interruptible=self.interruptible, policy_version=self.engine.version
        )
        tasks = [
            asyncio.create_task(self._generate_loop(stop)),
            asyncio.create_task(heartbeat_loop(self.bus, self.heartbeat, stop)),
        ]
        try:
            await self.bus.consume(
                S.PROMPTS, Task, self.handle, max_inflight=self.max_concurrent_tasks, stop=stop
            )
        finally:
            for t in tasks:
                t.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
