"""`single_turn`: one generation from the task's prompt, every token trained (what a sample was
before workflows existed)."""

from __future__ import annotations

from areal.workflows.api import Episode, Generation, Generator, Segment
from areal.workflows.context import WorkflowContext
from schemas import Task


class SingleTurn:
    # the host may generate the prompt itself and call `episode` with the result, with no
    # coroutine per sample (the quickstart's samples are a few tokens: that hop cost ~10%)
    direct = True

    def __init__(self, ctx: WorkflowContext) -> None:
        self.ctx = ctx

    async def arun_episode(self, gen: Generator, task: Task, sample_idx: int) -> Episode:
        return self.episode(await gen.generate(task.prompt_ids.to_list()))

    def episode(self, out: Generation) -> Episode:
        return Episode(
            segments=[Segment.model(out, self.ctx.decode(out.output_ids))],
            finish_reason=out.finish_reason,
            n_turns=1,
            n_interrupts=out.n_interrupts,
            n_reprefill_tokens=out.n_reprefill_tokens,
        )
