"""A finished generation as the `Sample` the rollout publishes (in its task's group message), the
rejection marker that stands in for a task a stage refused, and the publishing of a group in
parts when it is too big for one message."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from areal.bus.codec import pack
from areal.bus.errors import MessageTooLarge
from schemas import Message, Sample, Task

if TYPE_CHECKING:  # the reward worker imports this module and needs no torch
    from areal.engines.base import GenOutput

T = TypeVar("T")


def sample_of(
    task: Task, out: GenOutput, text: str, *, worker_id: str, received_at: float
) -> Sample:
    """Sample `out.key`'s index of `task`, with per-token log-probs and versions packed."""
    return Sample(
        task_id=task.task_id,
        task_seq=task.seq,
        sample_idx=int(out.key.rsplit("/", 1)[1]),
        group_size=task.group_size,
        prompt_ids=task.prompt_ids,
        output_ids=pack(out.output_ids, "int32"),
        behav_logp=pack(out.behav_logp, "float32"),
        versions=pack(out.versions, "int32"),
        output_text=text,
        answer=task.answer,
        metadata=task.metadata,
        finish_reason=out.finish_reason,
        worker_id=worker_id,
        n_interrupts=out.n_interrupts,
        n_reprefill_tokens=out.n_reprefill_tokens,
        timings={
            "admitted_at": task.admitted_at,
            "received_at": received_at,
            "finished_at": time.time(),
        },
    )


def rejection_marker(
    task_id: str, task_seq: int, group_size: int, reason: str, *, worker_id: str
) -> Sample:
    """The stand-in a stage publishes downstream for a task it refused (its own message went to
    the DLQ): no tokens, `rejected` = why. It carries the task's identity only, so the trainer
    can retire the task (`rejected`) and the run's accounting stays exact."""
    empty_i, empty_f = pack([], "int32"), pack([], "float32")
    return Sample(
        task_id=task_id,
        task_seq=task_seq,
        sample_idx=0,
        group_size=group_size,
        prompt_ids=empty_i,
        output_ids=empty_i,
        behav_logp=empty_f,
        versions=empty_i,
        worker_id=worker_id,
        rejected=reason[:1000] or "rejected",
    )


async def publish_group(
    bus: Any, stream: str, items: Sequence[T], make: Callable[[list[T]], Message]
) -> int:
    """Publish `make(items)` (a group message) on `stream`; one over the server's max_payload is
    split in halves, each published under its own id, down to single samples (a single sample
    too big raises `MessageTooLarge`, with the fix). Returns the number of messages published."""
    items = list(items)
    try:
        await bus.publish(stream, make(items))
        return 1
    except MessageTooLarge:
        if len(items) == 1:
            raise
    mid = len(items) // 2
    first = await publish_group(bus, stream, items[:mid], make)
    return first + await publish_group(bus, stream, items[mid:], make)
