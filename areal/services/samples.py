"""A finished generation as the `Sample` message the rollout publishes."""

from __future__ import annotations

import time

from areal.bus.codec import pack
from areal.engines.base import GenOutput
from schemas import Sample, Task


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
