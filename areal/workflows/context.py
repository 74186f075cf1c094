"""What a workflow is built with: the tokenizer's two directions, the sampling limits and the
episode budget of the run (`rollout.*`), and the worker's tokenizer for chat templates."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class WorkflowContext:
    decode: Callable[[list[int]], str]  # ids -> text (stop tokens and special tokens dropped)
    encode: Callable[[str], list[int]]  # text -> ids, no special tokens added
    max_new_tokens: int  # per generation (turn)
    max_turns: int = 1  # model generations per episode
    max_episode_tokens: int | None = None  # tokens after the prompt, model and environment
    stop_token_ids: tuple[int, ...] = ()
    tokenizer: Any = None  # the Hugging Face tokenizer, when the model has one
    extra: dict[str, Any] = field(default_factory=dict)

    def episode_budget(self) -> int:
        """Tokens an episode may hold after its prompt."""
        if self.max_episode_tokens is not None:
            return self.max_episode_tokens
        return 2 * self.max_new_tokens * self.max_turns
