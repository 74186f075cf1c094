"""Controller: admits tasks onto `prompts` only while the staleness rule allows (AReaL eq. 3).

Admission is enforced by credits issued here, not by the consumer's max_ack_pending: a task's
prompt message is acknowledged by the rollout worker as soon as its samples are published, so
the server cannot see when a task is finished for training; the trainer's KV record (version,
returned slots) is the ground truth for "finished". Invariants:
- `admitted - returned <= (version + max_staleness + 1) * batch_size` at every admission, where
  `version` is the trainer's latest *published* version (read from KV, so never ahead of it);
- every admitted task is published exactly once: tasks are published with `Nats-Msg-Id` = task
  id *before* the cursor is persisted, so a restart re-publishes at most the last batch and the
  server de-duplicates it; nothing is ever admitted twice or skipped;
- admission stops at `total_steps * batch_size + returned`, so a finished run has nothing left in
  flight and `summary.json` can account for every task.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from areal.algo.staleness import admissible_count, admission_capacity
from areal.bus.client import Bus
from areal.bus.codec import pack
from areal.services.common import heartbeat_loop
from schemas import Task
from schemas import subjects as S

log = structlog.get_logger()

CONTROLLER_KEY = "controller"
TRAINER_KEY = "trainer"


def trainer_state_default() -> dict:
    return {"version": 0, "step": 0, "trained": 0, "dropped_stale": 0, "filtered": 0, "done": False}


class Controller:
    def __init__(
        self,
        bus: Bus,
        source,
        tokenizer,
        *,
        batch_size: int,
        group_size: int,
        max_staleness: int,
        total_steps: int,
    ) -> None:
        self.bus, self.source, self.tokenizer = bus, source, tokenizer
        self.B, self.G, self.eta, self.total_steps = (
            batch_size,
            group_size,
            max_staleness,
            total_steps,
        )
        self.state = {"admitted": 0, "cursor": 0}
        self._trainer = trainer_state_default()

    def _make_task(self, seq: int, version: int) -> Task:
        item = self.source.get(self.state["cursor"])
        ids = self.tokenizer.encode(item.prompt, add_special_tokens=False)
        return Task(
            task_id=f"{self.bus.names.run_id}-t{seq}",
            seq=seq,
            dataset_index=item.index,
            prompt=item.prompt,
            prompt_ids=pack(ids, "int32"),
            answer=item.answer,
            metadata=item.metadata,
            group_size=self.G,
            admitted_version=version,
        )

    async def admit_once(self, trainer: dict) -> int:
        """Admit as many tasks as the rule allows now; returns how many."""
        version = trainer["version"]
        returned = trainer["dropped_stale"] + trainer["filtered"]
        outstanding = self.state["admitted"] - returned
        n = admissible_count(outstanding, version, self.eta, self.B)
        n = min(n, self.total_steps * self.B + returned - self.state["admitted"])
        for _ in range(max(0, n)):
            seq = self.state["admitted"]
            await self.bus.publish(S.PROMPTS, self._make_task(seq, version))
            self.state["admitted"] += 1
            self.state["cursor"] += 1
        if n > 0:
            await self.bus.kv_put(CONTROLLER_KEY, self.state)
            await self.bus.metric(
                "admission",
                {
                    "admitted": self.state["admitted"],
                    "outstanding": self.state["admitted"] - returned,
                    "capacity": admission_capacity(version, self.eta, self.B),
                    "version": version,
                },
            )
        return max(0, n)

    def heartbeat(self) -> dict:
        t = self._trainer
        returned = t["dropped_stale"] + t["filtered"]
        return {
            **self.state,
            "version": t["version"],
            "outstanding": self.state["admitted"] - returned,
            "capacity": admission_capacity(t["version"], self.eta, self.B),
            "busy_frac": 0.0,
        }

    async def run(self, stop: asyncio.Event) -> None:
        self.state = await self.bus.kv_get(CONTROLLER_KEY) or self.state
        log.info("controller_started", **self.state)
        watcher = await self.bus.kv_watch(TRAINER_KEY)
        trainer = await self.bus.kv_get(TRAINER_KEY) or trainer_state_default()
        self._trainer = trainer
        hb = asyncio.create_task(heartbeat_loop(self.bus, self.heartbeat, stop))
        try:
            while not stop.is_set() and not trainer.get("done"):
                await self.admit_once(trainer)
                with contextlib.suppress(asyncio.TimeoutError, Exception):
                    await watcher.updates(timeout=1.0)
                trainer = await self.bus.kv_get(TRAINER_KEY) or trainer_state_default()
                self._trainer = trainer
        finally:
            hb.cancel()
            with contextlib.suppress(Exception):
                await watcher.stop()
        log.info("controller_stopped", **self.state)
