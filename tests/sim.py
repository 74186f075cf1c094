"""A pure, deterministic event-driven simulator of the whole pipeline, driving the production cores.

The controller IS `Admission`, each rollout worker IS a `Scheduler`, the trainer IS an `Intake`;
this module only models what surrounds them, the way the services use them: the streams (work
queues with msg-id de-duplication, leases settled by ack / nak, redelivery after ack-wait), the
KV, weight announcements, checkpoints on disk, and crashes. Given a `SimConfig` (seed included)
the event sequence is fully determined. The reward stage is skipped: a rollout worker publishes a
group of `ScoredSample`s whose rewards are a deterministic function of their ids (`sim_reward`).

Events (each chosen at random with weights; faults come from `Faults`): admit (publish a prefix
of the admissible tasks), persist the controller state, a worker takes a delivery, a generation
step at a token boundary (requests join, weights switch, tokens; once all G samples of a task
have finished, its group goes out as one message, or in parts with `split_groups`, and the
task is acked), weights offered to a worker, an engine failure (nak all), the
trainer files a delivery, the trainer picks a batch (retiring stale groups) and later finishes
training it (announce / KV / checkpoint) while deliveries keep being filed in between, as the
service files messages while its engine trains; a poison message naming an admitted task reaches
the trainer (the service dead-letters it and calls `Intake.reject`), a checkpoint write lands
(acks), ack-wait expiry (a held message is delivered again: a duplicate),
a redelivery of a task still being generated to the same worker, any actor dying (and a later
restart), and acks or naks lost on the way (the message comes back after ack-wait).

The trainer gives retired groups' slots back (KV `returned`, `Intake.kv_state`) only once a
checkpoint covering the retirement is written, and checkpoints when it retired groups and has no
batch to train, as the trainer service does. `SimConfig.durable_slots=False` models the earlier
protocol (slots back at once): it over-admits after a trainer restart, because the checkpoint
restores a lower `returned` than the controller already admitted against
(`strict_over_admission`), and a task admitted on the lost slot can still be in flight when the
run ends. The streams are modelled in `tests.sim_streams`.

Ground truth kept here (see `violations()`): task messages ever published, the trainer's lineage
of task ends (in memory since the last written checkpoint, and durable), token versions. Checks:
- `distinct admitted - returned <= (i + η + 1) * B` against the published trainer state, with
  i its `published_steps` (steps, not versions: a restart's version rollforward does not raise
  it), the most any state named (a restart lowers it to the checkpoint's step, and admission
  already used the higher one; the steps since are redone);
- nothing admitted twice or skipped; announced versions strictly increase;
- no token older than its task's admission version (η = 0 is synchronous);
- no trained sample older than η (from its oldest token); no task trained twice or with two ends;
- nothing lost: a task not durably ended has its prompt message, or messages of all its G
  samples (a group, or its parts), unacked;
- the trainer's counters equal the lineage's ends; a checkpoint's done tasks are its lineage's.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from areal.algo.staleness import admission_capacity, sample_staleness
from areal.core.admission import Admission, AdmissionPolicy
from areal.core.intake import Filed, Intake, IntakePolicy, model_versions
from areal.core.scheduling import Scheduler, SchedulerPolicy
from schemas import Sample, ScoredSample
from schemas.arrays import PackedArray
from schemas.state import CheckpointState, ControllerState, TrainerState
from tests.sim_streams import Msg, SimLease, Stream, expire

__all__ = ["Faults", "Sim", "SimConfig", "SimLease", "SimTask", "sim_reward"]

STRAGGLER_SPEEDS = (0.05, 0.2, 1.0, 2.0)  # weight of a worker's generation events
MAX_RUNNING = 4  # requests generating at once on a worker
MAX_TASKS = 3  # deliveries a worker holds at once (max_ack_pending)
Event = tuple[str, float, Callable[[], None]]


@dataclass(frozen=True)
class Faults:
    """Fault weights (relative to about 1-3 for normal events); `lost_ack` is a probability."""

    controller_crash: float = 0.0
    worker_crash: float = 0.0
    trainer_crash: float = 0.0
    engine_failure: float = 0.0
    duplicate: float = 0.0  # early ack-wait expiry, or a redelivery to the same worker
    lost_ack: float = 0.0
    poison: float = 0.0  # a message that fails validation, naming an admitted task


@dataclass(frozen=True)
class SimConfig:
    max_staleness: int
    batch_size: int
    group_size: int = 2
    n_workers: int = 3
    total_steps: int = 5
    seed: int = 0
    interruptible: bool = True
    interrupt_min_interval: float = 0.0  # in events
    needed_first: bool = False  # SchedulerPolicy.needed_first
    checkpoint_every: int = 1
    filter_zero_adv: bool = False
    ack_wait: int = 40  # events after a delivery before the message may come back
    sample_dedup_window: int | None = None  # events; None: longer than the run
    task_dedup: bool = True  # False models a controller publishing without msg-id
    durable_slots: bool = True  # retired groups' slots go back once a checkpoint covers them
    split_groups: float = 0.0  # probability that a finished group is published in parts
    faults: Faults = Faults()


@dataclass(frozen=True)
class SimTask:
    """The task message: what a worker needs from it."""

    task_id: str
    seq: int
    admitted_version: int


def sim_reward(task_id: str, index: int) -> float:
    """A deterministic 0/1 reward (some groups all equal: the zero-advantage filter has work)."""
    return float(zlib.crc32(f"{task_id}/{index}".encode()) % 3 == 0)


@dataclass
class _Gen:
    """A request generating on a worker: its tokens' versions so far."""

    task_id: str
    index: int
    admitted_version: int
    length: int
    versions: list[int] = field(default_factory=list)
    n_interrupts: int = 0


