"""Controller: publishes tasks onto `prompts` while admission allows (AReaL eq. 3).

The decision is `areal.core.admission.Admission`; this shell reads the trainer's state from KV,
publishes what admission allows, persists its own state, and reports.

Invariants (see the core for the rule itself):
- tasks are published with `Nats-Msg-Id` = task id *before* the controller state is persisted,
  so a restart re-publishes at most the last batch and the server de-duplicates it; the intent
  (`admitting`: the seqs about to be published) is persisted *before* them, so the trainer can
  tell a task the controller meant to admit from one it never did, without a race;
- the trainer's KV record (version, returned slots) is the ground truth for admission: the
  controller never sees a version whose weights are not announced;
- a trainer record is believed only if it could have come from the trainer (`_implausible`):
  it decodes, its version never goes back and was announced, its returned slots never go back
  and never exceed the tasks admitted (or, after a restart, about to be: `admitting`), and
  `done` comes with `total_steps` reached. Anything else is
  refused (logged once per reason; the last good record stays), so a write to the run-state
  bucket by someone else can neither stop, crash nor over-admit the run.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import structlog

from areal.bus.client import Bus
from areal.bus.codec import pack
from areal.bus.errors import StateDecodeError
from areal.core.admission import Admission, AdmissionPolicy
from areal.services.common import heartbeat_loop
from schemas import Task
from schemas import subjects as S
from schemas.state import CONTROLLER_KEY, TRAINER_KEY, ControllerState, TrainerState

log = structlog.get_logger()


class TaskItem(Protocol):
    index: int
    prompt: str
    answer: str
    metadata: dict


class TaskSource(Protocol):
    def get(self, i: int) -> TaskItem: ...


class Prompts(Protocol):
    """Renders a task to prompt ids (`areal.data.prompts.PromptBuilder`)."""

    def ids(self, item: TaskItem) -> list[int]: ...


class Controller:
    def __init__(
        self,
        bus: Bus,
        source: TaskSource,
        prompts: Prompts,
        *,
        policy: AdmissionPolicy,
        group_size: int,
    ) -> None:
        self.bus, self.source, self.prompts = bus, source, prompts
        self.group_size = group_size
        self.admission = Admission(policy)
        self.trainer = TrainerState()
        self._refusals: set[str] = set()  # reasons already logged

    def make_task(self, seq: int, version: int) -> Task:
        item = self.source.get(seq)  # task k is item k of the seeded order
        ids = self.prompts.ids(item)
        return Task(
            task_id=f"{self.bus.names.run_id}-t{seq}",
            seq=seq,
            dataset_index=item.index,
            prompt=item.prompt,
            prompt_ids=pack(ids, "int32"),
            answer=item.answer,
            metadata=item.metadata,
            group_size=self.group_size,
            admitted_version=version,
        )

    async def admit_once(self) -> int:
        """Publish what admission allows now; returns how many tasks were admitted."""
        seqs = self.admission.admissible(self.trainer)
        if seqs and self.admission.state.admitting < seqs.stop:  # the intent, before the tasks
            self.admission.state = self.admission.state.model_copy(update={"admitting": seqs.stop})
            await self.bus.kv_put(CONTROLLER_KEY, self.admission.state)
        for seq in seqs:
            await self.bus.publish(S.PROMPTS, self.make_task(seq, self.trainer.version))
            self.admission.published(seq)
        if seqs:
            await self.bus.kv_put(CONTROLLER_KEY, self.admission.state)
            await self.bus.metric("admission", vars(self.admission.view(self.trainer)))
        return len(seqs)

    def heartbeat(self) -> dict:
        return {**vars(self.admission.view(self.trainer)), "busy_frac": 0.0}

    async def _read_trainer(self) -> None:
        try:
            new = await self.bus.kv_get(TRAINER_KEY, TrainerState)
        except StateDecodeError as e:
            self._refuse(f"undecodable: {e}")
            return
        if new is None:
            return
        reason = await self._implausible(new)
        if reason is not None:
            self._refuse(reason)
            return
        self.trainer = new

    async def _implausible(self, new: TrainerState) -> str | None:
        """Why `new` cannot be the trainer's record, or None."""
        old, p = self.trainer, self.admission.policy
        if new.version < old.version:
            return f"version went back from {old.version} to {new.version}"
        if new.returned < old.returned:
            return f"returned slots went back from {old.returned} to {new.returned}"
        # tasks the trainer can have seen: those admitted, and after a restart also those the
        # last incarnation began to publish (`admitting`) but had not counted when it died
        seen = max(self.admission.state.admitted, self.admission.state.admitting)
        if new.returned > seen:
            return f"{new.returned} returned slots for {seen} admitted"
        if new.done and new.step < p.total_steps:
            return f"done at step {new.step} of {p.total_steps}"
        if new.version > old.version:
            ann = await self.bus.latest_weights()
            if ann is None or ann.version < new.version:
                latest = ann.version if ann is not None else None
                return f"version {new.version} was never announced (latest: {latest})"
        return None

    def _refuse(self, reason: str) -> None:
        if reason not in self._refusals and len(self._refusals) < 100:
            self._refusals.add(reason)
            log.error("trainer_state_refused", key=TRAINER_KEY, reason=reason[:300])

    async def run(self, stop: asyncio.Event) -> None:
        saved = await self.bus.kv_get(CONTROLLER_KEY, ControllerState)
        if saved is not None:
            self.admission.state = saved
        log.info("controller_started", admitted=self.admission.state.admitted)
        watch = await self.bus.kv_watch(TRAINER_KEY)
        await self._read_trainer()
        hb = asyncio.create_task(heartbeat_loop(self.bus, self.heartbeat, stop))
        try:
            while not stop.is_set() and not self.trainer.done:
                await self.admit_once()
                seen = self.trainer
                changed = await watch.wait(timeout_s=1.0)  # a trainer update, or a re-read
                await self._read_trainer()
                if not changed and self.trainer.version != seen.version:
                    # a new version the watch did not report: its consumer is gone (the cluster
                    # node that held it died; the connection, on another node, did not notice)
                    log.info("trainer_watch_reopened", version=self.trainer.version)
                    watch.reopen()
        finally:
            hb.cancel()
            await watch.stop()
        log.info("controller_stopped", admitted=self.admission.state.admitted)
