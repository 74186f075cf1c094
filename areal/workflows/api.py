"""The workflow API: an episode is a token stream of segments, produced by a workflow that
awaits generations on the rollout worker's continuous batch.

A workflow (`rollout.workflow`: `single_turn`, `tool_call`, or `pkg.mod:Name`) is a class whose
`arun_episode(gen, task, sample_idx)` returns an `Episode`. `gen.generate(ids)` enqueues one
generation into the worker's running batch (many episodes decode together; a tool wait frees
the row) and returns its tokens with their behaviour log-probs and policy versions.

Invariants:
- the training sequence is exactly the token stream the model saw: the prompt, then the
  segments in order; text is never re-tokenized (a workflow appends ids, never text);
- a model segment carries, per token, the behaviour log-prob and the policy version that
  produced it (as `Generation` returned them); an environment segment (tool output, a user
  turn) carries no log-prob (0.0) and no version (-1) and is never trained (loss mask 0);
- `Episode.finish_reason` names why it ended: the last generation's `stop` / `length`, or
  one of `EPISODE_FINISH_REASONS` (turn or token budget spent, a tool that failed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from schemas import Task

ENV_VERSION = -1  # the version of an environment token: produced by no policy
# why an episode ended, besides the last generation's own `stop` / `length`
EPISODE_FINISH_REASONS = ("max_turns", "max_episode_tokens", "tool_error", "bad_tool_call")


@dataclass(frozen=True)
class Generation:
    """One generation's tokens (`Generator.generate`)."""

    output_ids: list[int]
    behav_logp: list[float]  # [len(output_ids)]
    versions: list[int]  # [len(output_ids)]
    finish_reason: str  # stop | length
    n_interrupts: int = 0
    n_reprefill_tokens: int = 0


@dataclass(frozen=True)
class Segment:
    """A stretch of the episode's token stream after the prompt."""

    ids: list[int]
    trained: bool  # model tokens (True) or environment tokens (False: loss mask 0)
    behav_logp: list[float]  # [len(ids)]; 0.0 for environment tokens
    versions: list[int]  # [len(ids)]; ENV_VERSION for environment tokens
    text: str = ""  # what the segment says (for transcripts, taps and rewards; never re-tokenized)

    @classmethod
    def model(cls, gen: Generation, text: str = "") -> Segment:
        return cls(list(gen.output_ids), True, list(gen.behav_logp), list(gen.versions), text)

    @classmethod
    def env(cls, ids: list[int], text: str = "") -> Segment:
        n = len(ids)
        return cls(list(ids), False, [0.0] * n, [ENV_VERSION] * n, text)


@dataclass(frozen=True)
class ToolCallRecord:
    """One tool call of an episode, as rewards and metrics see it."""

    name: str
    arguments: str
    output: str
    error: str | None = None  # None: the tool answered; else why not (timeout, raised, ...)
    latency_s: float = 0.0
    turn: int = 0


@dataclass
class Episode:
    """What `arun_episode` returns: the segments after the prompt, and what happened."""

    segments: list[Segment]
    finish_reason: str
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    n_turns: int = 1  # model generations
    n_interrupts: int = 0
    n_reprefill_tokens: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # anything the reward should see

    @property
    def n_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)


class Generator(Protocol):
    """The worker's continuous batch, as a workflow sees it."""

    async def generate(self, ids: list[int], *, max_new_tokens: int | None = None) -> Generation:
        """Generate a continuation of `ids` (the prompt and the episode so far) with the
        worker's sampling settings; `max_new_tokens` caps this turn (None: the run's)."""
        ...


class RolloutWorkflow(Protocol):
    async def arun_episode(self, gen: Generator, task: Task, sample_idx: int) -> Episode: ...
