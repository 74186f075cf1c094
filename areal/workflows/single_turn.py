"""`single_turn`: one generation from the task's prompt, every token trained (what a sample was
before workflows existed)."""

from __future__ import annotations

from areal.workflows.api import Episode, Generator, Segment
from areal.workflows.context import WorkflowContext
from schemas import Task


class SingleTurn:
    def __init__(self, ctx: WorkflowContext) -> None:
        self.ctx = ctx

    async def arun_episode(self, gen: Generator, task: Task, sample_idx: int) -> Episode:
        out = await gen.generate(task.prompt_ids.to_list())
        return Episode(
            segments=[Segment.model(out, self.ctx.decode(out.output_ids))],
            finish_reason=out.finish_reason,
            n_turns=1,
            n_interrupts=out.n_interrupts,
            n_reprefill_tokens=out.n_reprefill_tokens,
        )
