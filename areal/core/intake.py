"""Trainer intake: file scored groups, judge them, pick batches, keep accounts.

A pure state machine, generic over the handle `H` the service uses to settle a message (a bus
lease in production, a token in the simulator). The trainer service decodes a message, calls
`file`, and acts on the outcome; between steps it calls `take_batch`, trains, `commit_step`,
and `checkpoint` / `checkpoint_written` around its durable write.

Invariants:
- never picks a group whose oldest token was generated at a version `< version - η`: such a
  group is retired as `dropped_stale` (counted, its slot returned), never silently; a token
  here is a model token (`model_versions`): the environment tokens of an episode (tool
  output, user turns; version -1) were made by no policy, so they age nothing;
- batches are the B oldest (by admission seq) complete fresh groups, and a batch skips an
  older open task (one still generating) only after `straggler_wait_s` (the caller's clock,
  `now`): a skipped task is the one most likely to go stale, so skipping it wastes its
  generation and biases training against long answers, which is what stragglers are; the wait
  is bounded so a lost or stuck task cannot stall training (it is passed once, then `overdue`);
- a handle (one per group message: all G samples of a task, or a part of them when a group was
  too big for one message) is settled only once a checkpoint covers its group's effect: handles of trained or
  retired groups, and of duplicates of them, are released by `checkpoint()` and must be acked
  only after that checkpoint is written; a duplicate of a task already covered by a written
  checkpoint is acked at once;
- a duplicate delivery of samples in hand is held with them (acking it early would lose the
  message if the trainer then died before its checkpoint);
- every task filed ends exactly once: trained, dropped_stale, filtered or rejected (a message of
  it failed validation: `reject`); a task's samples must agree on the prompt, or it is rejected;
- a group picked for a batch is in hand until `commit_step`: the trainer trains it while
  messages keep arriving, so a bad message naming it then cannot retire it (it is trained, the
  message is held with it and dead-lettered by the service);
- a task that never ends is noticed: `overdue(horizon)` lists the admission seqs that have not
  ended although tasks admitted `horizon` or more later have (batches take the oldest groups
  first, so a gap that old means a task was lost or stuck upstream, not merely slow);
- the run state for admission (`kv_state`) returns only slots whose retirement a written
  checkpoint covers: a trainer restored from that checkpoint can never report fewer returned
  slots than admission already used, so a crash cannot make admission over-admit. A retirement
  therefore needs a checkpoint soon (`retired_unwritten`), or admission could wait forever.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, Literal, TypeVar

import numpy as np

from areal.algo.staleness import is_fresh, sample_staleness, staleness_histogram
from schemas import Sample, ScoredSample
from schemas.state import Accounting, BatchInfo, CheckpointState, StepRecord, TrainerState

__all__ = [
    "Filed",
    "Group",
    "Intake",
    "IntakePolicy",
    "Pick",
    "Retired",
    "loss_mask",
    "model_versions",
    "token_versions",
]

H = TypeVar("H")
RetireReason = Literal["dropped_stale", "filtered", "rejected"]


def token_versions(scored: ScoredSample) -> np.ndarray:
    """Per-token policy versions of a sample, `[T]` int64 (environment tokens: -1)."""
    v = scored.sample.versions
    return np.frombuffer(v.data, dtype="<i4" if v.dtype == "int32" else "<i8").astype(np.int64)


def loss_mask(scored: ScoredSample) -> np.ndarray | None:
    """`[T]` bool: which output tokens the model generated (True) and which the environment
    added (False); None: every one is the model's (`Sample.loss_mask`)."""
    m = scored.sample.loss_mask
    return None if m is None else np.frombuffer(m.data, dtype=np.uint8).astype(bool)


def model_versions(scored: ScoredSample) -> np.ndarray:
    """Policy versions of a sample's model tokens, `[T_model]` int64: what its staleness is
    measured from (environment tokens are left out)."""
    v, m = token_versions(scored), loss_mask(scored)
    return v if m is None else v[m]


@dataclass(frozen=True)
class IntakePolicy:
    batch_size: int  # B
    group_size: int  # G
    max_staleness: int  # η
    filter_zero_adv_groups: bool = False
    straggler_wait_s: float = 0.0  # how long a batch waits for an older open task (0: never)


