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

The trainer's weights are the follower's (`areal.services.weights_follower.WeightsFollower`:
fetched, verified, offered to the scheduler, loaded at a token boundary or between batches);
this service asks it for a version a task needs and lets it load at the points `generate`
offers.

Invariants (the scheduling ones are the core's, the weights ones the follower's):
- every generated token carries the behaviour log-prob and the policy version that produced it;
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
- a weight load that fails leaves the engine on the version it held, and a running batch is
  handed back; nothing generates until a load goes through (the model may hold a half-loaded
  mix), so tokens keep the version that really produced them and no task starts on weights
  older than its admission version;
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

from areal.bus.client import Bus, Lease
from areal.core.scheduling import Joined, Request, Scheduler, SchedulerPolicy
from areal.core.validate import Bounds, Verdict, check_task
from areal.engines.base import GenRequest, InferenceEngine, SamplingParams
from areal.services.common import BusyMeter, heartbeat_loop
from areal.services.episodes import EpisodeHost
from areal.services.evaluation import Evaluator
from areal.services.samples import publish_group, rejection_marker, sample_of_episode
from areal.services.weights_follower import StateDict, WeightsFollower
from areal.workflows.api import Episode, RolloutWorkflow
from areal.workflows.context import WorkflowContext
from areal.workflows.single_turn import SingleTurn
from schemas import Sample, SampleGroup, Task
from schemas import subjects as S
from schemas.state import EvalClaim, eval_claim_key

log = structlog.get_logger()

HAND_BACK_DELAY_S = 1.0  # a task handed back (nak) is redelivered after this (the bus's too)


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
        self.evaluator = evaluator
        self.bounds = bounds or Bounds.with_model(
            engine, run_id=bus.names.run_id, max_new_tokens=params.max_new_tokens
        )
        self.sched: Scheduler[Lease, StateDict] = Scheduler(policy, engine.version)
        self._lock = threading.Lock()
        self.stats = dict.fromkeys(("samples", "tokens", "interrupts", "reprefill_tokens"), 0)
        self.stats |= {"adopted_redeliveries": 0, "eval_rounds": 0}
        self.stats |= {"rejected_tasks": 0, "workflow_failures": 0}
        self.weights = WeightsFollower(
            bus, engine, self.sched, self._lock, self.stats, weights_from_bytes=weights_from_bytes
        )
        self._tasks: dict[str, tuple[Task, float]] = {}  # task id -> (task, received at)
        self._finished: dict[str, dict[int, Sample]] = {}  # task id -> its finished samples
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

    # ------------------------------------------------------------------ tasks
    async def _check(self, task: Task) -> Verdict | None:
        verdict = check_task(task, self.bounds, latest_version=self.weights.published)
        if verdict is not None and verdict.stale_view:  # an announcement not seen yet?
            published = await self.weights.refresh_published()
            verdict = check_task(task, self.bounds, latest_version=published)
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

    async def _load_for_eval(self, stop: asyncio.Event) -> bool:
        """Idle: load fetched weights whose evaluation round is due. The run's final version is
        published when no task is left to generate with it, so only this evaluates it."""
        if self.evaluator is None:
            return False
        with self._lock:
            pending = self.sched.pending[0] if self.sched.pending is not None else None
        if pending is None or self.evaluator.due(pending) is None:
            return False
        return await self.weights.load_between_batches(stop)

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
            if idle and await self._load_for_eval(stop):
                continue  # a round is due on the weights just loaded
            if idle:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._queue_changed.wait(), 0.5)
                continue
            if needed is not None:
                await self.weights.await_version(needed, stop)
                continue
            if not await self.weights.load_between_batches(stop):
                continue  # nothing generates until a load goes through (retried after a pause)
            error: Exception | None = None
            poll_weights = self.weights.poll_at_boundary if self.policy.interruptible else None
            self.meter.start()
            try:
                await asyncio.to_thread(
                    self.engine.generate,
                    [],
                    params=self.params,
                    poll_weights=poll_weights,
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
            await self.weights.after_generate(error, stop)

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
        await self.weights.start()
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
            await self.weights.close()
            if self.evaluator is not None:
                self.evaluator.close()
            # what this replica did: `docker compose logs rollout` shows each replica's share
            log.info("rollout_stopped", **self.stats)
            with contextlib.suppress(asyncio.CancelledError):
                await gen  # re-raises the loop's failure, if it failed
