"""A finished episode as the `Sample` the rollout publishes (in its task's group message), the
rejection marker that stands in for a task a stage refused, and the publishing of a group in
parts when it is too big for one message."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from areal.bus.codec import pack
from areal.bus.errors import MessageTooLarge
from schemas import Message, Sample, Task
from schemas.messages import ToolCallInfo, TurnText

if TYPE_CHECKING:
    from areal.workflows.api import Episode

T = TypeVar("T")


def sample_of_episode(
    task: Task, sample_idx: int, ep: Episode, *, worker_id: str, received_at: float
) -> Sample:
    """Sample `sample_idx` of `task` from its episode: the segments' tokens in order, with the
    model tokens' behaviour log-probs and versions, and a loss mask when any token is the
    environment's (None: every token is the model's, as in single-turn)."""
    ids = [t for seg in ep.segments for t in seg.ids]
    logp = [x for seg in ep.segments for x in seg.behav_logp]
    versions = [v for seg in ep.segments for v in seg.versions]
    mask = [1 if seg.trained else 0 for seg in ep.segments for _ in seg.ids]
    errors = sum(1 for c in ep.tool_calls if c.error is not None)
    several = len(ep.segments) > 1 or bool(ep.tool_calls)
    turns = [
        TurnText(role="model" if seg.trained else "env", text=seg.text, n_tokens=len(seg.ids))
        for seg in ep.segments
    ]
    calls = [
        ToolCallInfo(
            name=c.name,
            arguments=c.arguments,
            output=c.output,
            error=c.error,
            latency_s=c.latency_s,
            turn=c.turn,
        )
        for c in ep.tool_calls
    ]
    return Sample(
        task_id=task.task_id,
        task_seq=task.seq,
        sample_idx=sample_idx,
        group_size=task.group_size,
        prompt_ids=task.prompt_ids,
        output_ids=pack(ids, "int32"),
        behav_logp=pack(logp, "float32"),
        versions=pack(versions, "int32"),
        loss_mask=None if all(mask) else pack(mask, "uint8"),
        output_text="".join(seg.text for seg in ep.segments),
        answer=task.answer,
        metadata=task.metadata,
        finish_reason=ep.finish_reason,
        worker_id=worker_id,
        n_interrupts=ep.n_interrupts,
        n_reprefill_tokens=ep.n_reprefill_tokens,
        n_turns=ep.n_turns,
        n_tool_calls=len(ep.tool_calls),
        n_tool_errors=errors,
        tool_s=sum(c.latency_s for c in ep.tool_calls),
        prompt=task.prompt,
        turns=turns if several else [],
        tool_calls=calls,
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