class Filed(Enum):
    """What `Intake.file` did with a group message, and so what the service does with its
    handle."""

    HELD = "held"  # filed, its group not yet complete; settle after the checkpoint covering it
    COMPLETED = "completed"  # filed, and its group is now complete
    DUPLICATE = "duplicate"  # a copy of samples in hand or awaiting their checkpoint: held too
    ACK_NOW = "ack_now"  # its task is covered by a written checkpoint: settle now
    INVALID = "invalid"  # does not fit this run (`Intake.last_error`): dead-letter it
    REJECTED = "rejected"  # its task was retired as rejected: settle after the checkpoint


@dataclass
class Group(Generic[H]):
    task_id: str
    task_seq: int
    samples: dict[int, ScoredSample] = field(default_factory=dict)  # sample_idx -> sample
    handles: list[H] = field(default_factory=list)

    def ordered(self) -> list[ScoredSample]:
        return [self.samples[i] for i in sorted(self.samples)]

    def min_version(self) -> int | None:
        """Version of the group's oldest model token (None when no sample has one)."""
        mins = [int(v.min()) for v in map(model_versions, self.samples.values()) if len(v)]
        return min(mins) if mins else None


@dataclass(frozen=True)
class Retired:
    task_id: str
    reason: RetireReason
    min_version: int | None


@dataclass
class Pick(Generic[H]):
    retired: list[Retired]  # groups retired while picking (their slots go back to admission)
    batch: list[Group[H]] | None  # B groups, oldest first; None while fewer are ready
    # None, or: B groups are ready but an older task is still open; ask again within this (s)
    retry_in: float | None = None


