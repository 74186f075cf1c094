"""Controller: publishes tasks onto `prompts` while admission allows (AReaL eq. 3).

The decision is `areal.core.admission.Admission`; this shell reads the trainer's state from KV,
publishes what admission allows, persists its own state, and reports.

Invariants (see the core for the rule itself):
- tasks are published with `Nats-Msg-Id` = task id *before* the controller state is persisted,
  so a restart re-publishes at most the last batch and the server de-duplicates it;
- the trainer's KV record (version, returned slots) is the ground truth for admission: the
  controller never sees a version whose weights are not announced.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import structlog

from areal.bus.client import Bus
from areal.bus.codec import pack
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
        self.trainer = await self.bus.kv_get(TRAINER_KEY, TrainerState) or TrainerState()

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
                await watch.wait(timeout_s=1.0)  # a trainer update, or a periodic re-read
                await self._read_trainer()
        finally:
            hb.cancel()
            await watch.stop()
        log.info("controller_stopped", admitted=self.admission.state.admitted)
