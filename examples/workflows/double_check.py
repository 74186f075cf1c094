"""A workflow in ~30 lines: the model answers, is asked to check, and answers again.

Use it with `rollout.workflow: examples.workflows.double_check:DoubleCheck` (run from the repo
root, or put the module on PYTHONPATH), `rollout.max_turns: 2`. The follow-up question is
environment text: its tokens are shown to the model but never trained.
"""

from __future__ import annotations

from areal.workflows.api import Episode, Generator, Segment
from areal.workflows.context import WorkflowContext
from schemas import Task


class DoubleCheck:
    def __init__(self, ctx: WorkflowContext, question: str = " Check: ") -> None:
        self.ctx, self.question = ctx, question

    async def arun_episode(self, gen: Generator, task: Task, sample_idx: int) -> Episode:
        ids = task.prompt_ids.to_list()
        first = await gen.generate(ids)  # turn 1: the first answer
        ids += first.output_ids
        asked = self.ctx.encode(self.question)  # appended as ids: never re-tokenized
        second = await gen.generate(ids + asked)  # turn 2: the answer after the check
        return Episode(
            segments=[
                Segment.model(first, self.ctx.decode(first.output_ids)),
                Segment.env(asked, self.question),
                Segment.model(second, self.ctx.decode(second.output_ids)),
            ],
            finish_reason=second.finish_reason,
            n_turns=2,
        )