class Intake(Generic[H]):
    def __init__(self, policy: IntakePolicy, state: TrainerState | None = None) -> None:
        self.policy = policy
        self.state = state or TrainerState()
        self.groups: dict[str, Group[H]] = {}
        self._in_hand: set[str] = set()  # task ids of the batch picked and not yet committed
        self.done_written: set[str] = set()  # tasks covered by a written checkpoint
        self.done_pending: set[str] = set()  # tasks ended since; their checkpoint is pending
        self._unacked: list[H] = []
        self._written = TrainerState()  # the state of the last written (or restored) checkpoint
        self.retired_unwritten = False  # groups retired since the last `checkpoint()`
        self.last_error = ""
        self._ended_seqs: set[int] = set()  # ended seqs at or above `_low_open`
        self._low_open = 0  # lowest admission seq that has not ended
        self._max_ended = -1
        self._straggling_since: float | None = None  # B ready, an older task open, since then
        self._passed: set[int] = set()  # open seqs a batch skipped after the wait (not again)
        self.passed_stragglers = 0  # seqs skipped after waiting for them (this incarnation)

    # ------------------------------------------------------------------ messages
    def file(self, part: Sequence[ScoredSample], handle: H) -> Filed:
        """File one group message: scored samples of one task (all G of them, unless the rollout
        had to split a group too big for one message), settled as one `handle`. Its shape was
        checked by `areal.core.validate.check_scored_group`."""
        s = part[0].sample
        if s.group_size != self.policy.group_size:
            self.last_error = (
                f"group {s.task_id[:80]}: group_size {s.group_size} != run's G "
                f"{self.policy.group_size}"
            )
            return Filed.INVALID
        if s.task_id in self.done_written:
            return Filed.ACK_NOW
        if s.task_id in self.done_pending:
            self._unacked.append(handle)
            return Filed.DUPLICATE
        group = self.groups.get(s.task_id)
        if group is not None and group.samples:
            first = next(iter(group.samples.values())).sample
            if first.prompt_ids != s.prompt_ids or first.task_seq != s.task_seq:
                self.last_error = f"group {s.task_id[:80]}: its prompt differs from its group's"
                return Filed.INVALID
        group = self.groups.setdefault(s.task_id, Group(s.task_id, s.task_seq))
        group.handles.append(handle)
        new = [sc for sc in part if sc.sample.sample_idx not in group.samples]
        if not new:  # a copy of samples in hand: held with them
            return Filed.DUPLICATE
        for sc in new:
            group.samples[sc.sample.sample_idx] = sc
        return Filed.COMPLETED if len(group.samples) == self.policy.group_size else Filed.HELD

    def reject(self, task_id: str, task_seq: int, handle: H) -> tuple[Filed, Retired | None]:
        """Retire the (admitted) task `task_id` as rejected: a message of it failed validation,
        so its group can never be trusted to complete. `handle` (and the group's) are settled
        with the checkpoint that covers the retirement; the task's later messages are
        duplicates. A task that already ended is not retired again (`ACK_NOW` / `DUPLICATE`)."""
        if task_id in self.done_written:
            return Filed.ACK_NOW, None
        if task_id in self.done_pending:
            self._unacked.append(handle)
            return Filed.DUPLICATE, None
        if task_id in self._in_hand:  # being trained: it ends with the step, settled with it
            self.groups[task_id].handles.append(handle)
            return Filed.DUPLICATE, None
        group = self.groups.setdefault(task_id, Group(task_id, task_seq))
        group.handles.append(handle)
        return Filed.REJECTED, self._retire(group, "rejected", group.min_version())

    # ------------------------------------------------------------------ batches
    def complete_groups(self) -> list[Group[H]]:
        """Complete groups, oldest (lowest admission seq) first."""
        g = self.policy.group_size
        return sorted(
            (grp for grp in self.groups.values() if len(grp.samples) == g),
            key=lambda grp: grp.task_seq,
        )

    def _zero_adv(self, group: Group[H]) -> bool:
        rewards = {sc.reward for sc in group.samples.values()}
        return len(rewards) <= 1

    def take_batch(self, now: float = 0.0) -> Pick[H]:
        """Retire stale (and, if configured, zero-advantage) complete groups and pick the B
        oldest fresh ones at the current version. Picked groups stay in hand until
        `commit_step`; with fewer than B ready, nothing is picked. With B ready but an older
        task still open (not ended, not complete), nothing is picked either until it completes
        or `straggler_wait_s` has passed since B were first ready (`now`: monotonic seconds)."""
        p, version = self.policy, self.state.version
        retired: list[Retired] = []
        chosen: list[Group[H]] = []
        for group in self.complete_groups():
            vmin = group.min_version()
            if vmin is not None and not is_fresh(version, vmin, p.max_staleness):
                retired.append(self._retire(group, "dropped_stale", vmin))
            elif p.filter_zero_adv_groups and self._zero_adv(group):
                retired.append(self._retire(group, "filtered", vmin))
            elif len(chosen) < p.batch_size:
                chosen.append(group)
        if len(chosen) < p.batch_size:
            self._straggling_since = None
            return Pick(retired, None)
        skipped = self._skipped(chosen)
        if skipped:
            if self._straggling_since is None:
                self._straggling_since = now
            left = self._straggling_since + p.straggler_wait_s - now
            if left > 0:
                return Pick(retired, None, retry_in=left)
            self._passed.update(skipped)
            self.passed_stragglers += len(skipped)
        self._straggling_since = None
        self._in_hand = {g.task_id for g in chosen}
        return Pick(retired, chosen)

    def _skipped(self, chosen: list[Group[H]]) -> list[int]:
        """Open seqs older than the newest of `chosen` that it leaves out (not yet passed)."""
        if self.policy.straggler_wait_s <= 0:
            return []
        taken = {g.task_seq for g in chosen}
        return [
            seq
            for seq in range(self._low_open, chosen[-1].task_seq)
            if seq not in taken and seq not in self._ended_seqs and seq not in self._passed
        ]

    def _retire(self, group: Group[H], reason: RetireReason, vmin: int | None) -> Retired:
        self._end(group)
        self.retired_unwritten = True
        if reason == "dropped_stale":
            self.state.dropped_stale += 1
        elif reason == "filtered":
            self.state.filtered += 1
        else:
            self.state.rejected += 1
        return Retired(group.task_id, reason, vmin)

    def _end(self, group: Group[H]) -> None:
        self._mark_ended(group.task_seq)
        del self.groups[group.task_id]
        self.done_pending.add(group.task_id)
        self._unacked.extend(group.handles)

    def commit_step(
        self, batch: list[Group[H]], *, version: int, wall_s: float, skipped: bool = False
    ) -> None:
        """`batch` was trained on; the policy is now `version` (published next). `skipped`: the
        engine refused the update (a non-finite loss or gradient): the groups are used up all
        the same (counted as trained: retrying them would fail the same way)."""
        self.state.skipped_steps += int(skipped)
        self._in_hand = set()
        for group in batch:
            self._end(group)
        st = self.state
        st.step += 1
        st.version = version
        st.trained += len(batch)
        st.samples += sum(len(g.samples) for g in batch)
        st.tokens += sum(len(sc.sample.output_ids) for g in batch for sc in g.samples.values())
        st.wall_s = wall_s

    def _mark_ended(self, seq: int) -> None:
        self._max_ended = max(self._max_ended, seq)
        self._passed.discard(seq)
        if seq >= self._low_open:
            self._ended_seqs.add(seq)
        while self._low_open in self._ended_seqs:
            self._ended_seqs.discard(self._low_open)
            self._low_open += 1

    def overdue(self, horizon: int, limit: int = 100) -> list[int]:
        """Seqs (at most `limit`, oldest first) that have not ended although a task admitted
        `horizon` or more seqs later has."""
        out: list[int] = []
        for seq in range(self._low_open, self._max_ended - horizon + 1):
            if seq not in self._ended_seqs:
                out.append(seq)
                if len(out) >= limit:
                    break
        return out

    # ------------------------------------------------------------------ durability
    def checkpoint(self) -> tuple[CheckpointState, list[H]]:
        """The state to write now, and the handles to settle once it is written."""
        ckpt = CheckpointState(
            trainer=self.state.model_copy(),
            done_tasks=sorted(self.done_written | self.done_pending),
        )
        handles, self._unacked = self._unacked, []
        self.retired_unwritten = False
        return ckpt, handles

    def checkpoint_written(self, ckpt: CheckpointState) -> None:
        """`ckpt` is durable: its tasks' later duplicates may be acked at once, and its
        retirements' slots may go back to admission (`kv_state`)."""
        written = set(ckpt.done_tasks)
        self.done_written |= written
        self.done_pending -= written
        self._written = ckpt.trainer.model_copy()

    @property
    def unwritten(self) -> bool:
        """Steps trained or groups retired that no written checkpoint covers (ask once the
        checkpoint in flight has landed): a stop now would lose them (the steps would be redone,
        the slots would wait) unless a checkpoint is written first."""
        return self.state.step != self._written.step or self.retired_unwritten

    def kv_state(self) -> TrainerState:
        """The run state to publish for admission: the current version and counters, except that
        returned slots (dropped + filtered + rejected) are those of the last written checkpoint."""
        kv = self.state.model_copy()
        w = self._written
        kv.dropped_stale, kv.filtered, kv.rejected = w.dropped_stale, w.filtered, w.rejected
        return kv

    def restore(self, ckpt: CheckpointState) -> None:
        """Resume from a written checkpoint (everything in hand before it is redelivered)."""
        self.state = ckpt.trainer.model_copy()
        self._written = ckpt.trainer.model_copy()
        self.retired_unwritten = False
        self.groups.clear()
        self.done_written = set(ckpt.done_tasks)
        self.done_pending.clear()
        self._unacked.clear()
        self._ended_seqs, self._low_open, self._max_ended = set(), 0, -1
        self._straggling_since, self._passed = None, set()
        for task_id in ckpt.done_tasks:
            seq = task_id.rsplit("-t", 1)[-1]
            if seq.isdigit():
                self._mark_ended(int(seq))

    # ------------------------------------------------------------------ reporting
    def accounting(self, admitted: int) -> Accounting:
        st = self.state
        return Accounting(
            admitted=admitted,
            trained=st.trained,
            dropped_stale=st.dropped_stale,
            filtered=st.filtered,
            rejected=st.rejected,
        )

    def batch_info(self, batch: list[Group[H]], now: float | None = None) -> BatchInfo:
        """Reward, length and staleness statistics of a picked batch at the current version,
        and its pipeline timings (`batch_timings`; `now`: when it was picked, wall clock)."""
        v = self.state.version
        scored = [sc for g in batch for sc in g.ordered()]
        rewards = np.array([sc.reward for sc in scored], dtype=np.float64)
        lens = [len(sc.sample.output_ids) for sc in scored]
        versions = [model_versions(sc) for sc in scored]  # staleness: of model tokens only
        sample_mins = [int(x.min()) for x in versions if len(x)]
        all_tokens = np.concatenate(versions) if versions else np.zeros(0, np.int64)
        n = len(scored)
        n_env = sum(lens) - len(all_tokens)
        return BatchInfo(
            reward_mean=float(rewards.mean()) if n else 0.0,
            reward_std=float(rewards.std()) if n else 0.0,
            samples=n,
            tokens=int(sum(lens)),
            gen_len_mean=float(np.mean(lens)) if n else 0.0,
            staleness_max=max((sample_staleness(v, m) for m in sample_mins), default=0),
            staleness_hist=_str_keys(staleness_histogram(v, sample_mins)),
            staleness_hist_tokens=_str_keys(staleness_histogram(v, all_tokens.tolist())),
            token_version_min=int(all_tokens.min()) if len(all_tokens) else v,
            token_version_max=int(all_tokens.max()) if len(all_tokens) else v,
            interrupted_frac=sum(sc.sample.n_interrupts > 0 for sc in scored) / max(1, n),
            reprefill_tokens=sum(sc.sample.n_reprefill_tokens for sc in scored),
            truncated_frac=sum(sc.sample.finish_reason == "length" for sc in scored) / max(1, n),
            masked_token_frac=n_env / sum(lens) if sum(lens) else 0.0,
            **episode_stats([sc.sample for sc in scored]),
            task_seqs=[g.task_seq for g in batch],
            **batch_timings(batch, now),
        )

    def step_record(
        self,
        info: BatchInfo,
        *,
        trained_on_version: int,
        admitted: int,
        timings: dict[str, float],
        stats: dict[str, float],
    ) -> StepRecord:
        """The record of the step just committed (`commit_step` first)."""
        st = self.state
        engine = {("train_tokens" if k == "tokens" else k): v for k, v in stats.items()}
        return StepRecord(
            **info.model_dump(),
            step=st.step,
            version=st.version,
            trained_on_version=trained_on_version,
            versions_skipped=st.versions_skipped,
            wall_s=round(st.wall_s, 3),
            dropped_stale=st.dropped_stale,
            filtered=st.filtered,
            rejected=st.rejected,
            admitted=admitted,
            outstanding=admitted - st.returned,
            **{k: round(t, 4) for k, t in timings.items()},
            **{k: round(x, 6) if isinstance(x, float) else x for k, x in engine.items()},
        )

    def rewards(self, batch: Iterable[Group[H]]) -> list[list[float]]:
        """`[B][G]` rewards in sample order (for the advantages)."""
        return [[sc.reward for sc in g.ordered()] for g in batch]


