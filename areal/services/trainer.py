"""Trainer: files scored groups (one message per task), trains decoupled-PPO steps on fresh
batches, publishes new weights, and checkpoints so a restart resumes with nothing lost.

The decisions are `areal.core.intake.Intake` (grouping, de-duplication, freshness, batches,
accounting); this shell decodes, trains, publishes and acks.

Invariants:
- per step the order is: train -> publish weights -> KV (version, returned slots) -> step record
  -> checkpoint -> ack; the controller never sees a version whose weights are not announced
  (the published run state names at most the last announced version);
- weights up to `overlap_publish_max_bytes` are copied to host memory after the step and
  uploaded, announced and followed by the run state while the next step trains (the upload
  touches no live tensor); larger ones stream out in line. Versions go out in order: a step
  waits for the previous publish before starting its own, and a publish that failed raises
  there, so the trainer stops one step later at most, with nothing acked past its checkpoint;
- a retired (stale or filtered) group is announced as a `task_dropped_stale` / `task_filtered`
  event at once; its slot goes back to admission (KV) once a checkpoint covers it, and the
  trainer checkpoints before it waits for more data, so a slot is never held back long;
- a scored group is acked only once a checkpoint covers its effect (`Checkpointer`);
- every write (weights, checkpoint, metrics.jsonl, eval.jsonl, summary.json, the final model)
  goes through one `StorageGuard` (`areal.services.storage`): a full or failing disk pauses
  the write and what follows it (acks included), says so once (`storage_full` /
  `write_failed`, then `storage_recovered`: run events) and retries until the write lands;
- nothing reaches the optimizer unchecked (`areal.core.validate`): a scored group that does not
  fit the run is dead-lettered with the reason on its first delivery, and if it belongs to a
  task the controller admitted and that is still open, the task is retired as `rejected` (its
  slot goes back to admission, so the run still finishes with exact accounting). One that names
  a task the controller never meant to admit (its intent, `admitting`, is recorded before the
  task is published) is handed back until `nats.max_deliver`, then dead-lettered. A step whose
  loss or gradient is not finite changes no weight (`skipped_steps`, a `step_skipped` event);
- a restart resumes from the checkpoint: later step records are dropped from metrics.jsonl
  (they are redone), and if newer weights were already announced the version rolls forward
  past them, so versions stay monotonic;
- `done` in the run state (KV) means "this trainer reached total_steps": a restored trainer
  publishes `done = False` before anything else (`restore`), so a finished run resumed with a
  larger `train.total_steps` is extended (see `areal.launch.worker.await_open_run` for why the
  other roles wait for that reset instead of exiting on the old `done`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from areal.algo.advantages import grpo_advantages
from areal.algo.registry import AdvantageFn
from areal.bus.blobs import WeightsBlob
from areal.bus.client import Bus, Lease
from areal.core.intake import Filed, Group, Intake, IntakePolicy, Retired
from areal.core.validate import Bounds, check_scored_group
from areal.engines.base import TrainEngine
from areal.engines.weights_stream import export_blob, host_copy, wire_dtype_of
from areal.services.batches import to_train_seqs
from areal.services.checkpoints import Checkpointer
from areal.services.common import BusyMeter, heartbeat_loop
from areal.services.run_files import EvalLog, MetricsLog, make_summary, write_summary
from areal.services.storage import StorageGuard
from schemas import MetricRecord, Sample, ScoredGroup
from schemas import subjects as S
from schemas.state import CONTROLLER_KEY, TRAINER_KEY, ControllerState, RunSummary, StepRecord

if TYPE_CHECKING:
    from areal.tracking import Tracker

log = structlog.get_logger()


@dataclass(frozen=True, kw_only=True)
class TrainerOptions:
    intake: IntakePolicy
    total_steps: int
    max_tokens_per_mb: int
    checkpoint_every: int = 1
    # a write failing on a full or failing disk pauses training this long at most, then the
    # trainer stops (None: until the write lands)
    storage_pause_max_s: float | None = None
    # rewards [n_groups, G] -> advantages (`algo.advantage`, resolved by `areal.algo.registry`)
    advantage: AdvantageFn = grpo_advantages
    weights_dtype: str = "float32"  # what the engine holds (`model.dtype`)
    wire_dtype: str = "auto"  # floating weights on the wire (`weights.wire_dtype`; auto: as held)
    weights_dir: str | None = None  # None: object store; else a shared dir (file:// URIs)
    mask_overlong: bool = False  # samples cut at max_new_tokens get advantage 0 (no gradient)
    # eval rounds at every K-th version (0: none); at the end the trainer waits this long for
    # the round on the final weights when K divides the final version
    eval_every_versions: int = 0
    final_eval_wait_s: float = 0.0
    bounds: Bounds | None = None  # what a scored sample must fit; None: identity + finiteness
    # weights up to this many bytes on the wire are published from a host copy while the next
    # step trains; larger ones stream out in line (no copy). 0: always in line
    overlap_publish_max_bytes: int = 256 * 2**20


class TrainerService:
    def __init__(
        self,
        bus: Bus,
        engine: TrainEngine,
        opts: TrainerOptions,
        out_dir: Path,
        tracker: Tracker | None = None,
    ) -> None:
        self.bus, self.engine, self.opts, self.out_dir = bus, engine, opts, Path(out_dir)
        self.tracker = tracker  # experiment trackers: handed each record, never waited for
        self.intake: Intake[Lease] = Intake(opts.intake)
        self.storage = StorageGuard(bus.event, give_up_s=opts.storage_pause_max_s)
        self.checkpoints = Checkpointer(
            engine, self.out_dir / "checkpoint", self._publish_state, storage=self.storage
        )
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl")
        self.evals: EvalLog | None = None  # opened in run(), once out_dir exists
        self._eval_landed = asyncio.Event()  # set at every round written to eval.jsonl
        self.meter = BusyMeter()
        self.t_start = time.time()
        self._data = asyncio.Event()
        self.bounds = opts.bounds or Bounds(
            run_id=bus.names.run_id, group_size=opts.intake.group_size
        )
        self._admitted_seen = 0  # the controller's admitted count, as last read
        self._overdue_seen: set[int] = set()  # overdue seqs already reported
        self._announced: int | None = None  # newest version whose weights are announced
        self._publishing: asyncio.Task[None] | None = None  # an overlapped publish in flight
        self.last_publish_s = 0.0  # export + upload + announce of the last publish that landed
        self._weights_bytes: int | None = None  # size of the last weights exported
        # tasks this much newer than an open one have ended: the open one is lost or stuck
        self.overdue_horizon = 4 * (opts.intake.max_staleness + 2) * opts.intake.batch_size

    async def handle(self, group: ScoredGroup, lease: Lease) -> None:
        s = group.first
        verdict = check_scored_group(group, self.bounds, latest_version=self.intake.state.version)
        if verdict is not None:
            await self._refuse(s, lease, verdict.reason)
            return
        if not await self._is_admitted(s.task_seq):
            await self._not_admitted(s, lease)
            return
        if s.rejected:  # a lone marker (a marker among samples failed the check above)
            await self._refuse(s, lease, f"rejected upstream: {s.rejected}", marker=True)
            return
        filed = self.intake.file(group.scored, lease)
        if filed is Filed.ACK_NOW:
            await lease.ack()
        elif filed is Filed.INVALID:
            await self._refuse(s, lease, self.intake.last_error)
        elif filed is Filed.COMPLETED:
            self._data.set()

    async def _is_admitted(self, seq: int) -> bool:
        """Task `seq` was admitted by the controller (re-read when it looks too new)."""
        if seq >= self._admitted_seen:  # a newer admission, or one that never happened
            ctrl = await self.bus.kv_get(CONTROLLER_KEY, ControllerState)
            if ctrl is not None:  # `admitting` is written before the tasks are published
                bound = max(ctrl.admitted, ctrl.admitting)
                self._admitted_seen = max(self._admitted_seen, bound)
        return seq < self._admitted_seen

    async def _not_admitted(self, s: Sample, lease: Lease) -> None:
        """A group of a task the controller never meant to admit (its intent is recorded before
        the task is published, so a legitimate group never lands here unless the run state was
        rolled back): a forgery or a message of another incarnation of the run id. It is handed
        back a few times all the same, in case the record is slow to read, then dead-lettered.

        The waits double (1, 2, 4, 8 s with the default 5 deliveries, capped at
        `nats.publish_timeout_s`).
        """
        if lease.num_delivered >= self.bus.settings.max_deliver:
            await lease.dead_letter(
                f"group {s.task_id[:90]}: task seq {s.task_seq} was never admitted "
                f"(the controller admitted {self._admitted_seen})"
            )
        else:
            delay_s = min(2.0 ** (lease.num_delivered - 1), self.bus.settings.publish_timeout_s)
            await lease.nak(delay_s=delay_s)

    async def _refuse(self, s: Sample, lease: Lease, reason: str, *, marker: bool = False) -> None:
        """Dead-letter a scored group (`s`: its first sample) that does not fit the run, or take
        a rejection `marker` (its stage dead-lettered the original); retire the task if it is
        admitted and open (else nothing of the run's accounting changes)."""
        own = s.task_id == self.bounds.task_id(s.task_seq) and await self._is_admitted(s.task_seq)
        if not own:
            await lease.dead_letter(reason)
            return
        filed, retired = self.intake.reject(s.task_id, s.task_seq, lease)
        if filed is Filed.ACK_NOW:  # the task ended long ago: nothing to account
            if marker:
                await lease.ack()
            else:
                await lease.dead_letter(reason)
            return
        if not marker:  # a marker's own stage dead-lettered the original already
            await self.bus.dead_letter(lease.stage, lease.msg, reason)  # the lease is held
        if retired is not None:
            log.warning("task_rejected", task_id=s.task_id, reason=reason[:300])
            await self._report_retired([retired], reason=reason)
            self._data.set()  # the retirement's slot goes back with the next checkpoint

    async def _next_batch(self, stop: asyncio.Event) -> list[Group[Lease]] | None:
        while not stop.is_set():
            self._data.clear()
            passed = self.intake.passed_stragglers
            pick = self.intake.take_batch(time.monotonic())
            if pick.retired:
                await self._report_retired(pick.retired)
            if self.intake.passed_stragglers > passed:
                log.info(
                    "stragglers_passed",
                    n=self.intake.passed_stragglers - passed,
                    waited_s=self.opts.intake.straggler_wait_s,
                )
            if pick.batch is not None:
                return pick.batch
            if self.intake.retired_unwritten:  # give their slots back before waiting
                await self.checkpoints.save(self.intake, background=False)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._data.wait(), min(1.0, pick.retry_in or 1.0))
        return None

    async def _publish_state(self) -> None:
        """The run state for admission; its version is at most the last announced one (a
        checkpoint can land while the weights of the step it covers are still uploading)."""
        kv = self.intake.kv_state()
        if self._announced is not None and kv.version > self._announced:
            kv.version = self._announced
        await self.bus.kv_put(TRAINER_KEY, kv)

    async def _report_retired(self, retired: list[Retired], **detail: str) -> None:
        for r in retired:
            await self.bus.event(
                f"task_{r.reason}",
                task_id=r.task_id,
                version=self.intake.state.version,
                min_version=r.min_version,
                **detail,
            )

    async def step(self, batch: list[Group[Lease]], wait_s: float) -> StepRecord:
        o = self.opts
        info = self.intake.batch_info(batch, now=time.time())
        rewards = self.intake.rewards(batch)
        seqs = to_train_seqs(
            batch,
            rewards,
            advantage=o.advantage,
            mask_truncated=o.mask_overlong,
        )
        trained_on = self.engine.version
        self.meter.start()
        t0 = time.perf_counter()
        stats = await asyncio.to_thread(self.engine.train_step, seqs, o.max_tokens_per_mb)
        train_s = time.perf_counter() - t0
        self.meter.stop()
        skipped = bool(stats.get("step_skipped", 0.0))
        self.intake.commit_step(
            batch, version=self.engine.version, wall_s=time.time() - self.t_start, skipped=skipped
        )
        if skipped:
            log.error("step_skipped", step=self.intake.state.step, reason="non-finite loss/grad")
            await self.bus.event("step_skipped", step=self.intake.state.step)
        await self._publish_weights()
        rec = self.intake.step_record(
            info,
            trained_on_version=trained_on,
            admitted=await self._admitted(),
            timings={
                "train_s": train_s,
                "wait_s": wait_s,
                "weights_publish_s": self.last_publish_s,
                "checkpoint_s": self.checkpoints.last_write_s,
                "trainer_idle_frac": 1 - self.meter.busy_frac(),
            },
            stats=stats,
        )
        await self.storage.write_sync("metrics", self.metrics.path, self.metrics.append, rec)
        values = rec.model_dump(exclude_none=True)
        if self.tracker is not None:
            self.tracker.log_step(values)
        await self.bus.metric("step", values)
        await self._report_overdue()
        last = rec.step >= o.total_steps
        if rec.step % o.checkpoint_every == 0 or last or self.intake.retired_unwritten:
            await self.checkpoints.save(self.intake, background=not last)
        log.info(
            "train_step",
            step=rec.step,
            policy_version=rec.version,
            reward_mean=round(rec.reward_mean, 3),
            staleness_max=rec.staleness_max,
            loss=round(rec.loss, 4),
        )
        return rec

    async def _report_overdue(self) -> None:
        """Say so, once per task, when an admitted task has not ended long after its
        neighbours did (`Intake.overdue`): it was lost or is stuck upstream."""
        for seq in self.intake.overdue(self.overdue_horizon):
            if seq not in self._overdue_seen and len(self._overdue_seen) < 10_000:
                self._overdue_seen.add(seq)
                task_id = self.bounds.task_id(seq)
                log.warning("task_overdue", task_id=task_id, horizon=self.overdue_horizon)
                await self.bus.event("task_overdue", task_id=task_id, task_seq=seq)

    async def _admitted(self) -> int:
        ctrl = await self.bus.kv_get(CONTROLLER_KEY, ControllerState)
        return ctrl.admitted if ctrl is not None else 0

    async def _publish_weights(self) -> None:
        """Export the weights just trained, then store and announce them and publish the run
        state: in a task that overlaps the next step when they fit `overlap_publish_max_bytes`
        (from a host copy), else in line, streamed (cast to the wire dtype one tensor at a time,
        the blob never whole in memory: `weights_stream.export_blob`)."""
        await self.publish_settled()  # in version order; a failed publish raises here
        t0 = time.perf_counter()
        version, step = self.engine.version, self.intake.state.step
        wire = wire_dtype_of(self.opts.wire_dtype, self.opts.weights_dtype)
        blob = await asyncio.to_thread(export_blob, self.engine, wire)
        self._weights_bytes = blob.nbytes
        if blob.nbytes > self.opts.overlap_publish_max_bytes:
            await self._announce(version, blob, wire, step, t0)
            return
        copy = await asyncio.to_thread(host_copy, blob)
        self._publishing = asyncio.create_task(self._announce(version, copy, wire, step, t0))

    async def _announce(
        self, version: int, blob: WeightsBlob, wire: str, step: int, t0: float
    ) -> None:
        if self.opts.weights_dir is None:
            where = f"nats-obj://{self.bus.names.weights_bucket}/v{version}"
        else:
            where = str(Path(self.opts.weights_dir) / f"v{version}.safetensors")
        await self.storage.write(
            "weights",
            where,
            lambda: self.bus.put_weights(version, blob, wire, step, file_dir=self.opts.weights_dir),
            needs_bytes=blob.nbytes,
        )
        self._announced = max(self._announced or 0, version)
        self.last_publish_s = time.perf_counter() - t0
        await self._publish_state()

    async def publish_settled(self) -> None:
        """Wait for an overlapped publish to land (re-raises its failure)."""
        task, self._publishing = self._publishing, None
        if task is not None:
            await task

    async def restore(self) -> None:
        ckpt = self.checkpoints.load()
        if ckpt is not None:
            self.intake.restore(ckpt)
            await self.checkpoints.load_engine()
            self.t_start = time.time() - ckpt.trainer.wall_s
            await self.storage.write_sync(
                "metrics", self.metrics.path, self.metrics.truncate, ckpt.trainer.step
            )
            log.info("trainer_resumed", step=ckpt.trainer.step, policy_version=self.engine.version)
        else:  # an earlier incarnation died before its first checkpoint: its steps are redone
            await self.storage.write_sync("metrics", self.metrics.path, self.metrics.truncate, 0)
        latest = await self.bus.latest_weights()
        if latest is not None and latest.version > self.engine.version:
            # weights newer than the checkpoint were announced (a crash between publishing and
            # the next checkpoint): roll forward past them so versions stay monotonic. Only a
            # trusted announcement counts: `latest_weights` skips any the trainer did not sign.
            # The steps behind the skipped versions are redone under new ones
            log.warning(
                "version_rollforward", checkpoint=self.engine.version, announced=latest.version
            )
            self.engine.version = latest.version + 1
        self.intake.state.version = self.engine.version
        # admission counts steps (`TrainerState.published_steps`): every version beyond the
        # steps was skipped by a rollforward, this one or an earlier one (with or without a
        # checkpoint; also for a checkpoint written before the field existed)
        self.intake.state.versions_skipped = self.engine.version - self.intake.state.step
        # only `_finish` of this incarnation makes the run done: the first publish of the run
        # state (after the weights, if they go out now) resets the `done` a previous
        # incarnation left in KV, which is what lets `--resume` extend a run
        self.intake.state.done = False
        if latest is None or latest.version != self.engine.version:
            await self._publish_weights()
            await self.publish_settled()  # announced, then the run state
        else:
            self._announced = latest.version
            await self._publish_state()

    async def summary(self) -> RunSummary:
        return make_summary(
            self.intake.accounting(await self._admitted()),
            self.intake.state,
            self.metrics.reward_means(),
            dlq=await self.bus.stream_depth(S.DLQ),
        )

    def heartbeat(self) -> dict:
        return {
            "version": self.engine.version,
            "step": self.intake.state.step,
            "busy_frac": self.meter.busy_frac(),
            "buffered_groups": len(self.intake.groups),
            "complete_groups": len(self.intake.complete_groups()),
            "held_leases": self.bus.held_leases,
            "overdue_tasks": len(self.intake.overdue(self.overdue_horizon)),
        }

    async def _finish(self, stop: asyncio.Event | None = None) -> RunSummary:
        await self.publish_settled()
        await self._await_final_eval(stop)
        final = self.out_dir / "final"
        await self.storage.write_sync(
            "final_model",
            final,
            self.engine.save_pretrained,
            str(final),
            needs_bytes=self._weights_bytes,
        )
        self.intake.state.done = True
        await self._publish_state()
        summary = await self.summary()
        path = self.out_dir / "summary.json"
        await self.storage.write_sync("summary", path, write_summary, path, summary)
        await self.bus.event("run_finished", **summary.model_dump())
        log.info("run_finished", **summary.model_dump())
        return summary

    async def _await_final_eval(self, stop: asyncio.Event | None) -> None:
        """With eval rounds at every K-th version and K dividing the final version, a rollout
        worker evaluates the final weights once it is idle: wait (up to `final_eval_wait_s`, or
        a stop) for that round to land in eval.jsonl, so the run's last evaluation is of the
        model it leaves in `final/`."""
        k, version = self.opts.eval_every_versions, self.engine.version
        wait_s = self.opts.final_eval_wait_s
        if not k or version % k or wait_s <= 0 or self.evals is None:
            return
        if version not in self.evals.rounds:
            log.info("final_eval_waiting", round=version, timeout_s=wait_s)
        deadline = time.monotonic() + wait_s
        while version not in self.evals.rounds and not (stop is not None and stop.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("final_eval_missing", round=version, waited_s=wait_s)
                return
            self._eval_landed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._eval_landed.wait(), min(left, 1.0))

    async def _on_eval(self, rec: MetricRecord) -> None:
        """A rollout worker's evaluation round: into `eval.jsonl` (once per round)."""
        if self.evals is None or "round" not in rec.values:
            return
        landed = await self.storage.write_sync("eval", self.evals.path, self.evals.add, rec.values)
        self._eval_landed.set()
        if landed:
            if self.tracker is not None:
                self.tracker.log_eval(rec.values)
            log.info(
                "eval_recorded",
                **{k: rec.values.get(k) for k in ("round", "version", "eval_reward")},
            )

    async def run(self, stop: asyncio.Event) -> RunSummary | None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.tracker is not None:
            self.tracker.start()  # (a worker starts it sooner, in prepare: a no-op then)
        await self.restore()
        self.evals = await self.storage.write_sync(
            "eval", self.out_dir / "eval.jsonl", EvalLog, self.out_dir / "eval.jsonl"
        )
        evals = await self.bus.subscribe_metrics("rollout", "eval", self._on_eval, replay=True)
        consumer = asyncio.create_task(
            self.bus.consume(
                S.REWARDS,
                ScoredGroup,
                self.handle,
                max_inflight=1_000_000,
                stop=stop,
                inline=True,
                refuse=lambda group, lease, reason: self._refuse(group.first, lease, reason),
            )
        )
        # a consumer that died (its error is raised below) ends the wait for data at once: the
        # worker exits with it, and the launcher's restart gets the held messages back
        consumer.add_done_callback(lambda _: stop.set())
        hb = asyncio.create_task(heartbeat_loop(self.bus, self.heartbeat, stop))
        log.info("trainer_started", policy_version=self.engine.version, step=self.intake.state.step)
        try:
            while self.intake.state.step < self.opts.total_steps and not stop.is_set():
                t_wait = time.perf_counter()
                batch = await self._next_batch(stop)
                if batch is None:
                    break
                await self.step(batch, time.perf_counter() - t_wait)
            if self.intake.state.step >= self.opts.total_steps:
                return await self._finish(stop)
            # a stop mid-run (Ctrl-C, SIGTERM) keeps what was trained since the last periodic
            # checkpoint (`checkpoint_every`): a resume goes on from here, redoing nothing
            await self.checkpoints.flush()
            if self.intake.unwritten:
                await self.checkpoints.save(self.intake, background=False)
            return None
        finally:
            stop.set()
            hb.cancel()
            await evals.unsubscribe()
            await self.checkpoints.flush()  # a stop mid-run still lands what was trained
            try:  # and announces the weights it trained last
                await self.publish_settled()
            except Exception as e:  # a resume publishes them; the run's own error stays
                log.error("weights_publish_failed", version=self.engine.version, error=str(e))
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
            await self.storage.drain(timeout_s=5.0)  # a storage_recovered just before the end
            if self.tracker is not None:  # bounded: tracking.close_timeout_s
                await asyncio.to_thread(self.tracker.close)