@dataclass
class _Worker:
    name: str
    speed: float
    sched: Scheduler[SimLease, None] | None = None  # None while dead
    incarnation: int = 0
    running: list[_Gen] = field(default_factory=list)
    finished: dict[str, dict[int, ScoredSample]] = field(default_factory=dict)  # until all G

    @property
    def holder(self) -> str:
        return f"{self.name}#{self.incarnation}"


class Sim:
    """The pipeline around the production cores; `make_*` inject variants (mutants in tests)."""

    def __init__(
        self,
        cfg: SimConfig,
        *,
        make_admission: Callable[[AdmissionPolicy, ControllerState | None], Admission] = Admission,
        make_scheduler: Callable[[SchedulerPolicy], Scheduler[SimLease, None]] = Scheduler,
        make_intake: Callable[[IntakePolicy], Intake[SimLease]] = Intake,
    ) -> None:
        if cfg.batch_size < 1 or cfg.n_workers < 1 or cfg.group_size < 1:
            raise ValueError(f"invalid sim config {cfg}")
        self.cfg, self.faults = cfg, cfg.faults
        self.make_admission, self.make_scheduler = make_admission, make_scheduler
        self.make_intake = make_intake
        self.rng = random.Random(cfg.seed)
        self.n_events = 0
        self.prompts = Stream(self, cfg.task_dedup, None)
        self.samples = Stream(self, True, cfg.sample_dedup_window)
        self.poisons = Stream(self, False, None)  # delivered at once, settled like samples
        self.training: list | None = None  # the batch the trainer picked and is training
        self.kv_controller: ControllerState | None = None
        self.kv_trainer = TrainerState()
        self.announced: list[int] = []
        self.ckpt_disk: CheckpointState | None = None
        self.adm_policy = AdmissionPolicy(cfg.batch_size, cfg.max_staleness, cfg.total_steps)
        self.sched_policy = SchedulerPolicy(
            cfg.interruptible,
            cfg.interrupt_min_interval,
            needed_first=cfg.needed_first,
            max_staleness=cfg.max_staleness,
        )
        self.intake_policy = IntakePolicy(
            cfg.batch_size, cfg.group_size, cfg.max_staleness, cfg.filter_zero_adv
        )
        self.adm: Admission | None = self.make_admission(self.adm_policy, None)
        self.ctl_dirty = False  # published since the last persist
        self.workers = [
            _Worker(f"w{i}", self.rng.choice(STRAGGLER_SPEEDS)) for i in range(cfg.n_workers)
        ]
        for w in self.workers:
            w.sched = self.make_scheduler(self.sched_policy)
        self.intake: Intake[SimLease] | None = None
        self.writes: list[tuple[CheckpointState, list[SimLease], dict[str, str]]] = []
        self.finished = False  # the trainer reached total_steps and its last checkpoint landed
        # ground truth
        self.task_msgs: list[int] = []  # seq of every task message published (copies too)
        self.ends: dict[str, str] = {}  # this trainer lineage's task ends
        self.durable_ends: dict[str, str] = {}  # as of the last written checkpoint
        self.found: list[str] = []  # violations seen when they happened
        self.trace: list[str] = []
        self.returned_hwm = 0  # most slots the published trainer state ever gave back
        self.steps_hwm = 0  # most published steps (admission's i) it ever named
        self.strict_over_admission: list[str] = []  # see `_publish_trainer`
        self._trainer_start()

    # ------------------------------------------------------------------ ground truth
    @property
    def admitted(self) -> int:
        return len(set(self.task_msgs))

    def lost(self) -> bool:
        return self.faults.lost_ack > 0 and self.rng.random() < self.faults.lost_ack

    def violations(self) -> list[str]:
        """Every invariant broken now (cheap: meant to be called after every event)."""
        cfg, out = self.cfg, list(self.found)
        cap = admission_capacity(self.steps_hwm, cfg.max_staleness, cfg.batch_size)
        if self.admitted - self.returned_hwm > cap:
            out.append(f"over-admitted: {self.admitted} - {self.returned_hwm} > {cap}")
        if len(self.task_msgs) != self.admitted or set(self.task_msgs) != set(range(self.admitted)):
            out.append("a task was admitted twice or skipped")
        prompt_live = {m.body.task_id for m in self.prompts.msgs.values()}
        sample_live: dict[str, set[int]] = {}  # indices in unacked group messages (or parts)
        for m in self.samples.msgs.values():
            live_idx = sample_live.setdefault(m.body[0].sample.task_id, set())
            live_idx.update(sc.sample.sample_idx for sc in m.body)
        for seq in range(self.admitted):
            tid = task_id(seq)
            live = tid in prompt_live or len(sample_live.get(tid, ())) == cfg.group_size
            if tid not in self.durable_ends and not live:
                out.append(f"task {tid} lost: no unacked prompt and not all G samples")
        if self.intake is not None:
            st, ends = self.intake.state, list(self.ends.values())
            got = (st.trained, st.dropped_stale, st.filtered, st.rejected)
            kinds = ("trained", "dropped_stale", "filtered", "rejected")
            want = tuple(ends.count(k) for k in kinds)
            if got != want:
                out.append(f"trainer counts {got} != its lineage's ends {want}")
        return out

    # ------------------------------------------------------------------ controller
    def _admit(self) -> None:
        assert self.adm is not None
        seqs = self.adm.admissible(self.kv_trainer)
        for seq in seqs[: self.rng.randint(1, len(seqs))]:  # a crash may cut the loop short
            body = SimTask(task_id(seq), seq, self.kv_trainer.version)
            if self.prompts.publish(body.task_id, body):
                self.task_msgs.append(seq)
            self.adm.published(seq)
        self.ctl_dirty = True

    def _persist(self) -> None:
        assert self.adm is not None
        self.kv_controller, self.ctl_dirty = self.adm.state.model_copy(), False

    def _controller_crash(self) -> None:
        self.adm, self.ctl_dirty = None, False

    def _controller_restart(self) -> None:
        self.adm = self.make_admission(self.adm_policy, self.kv_controller)

    # ------------------------------------------------------------------ rollout workers
    def _deliver(self, w: _Worker, msg: Msg) -> None:
        assert w.sched is not None
        body: SimTask = msg.body
        lease = self.prompts.deliver(msg, w.holder)
        w.sched.on_task(body.task_id, self.cfg.group_size, body.admitted_version, lease)

    def _generate(self, w: _Worker) -> None:
        """One token boundary, as the generating thread sees it."""
        s, now = w.sched, float(self.n_events)
        assert s is not None
        room = MAX_RUNNING - len(w.running)
        if self.cfg.interruptible:
            reqs = s.take_requests(now, room)
            if s.switch_at_boundary(now) is not None:
                for g in w.running:
                    g.n_interrupts += 1
        else:
            if not w.running:
                s.switch_between_batches(now)
            reqs = s.take_requests(now, room)
        w.running += [
            _Gen(r.task_id, r.index, r.admitted_version, self.rng.randint(1, 4)) for r in reqs
        ]
        for g in w.running:
            if s.version < g.admitted_version:
                self.found.append(f"{g.task_id}/{g.index}: token at v{s.version} before admission")
            g.versions.append(s.version)
        done = [g for g in w.running if len(g.versions) >= g.length]
        w.running = [g for g in w.running if len(g.versions) < g.length]
        for g in done:
            s.sample_generated(g.task_id, g.index)
            group = w.finished.setdefault(g.task_id, {})
            group[g.index] = self._scored(g, w.name)
            if len(group) < self.cfg.group_size:
                continue
            del w.finished[g.task_id]
            for part in self._parts([group[i] for i in sorted(group)]):
                indices = [sc.sample.sample_idx for sc in part]
                whole = len(part) == self.cfg.group_size
                self.samples.publish(
                    f"{g.task_id}/" + ("group" if whole else "+".join(map(str, indices))), part
                )
            for index in sorted(group):
                for lease in s.sample_published(g.task_id, index):
                    lease.ack()

    def _parts(self, samples: list[ScoredSample]) -> list[list[ScoredSample]]:
        """A group as the rollout sends it: whole, or (as with a group too big for one message)
        in contiguous parts; a second attempt may split it differently."""
        n = len(samples)
        if n == 1 or self.rng.random() >= self.cfg.split_groups:
            return [samples]
        cuts = [0, *sorted(self.rng.sample(range(1, n), self.rng.randint(1, n - 1))), n]
        return [samples[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]

    def _scored(self, g: _Gen, worker: str) -> ScoredSample:
        n = len(g.versions)
        sample = Sample(
            task_id=g.task_id,
            task_seq=task_seq(g.task_id),
            sample_idx=g.index,
            group_size=self.cfg.group_size,
            prompt_ids=PackedArray.from_list([1, 2], "int32"),
            output_ids=PackedArray.from_list(list(range(n)), "int32"),
            behav_logp=PackedArray.from_list([-1.0] * n, "float32"),
            versions=PackedArray.from_list(g.versions, "int32"),
            worker_id=worker,
            n_interrupts=g.n_interrupts,
        )
        return ScoredSample(sample=sample, reward=sim_reward(g.task_id, g.index))

    def _offer(self, w: _Worker) -> None:
        assert w.sched is not None
        w.sched.offer_weights(self.rng.choice(self.announced[-3:]), None)

    def _engine_failure(self, w: _Worker) -> None:
        assert w.sched is not None
        w.running, w.finished = [], {}
        for lease in w.sched.fail_all():
            lease.nak()

    def _worker_crash(self, w: _Worker) -> None:
        w.sched, w.running, w.finished = None, [], {}  # its leases come back after ack-wait

    def _worker_restart(self, w: _Worker) -> None:
        w.sched, w.incarnation = self.make_scheduler(self.sched_policy), w.incarnation + 1

    # ------------------------------------------------------------------ trainer
    def _trainer_start(self) -> None:
        """Restore from the last written checkpoint; roll the version past any announced,
        counting the versions skipped (as `TrainerService.restore`)."""
        intake = self.make_intake(self.intake_policy)
        if self.ckpt_disk is not None:
            intake.restore(self.ckpt_disk)
        version, latest = intake.state.version, (self.announced or [None])[-1]
        if latest is not None and latest > version:
            version = latest + 1
            intake.state.versions_skipped += version - intake.state.version
        if latest != version:
            self._announce(version)
        intake.state.version = version
        self.intake, self.ends = intake, dict(self.durable_ends)
        self.training = None
        self._publish_trainer()

    def _publish_trainer(self) -> None:
        """Write the trainer state to KV. A restart restores `returned` from the checkpoint, so
        it can fall below what the controller already admitted against: until the retired
        groups are redelivered and retired again, `admitted - returned` may exceed the bound.
        The bound is checked against the high-water mark; each strict excess is recorded. A
        restart also lowers i to the checkpoint's step: no excess, since the steps since are
        redone with tasks already admitted, so i counts at its high-water mark."""
        assert self.intake is not None
        # durable_slots: returned as of the last written checkpoint (the production protocol)
        kv = self.intake.kv_state() if self.cfg.durable_slots else self.intake.state.model_copy()
        self.kv_trainer = kv
        self.returned_hwm = max(self.returned_hwm, kv.returned)
        self.steps_hwm = max(self.steps_hwm, kv.published_steps)
        cfg = self.cfg
        cap = admission_capacity(self.steps_hwm, cfg.max_staleness, cfg.batch_size)
        if self.admitted - kv.returned > cap:
            self.strict_over_admission.append(
                f"event {self.n_events}: {self.admitted} - {kv.returned} > {cap}"
            )

    def _announce(self, version: int) -> None:
        if self.announced and version <= self.announced[-1]:
            self.found.append(f"announced v{version} after v{self.announced[-1]}")
        self.announced.append(version)

    def _file(self, msg: Msg) -> None:
        assert self.intake is not None
        lease = self.samples.deliver(msg, "trainer")
        filed = self.intake.file(msg.body, lease)
        if filed is Filed.ACK_NOW:
            lease.ack()
        elif filed is Filed.INVALID:
            self.found.append(f"invalid sample: {self.intake.last_error}")

    def _poison(self, seq: int) -> None:
        """A message naming admitted task `seq` fails validation at the trainer: dead-lettered,
        and its task retired as rejected unless it already ended or is being trained."""
        assert self.intake is not None
        self.poisons.publish(f"poison-{self.n_events}", None)
        lease = self.poisons.deliver(self.poisons.msgs[self.poisons.n_published - 1], "trainer")
        filed, retired = self.intake.reject(task_id(seq), seq, lease)
        if filed is Filed.ACK_NOW:
            lease.ack()
        if retired is not None:
            self._end(retired.task_id, retired.reason)

    def _end(self, tid: str, how: str) -> None:
        if tid in self.ends:
            self.found.append(f"task {tid} ended twice: {self.ends[tid]}, then {how}")
        self.ends[tid] = how

    def _step(self) -> None:
        """Pick a batch (retiring stale groups); training it ends in a later `_trained`."""
        intake = self.intake
        assert intake is not None
        pick = intake.take_batch()
        for r in pick.retired:
            self._end(r.task_id, r.reason)
        if pick.retired and not self.cfg.durable_slots:
            self._publish_trainer()  # their slots go back now
        if pick.batch is None:
            if intake.retired_unwritten and self.cfg.durable_slots:
                self._checkpoint()  # their slots go back once it is written
            return
        self.training = pick.batch

    def _trained(self) -> None:
        intake, eta, batch = self.intake, self.cfg.max_staleness, self.training
        assert intake is not None and batch is not None
        self.training = None
        v = intake.state.version
        for group in batch:
            self._end(group.task_id, "trained")
            for sc in group.samples.values():
                lag = sample_staleness(v, int(model_versions(sc).min()))
                if lag > eta:
                    self.found.append(f"trained {sc.sample.sample_id} of staleness {lag} > {eta}")
        intake.commit_step(batch, version=v + 1, wall_s=float(self.n_events))
        self._announce(v + 1)
        self._publish_trainer()
        every = intake.state.step % self.cfg.checkpoint_every == 0
        if (
            every
            or intake.state.step >= self.cfg.total_steps
            or self.cfg.durable_slots
            and intake.retired_unwritten
        ):
            self._checkpoint()

    def _checkpoint(self) -> None:
        assert self.intake is not None
        ckpt, leases = self.intake.checkpoint()
        if set(ckpt.done_tasks) != set(self.ends):
            self.found.append("checkpoint's done tasks differ from the lineage's ends")
        self.writes.append((ckpt, leases, dict(self.ends)))

    def _write(self) -> None:
        """The oldest pending checkpoint lands (writes are chained), then its leases are acked."""
        assert self.intake is not None
        ckpt, leases, ends = self.writes.pop(0)
        self.ckpt_disk, self.durable_ends = ckpt, ends
        for lease in leases:
            lease.ack()
        self.intake.checkpoint_written(ckpt)
        if self.cfg.durable_slots:
            self._publish_trainer()
        if ckpt.trainer.step >= self.cfg.total_steps:
            self.finished = True  # the trainer exits

    def _trainer_crash(self) -> None:
        self.intake, self.writes, self.training = None, [], None  # leases come back after ack-wait

    # ------------------------------------------------------------------ scheduling
    def enabled_events(self) -> list[Event]:
        """(name, weight, action) of every event that may happen now, in a fixed order."""
        f, ev = self.faults, []
        if self.adm is None:
            ev.append(("controller_restart", 1.0, self._controller_restart))
        else:
            if self.ctl_dirty:
                ev.append(("persist", 3.0, self._persist))
            elif self.adm.admissible(self.kv_trainer):
                ev.append(("admit", 3.0, self._admit))
            ev.append(("controller_crash", f.controller_crash, self._controller_crash))
        avail = self.prompts.available()
        for w in self.workers:
            s = w.sched
            if s is None:
                ev.append((f"restart_{w.name}", 1.0, lambda w=w: self._worker_restart(w)))
                continue
            if avail and len(s.tasks) < MAX_TASKS:
                m = self.rng.choice(avail) if len(avail) > 1 else avail[0]
                ev.append((f"deliver_{w.name}", 2.0, lambda w=w, m=m: self._deliver(w, m)))
            if w.running or s.queue:
                ev.append((f"generate_{w.name}", w.speed, lambda w=w: self._generate(w)))
            if self.announced[-1] > s.known_version:
                ev.append((f"offer_{w.name}", 1.0, lambda w=w: self._offer(w)))
            ev.append((f"crash_{w.name}", f.worker_crash, lambda w=w: self._worker_crash(w)))
            if s.tasks:
                ev.append(
                    (
                        f"engine_failure_{w.name}",
                        f.engine_failure,
                        lambda w=w: self._engine_failure(w),
                    )
                )
            held = [m for m in self.prompts.msgs.values() if m.out and m.holder == w.holder]
            if held:
                m = self.rng.choice(held)
                ev.append(
                    (f"redeliver_{w.name}", f.duplicate, lambda w=w, m=m: self._deliver(w, m))
                )
        if self.finished:
            pass
        elif self.intake is None:
            ev.append(("trainer_restart", 1.0, self._trainer_start))
        else:
            if self.samples.available():
                m = self.rng.choice(self.samples.available())
                ev.append(("file", 3.0, lambda m=m: self._file(m)))
            if self.training is not None:
                ev.append(("trained", 2.0, self._trained))
            elif self.intake.complete_groups() or (
                self.cfg.durable_slots and self.intake.retired_unwritten  # a rejection's slot
            ):
                ev.append(("step", 2.0, self._step))
            if f.poison and self.admitted:
                seq = self.rng.randrange(self.admitted)
                ev.append(("poison", f.poison, lambda seq=seq: self._poison(seq)))
            if self.writes:
                ev.append(("checkpoint_written", 2.0, self._write))
            ev.append(("trainer_crash", f.trainer_crash, self._trainer_crash))
        out = [m for s in (self.prompts, self.samples) for m in s.msgs.values() if m.out]
        expired = [m for m in out if self.n_events - m.delivered_at >= self.cfg.ack_wait]
        if expired:
            m = self.rng.choice(expired)
            ev.append(("ack_wait_expiry", 1.0, lambda m=m: expire(m)))
        if out:
            m = self.rng.choice(out)
            ev.append(("early_expiry", f.duplicate, lambda m=m: expire(m)))
        return [e for e in ev if e[1] > 0]

    def step(self) -> str:
        """Run one randomly chosen enabled event and return its name."""
        events = self.enabled_events()
        if not events:  # only time can pass: jump to the next ack-wait expiry
            out = [m for s in (self.prompts, self.samples) for m in s.msgs.values() if m.out]
            if not out:
                raise RuntimeError(f"no event enabled after {self.n_events} events (deadlock)")
            self.n_events = min(m.delivered_at for m in out) + self.cfg.ack_wait
            events = self.enabled_events()
        name, _, action = self.rng.choices(events, weights=[e[1] for e in events])[0]
        action()
        self.n_events += 1
        self.trace.append(name)
        return name

    def stop_faults(self) -> None:
        """From now on only normal events: dead actors restart, nothing fails any more."""
        self.faults = Faults()

    def run_to_completion(self, max_events: int, check: Callable[[], None] | None = None) -> bool:
        """Step until the trainer finished; False if `max_events` ran out first."""
        for _ in range(max_events):
            if self.finished:
                return True
            self.step()
            if check is not None:
                check()
        return self.finished


def task_id(seq: int) -> str:
    return f"t{seq}"


def task_seq(tid: str) -> int:
    return int(tid[1:])