def batch_timings(batch: Sequence[Group[H]], now: float | None) -> dict[str, float]:
    """`queue_s`, `gen_span_s`, `tail_s` and (given `now`) `ready_age_s` of a batch (see
    `BatchInfo`), from its samples' `timings`; the tasks none of whose samples carry them are
    left out, and with none left, so are the fields."""
    queued, received, finished = [], [], []
    for group in batch:
        ts = [sc.sample.timings for sc in group.ordered()]
        rcv = [t["received_at"] for t in ts if "received_at" in t]
        fin = [t["finished_at"] for t in ts if "finished_at" in t]
        adm = [t["admitted_at"] for t in ts if "admitted_at" in t]
        if not rcv or not fin:
            continue
        received.append(min(rcv))
        finished.append(max(fin))
        if adm:
            queued.append(min(rcv) - min(adm))
    if not finished:
        return {}
    last = max(finished)
    out = {
        "gen_span_s": round(last - min(received), 4),
        "tail_s": round(last - float(np.median(finished)), 4),
    }
    if queued:
        out["queue_s"] = round(float(np.median(queued)), 4)
    if now is not None:
        out["ready_age_s"] = round(now - last, 4)
    return out


def episode_stats(samples: Sequence[Sample]) -> dict[str, float]:
    """Turns, tool calls, tool failures and tool latency of a batch's episodes (see
    `BatchInfo`): means over samples, and `tool_error_frac` over the tool calls."""
    n = max(1, len(samples))
    calls = sum(s.n_tool_calls for s in samples)
    return {
        "turns_mean": sum(s.n_turns for s in samples) / n if samples else 1.0,
        "tool_calls_mean": calls / n,
        "tool_call_frac": sum(s.n_tool_calls > 0 for s in samples) / n,
        "tool_ok_frac": sum(s.n_tool_calls > 0 and s.n_tool_errors == 0 for s in samples) / n,
        "tool_error_frac": sum(s.n_tool_errors for s in samples) / calls if calls else 0.0,
        "tool_s_mean": sum(s.tool_s for s in samples) / n,
    }


def _str_keys(hist: dict[int, int]) -> dict[str, int]:
    return {str(k): c for k, c in hist.items()}
