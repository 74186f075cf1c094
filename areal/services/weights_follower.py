"""The rollout's weights follower: takes the trainer's weight announcements, fetches and checks
each newer version off the event loop, offers it to the scheduler, and has the engine load it
at a token boundary (interruptible) or between batches.

The rollout service (`areal.services.rollout`) runs episodes; everything it knows about the
trainer's weights goes through this class. It shares the service's `Scheduler` and the lock that
guards it (the generating thread calls `poll_at_boundary` under it, at token boundaries).

Invariants:
- only announcements the trainer signed are fetched (`Bus.weights_rejection`), and only a blob
  that fits the model whole (`InferenceEngine.check_weights`: names, shapes, dtypes, finite
  values) is offered, so a refused one changes no parameter and the worker keeps generating on
  the weights it has;
- weights stream into tensors as they arrive (`areal.engines.weights_stream.SafetensorsSink`):
  the blob is never whole in memory; their values are scanned for NaN/inf once per version,
  here (the `FrozenStateDict` offered lets the engine's `load_weights` skip a second scan);
- one download at a time, of the newest version announced: announcements that arrive during a
  download replace each other, and a version at or below one loaded, pending or being fetched
  is never fetched again;
- the download runs in a task of its own, awaited shielded by the subscription's callback: a
  renewal of the subscription (at every reconnect) cancels the callback, not the download;
- a weight load that fails (at a token boundary or between batches; any error) leaves the
  engine on the version it held: the scheduler goes back to it (`Scheduler.switch_failed`) and
  the update is retried between batches after a pause that doubles from `LOAD_RETRY_S` to
  `LOAD_RETRY_MAX_S` per failure in a row (back to `LOAD_RETRY_S` once a load goes through).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from areal.bus.client import Bus
from areal.bus.errors import WeightsRejected
from areal.bus.follow import StreamFollower
from areal.core.scheduling import Scheduler
from areal.engines.base import InferenceEngine, WeightUpdate
from areal.engines.weights_check import FrozenStateDict
from areal.engines.weights_stream import MalformedWeights, SafetensorsSink
from schemas import WeightAnnouncement

log = structlog.get_logger()

StateDict = dict[str, torch.Tensor]

LOAD_RETRY_S = 1.0  # pause after a failed weight load, doubled per failure in a row ...
LOAD_RETRY_MAX_S = 30.0  # ... up to this
AWAIT_ANNOUNCEMENT_S = 2.0  # a needed version not announced by then: ask the stream


class WeightsFollower:
    def __init__(
        self,
        bus: Bus,
        engine: InferenceEngine,
        sched: Scheduler[Any, StateDict],
        lock: threading.Lock,
        stats: dict[str, Any],
        *,
        weights_from_bytes: Callable[[bytes], StateDict] | None = None,
    ) -> None:
        self.bus, self.engine, self.sched, self._lock = bus, engine, sched, lock
        self.stats = stats  # the service's: weight_load_s, weight_loads are added here
        self.stats |= {"weight_load_s": 0.0, "weight_loads": 0}
        # None: stream safetensors into tensors (`_fetch`); a decoder: fetch whole, decode it
        self.weights_from_bytes = weights_from_bytes
        # newest version known to be published: 0 (the initial weights) before any announcement,
        # since the controller admits at version 0 before the trainer has announced anything
        self.published = 0
        self.sub: StreamFollower | None = None  # while subscribed (`start` .. `close`)
        self._changed = asyncio.Event()
        self._fetching: set[int] = set()  # versions being downloaded (guarded by _lock)
        self._to_fetch: WeightAnnouncement | None = None  # the newest not yet taken up
        self._fetcher: asyncio.Future[None] | None = None  # the task fetching (`on_weights`)
        # the last update `poll_at_boundary` handed the engine during a `generate` call
        self._switching: tuple[int, StateDict] | None = None
        self._load_failures = 0  # weight loads failed in a row (the retry pause doubles)

    async def start(self) -> None:
        self.sub = await self.bus.subscribe_weights(self.on_weights)

    async def close(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()
        if self._fetcher is not None:
            self._fetcher.cancel()

    # ------------------------------------------------------------------ fetch
    def _fetch_covers(self, version: int) -> bool:
        """A fetch of `version` or a newer one is already running (no second download)."""
        return bool(self._fetching) and max(self._fetching) >= version

    async def on_weights(self, ann: WeightAnnouncement) -> None:
        """A weights announcement (the subscription's callback; `await_version` calls it too):
        fetch, check and offer the weights, if newer than any known (module invariants)."""
        if self.bus.weights_rejection(ann) is not None:  # not the trainer's (logged): ignore
            return
        self.published = max(self.published, ann.version)
        if self._to_fetch is None or ann.version > self._to_fetch.version:
            self._to_fetch = ann
        if self._fetcher is None or self._fetcher.done():
            self._fetcher = asyncio.ensure_future(self._fetch_announced())
        await asyncio.shield(self._fetcher)

    async def _fetch_announced(self) -> None:
        """The fetcher task: the newest announcement handed in, until none is left."""
        while self._to_fetch is not None:
            ann, self._to_fetch = self._to_fetch, None
            await self._fetch_and_offer(ann)

    async def _fetch_and_offer(self, ann: WeightAnnouncement) -> None:
        with self._lock:
            if ann.version <= self.sched.known_version or self._fetch_covers(ann.version):
                return
            self._fetching.add(ann.version)
        t0 = time.perf_counter()
        try:
            state = await self._fetch(ann)
            await asyncio.to_thread(self._check_weights, state, ann.version)
        except (WeightsRejected, MalformedWeights) as e:  # nothing was loaded: current weights stay
            log.warning("weights_rejected", version=ann.version, reason=str(e))
            return
        except Exception as e:  # a bad or vanished version: keep generating, a newer one comes
            log.error("weights_load_failed", version=ann.version, error=str(e))
            return
        finally:
            with self._lock:
                self._fetching.discard(ann.version)
        with self._lock:
            self.sched.offer_weights(ann.version, state)
        fetch_s = time.perf_counter() - t0
        self.stats["weight_load_s"] += fetch_s
        self.stats["weight_loads"] += 1
        mib_s = ann.nbytes / 2**20 / max(fetch_s, 1e-9)
        log.info(
            "weights_fetched", version=ann.version, fetch_s=round(fetch_s, 3), mib_s=round(mib_s)
        )
        self._changed.set()

    async def _fetch(self, ann: WeightAnnouncement) -> FrozenStateDict:
        """The announced weights, verified (`Bus.fetch_weights`): streamed straight into
        tensors, or with `weights_from_bytes` fetched whole and decoded in a worker thread."""
        if self.weights_from_bytes is None:
            return (await self.bus.fetch_weights(ann, SafetensorsSink)).state_dict()
        data = await self.bus.get_weights(ann)
        return FrozenStateDict(await asyncio.to_thread(self.weights_from_bytes, data))

    def _check_weights(self, state: FrozenStateDict, version: int) -> None:
        """Worker thread: the state dict must fit the engine's model whole, so a bad blob never
        reaches the scheduler."""
        try:
            self.engine.check_weights(state, version)
        except ValueError as e:
            raise WeightsRejected(str(e)) from None

    async def await_version(self, version: int, stop: asyncio.Event) -> None:
        """The next task needs `version`, not fetched yet: wait a while for its announcement;
        if none came and no fetch covers it, ask the stream for the latest (a missed one)."""
        self._changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), AWAIT_ANNOUNCEMENT_S)
        with self._lock:
            missing = self.sched.known_version < version and not self._fetch_covers(version)
        if missing and not stop.is_set():
            ann = await self.bus.latest_weights()
            if ann is not None:
                self.announcement_missed(ann.version)
                await self.on_weights(ann)

    async def refresh_published(self) -> int:
        """The newest published version, asked of the stream (a task admitted at a version no
        announcement has told this worker about yet)."""
        ann = await self.bus.latest_weights()
        if ann is not None:
            self.announcement_missed(ann.version)
            self.published = max(self.published, ann.version)
        return self.published

    def announcement_missed(self, version: int) -> None:
        """When the stream holds a version the subscription did not deliver: its consumer is
        likely gone with a cluster node this worker's connection was not on (no reconnect to
        renew it): make it again now, not after the library's 10-20 s heartbeat timeout."""
        if version > self.published and self.sub is not None:
            log.info("weights_subscription_renewed", version=version)
            self.sub.renew_soon()

    # ------------------------------------------------------------------ load
    def poll_at_boundary(self) -> WeightUpdate | None:
        """Generating thread, at token boundaries (interruptible mode): the update the engine
        loads now, kept until `generate` returns (a load that fails raises out of it)."""
        with self._lock:
            update = self.sched.switch_at_boundary(time.monotonic())
            if update is not None:
                self._switching = update
        return WeightUpdate(*update) if update is not None else None

    async def load_between_batches(self, stop: asyncio.Event) -> bool:
        """Load the pending update, if any; False when the load failed (then it is pending
        again, and the pause before its retry is over)."""
        with self._lock:
            update = self.sched.switch_between_batches(time.monotonic())
        if update is None:
            return True
        try:
            await asyncio.to_thread(self.engine.load_weights, WeightUpdate(*update))
        except Exception as e:  # refused or failed (CUDA, RPC, disk): retried after a pause
            await self._load_failed(update, e, stop)
            return False
        self._load_failures = 0
        log.info("weights_loaded", policy_version=update[0])
        return True

    async def after_generate(self, error: Exception | None, stop: asyncio.Event) -> None:
        """After a `generate` call: did the engine load what `poll_at_boundary` handed it? A
        load that raised out of `generate` left the engine on an older version."""
        with self._lock:
            switching, self._switching = self._switching, None
        if switching is None:
            return
        if self.engine.version >= switching[0]:
            self._load_failures = 0
        else:
            await self._load_failed(switching, error or RuntimeError("load not done"), stop)

    async def _load_failed(
        self, update: tuple[int, StateDict], error: BaseException, stop: asyncio.Event
    ) -> None:
        """The engine did not load `update`: the scheduler goes back to the engine's version
        with the update kept for a retry, after a pause (the module invariants)."""
        with self._lock:
            self.sched.switch_failed(update, self.engine.version)
        pause_s = min(LOAD_RETRY_S * 2 ** min(self._load_failures, 16), LOAD_RETRY_MAX_S)
        self._load_failures += 1
        log.error(
            "weights_load_failed",
            version=update[0],
            policy_version=self.engine.version,
            error=f"{type(error).__name__}: {error}",
            failures_in_a_row=self._load_failures,
            retry_in_s=pause_s,
        )
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), pause_s)
