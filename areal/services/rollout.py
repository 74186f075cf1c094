"""Rollout: pulls tasks, runs G episodes each (the workflow's: `rollout.workflow`), publishes
each task's group once its last episode finishes (one `SampleGroup` message per task).

Each sample the scheduler starts is an episode on the event loop (`EpisodeHost`); its turns join
the engine's running batch at token boundaries, so many episodes decode together and a tool
wait frees the row. A workflow that raises costs only its own task (dead-lettered with the
traceback, a rejection marker gives its slot back).

The decisions are `areal.core.scheduling.Scheduler` (which requests join the running batch,
when to switch weights, what a redelivery means); this shell fetches weights, runs the engine in
a thread, publishes samples and settles leases. The scheduler is shared with the generating
thread under `_lock`.

Invariants (the scheduling ones are the core's):
- every generated token carries the behaviour log-prob and the policy version that produced it;
- weights are fetched and verified off the event loop, then handed to the generating thread:
  only announcements the trainer signed are fetched (`areal.bus.run_weights`), and only a blob
  that fits the model whole (`InferenceEngine.check_weights`) is offered, so a refused one
  changes no parameter and the worker keeps generating on the weights it has;
- weights stream into tensors as they arrive (`areal.engines.weights_stream.SafetensorsSink`):
  the blob is never whole in memory; their values are scanned for NaN/inf once per version,
  here (the `FrozenStateDict` offered lets the engine's `load_weights` skip a second scan);
- a task is checked against the run before it is scheduled (`areal.core.validate`: token ids in
  the vocabulary, a prompt that fits the context, a version that was published): one that does
  not fit is dead-lettered with the reason on its first delivery and a rejection marker goes on
  for it (the trainer retires the task), so a bad task never reaches the engine, never blocks
  the scheduler and never fails the tasks generating beside it;
- a finished sample is kept here (decoded, timed) until its task's G samples are all finished,
  then the group goes out as one message (the trainer needs all G before it can use any, and
  the bus pays per message; a group over `max_payload` goes in parts: `publish_group`); a task's message is acked only after its group is published; a
  redelivery of a task in progress here is adopted (held and acked with it), and a task whose
  group cannot be published, or whose generation fails, is handed back (nak) for another
  attempt, up to `nats.max_deliver` deliveries: then it is dead-lettered and a rejection
  marker retires it (`Bus.consume` with `refuse`), never left undelivered;
- a task handed back is redelivered after `HAND_BACK_DELAY_S`, so a failing engine does not
  spin tasks through redeliveries;
- a weight load that fails (at a token boundary or between batches; any error) leaves the
  engine on the version it held: the scheduler goes back to it (`Scheduler.switch_failed`), a
  running batch is handed back, and the update is retried between batches after a pause that
  doubles from `LOAD_RETRY_S` to `LOAD_RETRY_MAX_S` per failure in a row (back to
  `LOAD_RETRY_S` once a load goes through). Nothing generates until one does (the model may
  hold a half-loaded mix), so tokens keep the version that really produced them and no task
  starts on weights older than its admission version;
- with an `Evaluator`, a due evaluation round lets the running batch finish (no new requests
  join it), then runs between batches on the weights held (`areal/services/evaluation.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

import structlog
import torch

from areal.bus.client import Bus, Lease
from areal.bus.errors import WeightsRejected
from areal.bus.follow import StreamFollower
from areal.core.scheduling import Joined, Request, Scheduler, SchedulerPolicy
from areal.core.validate import Bounds, Verdict, check_task
from areal.engines.base import GenRequest, InferenceEngine, SamplingParams, WeightUpdate
from areal.engines.weights_check import FrozenStateDict
from areal.engines.weights_stream import MalformedWeights, SafetensorsSink
from areal.services.common import BusyMeter, heartbeat_loop
from areal.services.episodes import EpisodeHost
from areal.services.evaluation import Evaluator
from areal.services.samples import publish_group, rejection_marker, sample_of_episode
from areal.workflows.api import Episode, RolloutWorkflow
from areal.workflows.context import WorkflowContext
from areal.workflows.single_turn import SingleTurn
from schemas import Sample, SampleGroup, Task, WeightAnnouncement
from schemas import subjects as S
from schemas.state import EvalClaim, eval_claim_key

log = structlog.get_logger()

StateDict = dict[str, torch.Tensor]

HAND_BACK_DELAY_S = 1.0  # a task handed back (nak) is redelivered after this (the bus's too)
LOAD_RETRY_S = 1.0  # pause after a failed weight load, doubled per failure in a row ...
LOAD_RETRY_MAX_S = 30.0  # ... up to this


def _no_encoder(text: str) -> list[int]:
    raise RuntimeError("this rollout was built without a tokenizer's encoder")


def _sample_group(samples: list[Sample]) -> SampleGroup:
    return SampleGroup(samples=samples)


class RolloutService:
    def __init__(
        self,
        bus: Bus,
        engine: InferenceEngine,
        decode_text: Callable[[list[int]], str],
        params: SamplingParams,
        *,
        policy: SchedulerPolicy,
        max_concurrent_tasks: int,
        weights_from_bytes: Callable[[bytes], StateDict] | None = None,
        evaluator: Evaluator | None = None,
        bounds: Bounds | None = None,
        workflow: RolloutWorkflow | None = None,
    ) -> None:
        self.bus, self.engine, self.decode_text, self.params = bus, engine, decode_text, params
        self.policy, self.max_concurrent_tasks = policy, max_concurrent_tasks
        # None: stream safetensors into tensors (`_fetch`); a decoder: fetch whole, decode it
        self.weights_from_bytes = weights_from_bytes
        self.evaluator = evaluator
        self.bounds = bounds or Bounds.with_model(
            engine, run_id=bus.names.run_id, max_new_tokens=params.max_new_tokens
        )
        # newest version known to be published: 0 (the initial weights) before any announcement,
        # since the controller admits at version 0 before the trainer has announced anything
        self._published = 0
        self.sched: Scheduler[Lease, StateDict] = Scheduler(policy, engine.version)
        self._lock = threading.Lock()
        self._tasks: dict[str, tuple[Task, float]] = {}  # task id -> (task, received at)
        self._finished: dict[str, dict[int, Sample]] = {}  # task id -> its finished samples
        self._weights_changed = asyncio.Event()
        self._weights_sub: StreamFollower | None = None  # while `run` runs
        self._fetching: set[int] = set()  # versions being downloaded (guarded by _lock)
        self._to_fetch: WeightAnnouncement | None = None  # the newest not yet taken up
        self._fetcher: asyncio.Future[None] | None = None  # the task fetching (`on_weights`)
        # the last update `_poll_weights` handed the engine during a `generate` call
        self._switching: tuple[int, StateDict] | None = None
        self._load_failures = 0  # weight loads failed in a row (the retry pause doubles)
        self._queue_changed = asyncio.Event()
        if workflow is None:
            ctx = WorkflowContext(
                decode=decode_text, encode=_no_encoder, max_new_tokens=params.max_new_tokens
            )
            workflow = SingleTurn(ctx)
        self.host = EpisodeHost(
            workflow, self._episode_done, self._episode_failed, self._queue_changed.set
        )
        self._loop: asyncio.AbstractEventLoop | None = None  # while `run` runs
        self._publishes: set[asyncio.Task] = set()
        self.meter = BusyMeter()
        self.stats = dict.fromkeys(("samples", "tokens", "interrupts", "reprefill_tokens"), 0)
        self.stats |= {"weight_load_s": 0.0, "weight_loads": 0, "adopted_redeliveries": 0}
        self.stats |= {"eval_rounds": 0, "rejected_tasks": 0, "workflow_failures": 0}

    # ------------------------------------------------------------------ weights
    def _fetch_covers(self, version: int) -> bool:
        """A fetch of `version` or a newer one is already running (no second download)."""
        return bool(self._fetching) and max(self._fetching) >= version

    async def on_weights(self, ann: WeightAnnouncement) -> None:
        """A weights announcement (the subscription's callback; `_await_version` calls it too):
        fetch, check and offer the weights, if newer than any known. The fetch runs in a task of
        the service's own, which the caller awaits shielded: a renewal of the subscription (at
        every reconnect) cancels the callback under way, not the download, which would
        otherwise start over from the new subscription's first delivery."""
        if self.bus.weights_rejection(ann) is not None:  # not the trainer's (logged): ignore
            return
        self._published = max(self._published, ann.version)
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
        self._weights_changed.set()

    async def _fetch(self, ann: WeightAnnouncement) -> FrozenStateDict:
        """The announced weights, verified (`Bus.fetch_weights`): streamed straight into
        tensors, or with `weights_from_bytes` fetched whole and decoded in a worker thread."""
        if self.weights_from_bytes is None:
            return (await self.bus.fetch_weights(ann, SafetensorsSink)).state_dict()
        data = await self.bus.get_weights(ann)
        return FrozenStateDict(await asyncio.to_thread(self.weights_from_bytes, data))

    def _check_weights(self, state: FrozenStateDict, version: int) -> None:
        """Worker thread: the state dict must fit the engine's model whole (names, shapes,
        dtypes, finite values), so a bad blob never reaches the scheduler."""
        try:
            self.engine.check_weights(state, version)
        except ValueError as e:
            raise WeightsRejected(str(e)) from None

    async def _await_version(self, version: int, stop: asyncio.Event) -> None:
        self._weights_changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._weights_changed.wait(), 2.0)
        with self._lock:
            missing = self.sched.known_version < version and not self._fetch_covers(version)
        if missing and not stop.is_set():  # a missed announcement? ask the stream
            ann = await self.bus.latest_weights()
            if ann is not None:
                self._announcement_missed(ann.version)
                await self.on_weights(ann)

    def _announcement_missed(self, version: int) -> None:
        """When the stream holds a version the subscription did not deliver: its consumer is likely
        gone with a cluster node this worker's connection was not on (no reconnect to renew
        it): make it again now, not after the library's 10-20 s heartbeat timeout."""
        if version > self._published and self._weights_sub is not None:
            log.info("weights_subscription_renewed", version=version)
            self._weights_sub.renew_soon()

    # ------------------------------------------------------------------ tasks
    async def _check(self, task: Task) -> Verdict | None:
        verdict = check_task(task, self.bounds, latest_version=self._published)
        if verdict is not None and verdict.stale_view:  # an announcement not seen yet?
            ann = await self.bus.latest_weights()
            if ann is not None:
                self._announcement_missed(ann.version)
                self._published = max(self._published, ann.version)
            verdict = check_task(task, self.bounds, latest_version=self._published)
        return verdict

    async def _refuse(self, task: Task, lease: Lease, reason: str) -> None:
        """Dead-letter `task`; if it names a task of this run, a marker tells the trainer."""
        self.stats["rejected_tasks"] += 1
        if task.task_id == self.bounds.task_id(task.seq):
            g = self.bounds.group_size or task.group_size
            marker = rejection_marker(
                task.task_id, task.seq, g, reason, worker_id=self.bus.worker_id
            )
            await self.bus.publish(S.TRAJECTORIES, SampleGroup(samples=[marker]))
        await lease.dead_letter(reason)

    async def handle(self, task: Task, lease: Lease) -> None:
        """File the task; its lease is settled when its samples are published (or it fails)."""
        verdict = await self._check(task)
        if verdict is not None:
            await self._refuse(task, lease, verdict.reason)
            return
        with self._lock:
            joined = self.sched.on_task(task.task_id, task.group_size, task.admitted_version, lease)
            if joined is Joined.NEW:
                self._tasks[task.task_id] = (task, time.time())
        if joined is Joined.ADOPTED:
            self.stats["adopted_redeliveries"] += 1
            log.warning("task_redelivered_in_progress", task_id=task.task_id)
        self._queue_changed.set()

    def _poll_requests(self) -> list[GenRequest]:
        """Generating thread, at token boundaries: samples the scheduler starts begin their
        episodes (on the loop), and the turns episodes have queued join the batch. Not
        interruptible with an update pending, no turn joins either: the batch drains, then
        the update is loaded between batches."""
        if self._eval_due() is not None:
            return []  # let the batch drain: the round runs between batches
        with self._lock:
            reqs = self.sched.take_requests(time.monotonic())
            hold = not self.policy.interruptible and self.sched.pending is not None
            tasks = [self._tasks[r.task_id][0] for r in reqs]
        if self.host.direct:  # one generation from the prompt: no coroutine per sample
            return [self.host.direct_request(r, t) for r, t in zip(reqs, tasks, strict=True)]
        assert self._loop is not None
        for r in reqs:
            self._loop.call_soon_threadsafe(self._start_episode, r)
        return [] if hold else self.host.take_turns()

    def _start_episode(self, r: Request) -> None:
        entry = self._tasks.get(r.task_id)
        if entry is not None:  # else its task failed meanwhile
            self.host.start(r, entry[0])

    def _poll_weights(self) -> WeightUpdate | None:
        """Generating thread, at token boundaries (interruptible mode): the update the engine
        loads now, kept until `generate` returns (a load that fails raises out of it)."""
        with self._lock:
            update = self.sched.switch_at_boundary(time.monotonic())
            if update is not None:
                self._switching = update
        return WeightUpdate(*update) if update is not None else None

    async def _load_between_batches(self, stop: asyncio.Event) -> bool:
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

    async def _switched_at_boundaries(self, error: Exception | None, stop: asyncio.Event) -> None:
        """After a `generate` call: did the engine load what `_poll_weights` handed it? A load
        that raised out of `generate` left the engine on an older version."""
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

    def _episode_done(self, r: Request, episode: Episode) -> None:
        """Event loop: file the episode's sample; a complete group goes out."""
        if r.task_id not in self._tasks:  # its task failed and was handed back
            return
        if self.sched.policy.needed_first:  # only its hold reads which samples are generated
            with self._lock:
                self.sched.sample_generated(r.task_id, r.index)
        task, received_at = self._tasks[r.task_id]
        sample = sample_of_episode(
            task, r.index, episode, worker_id=self.bus.worker_id, received_at=received_at
        )
        self._file_sample(sample)

    async def _episode_failed(self, r: Request, trace: str) -> None:
        """The workflow raised: its task is dead-lettered with the traceback and a rejection
        marker retires it (its slot comes back); the other tasks go on."""
        entry = self._tasks.get(r.task_id)
        if entry is None:
            return
        task = entry[0]
        self.stats["workflow_failures"] += 1
        last = trace.strip().splitlines()[-1] if trace.strip() else "?"
        log.error("workflow_failed", task_id=r.task_id, sample_idx=r.index, error=last)
        self.host.cancel_task(r.task_id)
        with self._lock:
            leases = self.sched.task_failed(r.task_id)
            self._tasks.pop(r.task_id, None)
            self._finished.pop(r.task_id, None)
        reason = f"workflow raised on sample {r.index}: {trace[-3000:]}"
        g = self.bounds.group_size or task.group_size
        marker = rejection_marker(task.task_id, task.seq, g, reason, worker_id=self.bus.worker_id)
        try:
            await self.bus.publish(S.TRAJECTORIES, SampleGroup(samples=[marker]))
        except Exception as e:  # no marker, no dead letter: hand the task back instead
            log.error("rejection_marker_failed", task_id=r.task_id, error=str(e))
            for lease in leases:
                await lease.nak(delay_s=HAND_BACK_DELAY_S)
            return
        self.stats["rejected_tasks"] += 1
        for i, lease in enumerate(leases):  # redeliveries adopted here are the same message
            await (lease.dead_letter(reason) if i == 0 else lease.ack())

    def _file_sample(self, sample: Sample) -> None:
        task_id = sample.task_id
        task, _ = self._tasks[task_id]
        finished = self._finished.setdefault(task_id, {})
        finished[sample.sample_idx] = sample
        if len(finished) < task.group_size:
            return
        del self._finished[task_id]
        t = asyncio.ensure_future(self._publish_group(task_id, finished))
        self._publishes.add(t)
        t.add_done_callback(self._publishes.discard)

    async def _publish_group(self, task_id: str, finished: dict[int, Sample]) -> None:
        samples = [finished[i] for i in sorted(finished)]
        try:
            await publish_group(self.bus, S.TRAJECTORIES, samples, _sample_group)
        except Exception as e:  # hand the task back: another attempt publishes the same id
            log.error("group_publish_failed", task_id=task_id, error=str(e))
            await self._settle(self.sched.task_failed, task_id, ack=False)
            return
        self.stats["samples"] += len(samples)
        for sample in samples:
            self.stats["tokens"] += len(sample.output_ids)
            self.stats["interrupts"] += sample.n_interrupts
            self.stats["reprefill_tokens"] += sample.n_reprefill_tokens
        await self._settle(self._group_published(samples), task_id, ack=True)

    def _group_published(self, samples: list[Sample]) -> Callable[[str], list[Lease]]:
        def decide(task_id: str) -> list[Lease]:
            return [h for s in samples for h in self.sched.sample_published(task_id, s.sample_idx)]

        return decide

    async def _settle(self, decide: Callable[[str], list[Lease]], task_id: str, ack: bool) -> None:
        with self._lock:
            leases = decide(task_id)
            inactive = not self.sched.is_active(task_id)
            if inactive:
                self._tasks.pop(task_id, None)
                self._finished.pop(task_id, None)
        if inactive:
            self.host.cancel_task(task_id)
        for lease in leases:
            await (lease.ack() if ack else lease.nak(delay_s=HAND_BACK_DELAY_S))

    # ------------------------------------------------------------------ evaluation
    def _eval_due(self) -> int | None:
        return self.evaluator.due(self.engine.version) if self.evaluator is not None else None

    async def _run_eval(self, rnd: int) -> None:
        ev = self.evaluator
        assert ev is not None
        ev.skip(rnd)
        claim = EvalClaim(round=rnd, worker_id=self.bus.worker_id, claimed_at=time.time())
        try:
            if not await self.bus.kv_claim(eval_claim_key(rnd), claim):
                return  # another replica runs this round
            t0 = time.perf_counter()
            self.meter.start()
            try:
                version, outs = await asyncio.to_thread(ev.generate, self.engine)
            finally:
                self.meter.stop()
            texts = [self.decode_text(o.output_ids) for o in outs]
            scores = await ev.score(texts)
            values = ev.summary(rnd, version, outs, scores, time.perf_counter() - t0)
            await self.bus.metric("eval", values)
        except Exception as e:  # a failed round is skipped; training samples go on
            log.error("eval_round_failed", round=rnd, error=f"{type(e).__name__}: {e}")
            return
        self.stats["eval_rounds"] += 1
        log.info("eval_round", **{k: values[k] for k in ("round", "version", "eval_reward", "n")})

    # ------------------------------------------------------------------ generation
    async def _generate_loop(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self.host.bind(self._loop)
        while not stop.is_set():
            rnd = self._eval_due()
            if rnd is not None:
                await self._run_eval(rnd)
                continue
            self._queue_changed.clear()  # before the check: a turn queued after it wakes us
            with self._lock:
                idle, needed = not self.sched.queue, self.sched.needed_version()
            idle = idle and not self.host.has_turns()
            if idle:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._queue_changed.wait(), 0.5)
                continue
            if needed is not None:
                await self._await_version(needed, stop)
                continue
            if not await self._load_between_batches(stop):
                continue  # nothing generates until a load goes through (retried after a pause)
            error: Exception | None = None
            self.meter.start()
            try:
                await asyncio.to_thread(
                    self.engine.generate,
                    [],
                    params=self.params,
                    poll_weights=self._poll_weights if self.policy.interruptible else None,
                    on_finished=self.host.turn_finished,
                    poll_requests=self._poll_requests,
                )
            except Exception as e:  # engine failure: hand every task back (nak), keep running
                log.exception("generate_failed")
                error = e
                with self._lock:
                    leases, self._tasks, self._finished = self.sched.fail_all(), {}, {}
                self.host.cancel_all()
                for lease in leases:
                    await lease.nak(delay_s=HAND_BACK_DELAY_S)
            finally:
                self.meter.stop()
            await self._switched_at_boundaries(error, stop)

    def heartbeat(self) -> dict:
        return {
            **self.stats,
            "version": self.engine.version,
            "busy_frac": self.meter.busy_frac(),
            "inflight_tasks": len(self.sched.tasks),
            "queued_seqs": len(self.sched.queue),
            "episodes": self.host.active,
        }

    async def run(self, stop: asyncio.Event) -> None:
        sub = self._weights_sub = await self.bus.subscribe_weights(self.on_weights)
        log.info("rollout_started", policy=vars(self.policy), policy_version=self.engine.version)
        gen = asyncio.create_task(self._generate_loop(stop))
        gen.add_done_callback(lambda _: stop.set())  # a generate loop that died stops the worker
        hb = asyncio.create_task(heartbeat_loop(self.bus, self.heartbeat, stop))
        try:
            await self.bus.consume(
                S.PROMPTS,
                Task,
                self.handle,
                max_inflight=self.max_concurrent_tasks,
                stop=stop,
                refuse=self._refuse,
            )
        finally:
            gen.cancel()
            hb.cancel()
            await self.host.close()
            await sub.unsubscribe()
            if self._fetcher is not None:
                self._fetcher.cancel()
            if self.evaluator is not None:
                self.evaluator.close()
            # what this replica did: `docker compose logs rollout` shows each replica's share
            log.info("rollout_stopped", **self.stats)
            with contextlib.suppress(asyncio.CancelledError):
                await gen  # re-raises the loop's failure, if it failed
