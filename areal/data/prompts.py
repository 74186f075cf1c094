"""Prompts the way real runs build them, and the token ids that end a completion.

Invariants:
- `PromptBuilder.text(item)` is a pure function of (settings, tokenizer, item): the controller,
  the rollout worker's evaluation and a user's script render the same task to the same text.
- The user message is `settings.template` with `{prompt}` (the task's prompt) and any of the
  task's metadata fields substituted, followed by the format instruction of `settings.format`
  (none for `plain`). With a chat template (the tokenizer has one and `chat_template` is not
  `off`), the text is the template applied to [system (when `system_prompt` is set), user] with
  the generation prompt added; without one it is the user message as is (the built-in
  character model's prompts, e.g. `"23+45="`, are unchanged by the defaults).
- `ids(item)` encodes that text with `add_special_tokens=False`: a chat template writes its own
  special tokens (BOS, `<|im_start|>`), so none is added twice.
- `stop_token_ids` is the tokenizer's eos, every eos id of the model's `generation_config.json`
  (chat models end a turn with a token other than the tokenizer's eos, e.g. `<|im_end|>`,
  `<|eot_id|>`), then each extra stop string, which must be exactly one token of the vocabulary
  (a multi-token stop string fails at start with the tokens it splits into).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

FORMAT_INSTRUCTIONS: dict[str, str] = {
    "plain": "",
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
    "think": (
        "Think about the problem step by step inside <think> </think> tags, then give the "
        "final answer within \\boxed{}."
    ),
}


class PromptSettings(BaseModel):
    """How a task becomes the prompt a model sees (`prompt:` in the run config)."""

    model_config = ConfigDict(extra="forbid")

    chat_template: Literal["auto", "on", "off"] = Field(
        "auto",
        description="auto: apply the tokenizer's chat template when it has one; on: require "
        "one (fails at start without); off: the user message is the whole prompt",
    )
    system_prompt: str | None = Field(
        None, description="system message (chat template only); None = the template's default"
    )
    template: str = Field(
        "{prompt}",
        description="the user message; {prompt} is the task's prompt, {field} any metadata "
        "field of the task",
    )
    format: Literal["plain", "boxed", "think"] = Field(
        "plain",
        description="answer format asked for after the user message: plain (nothing added), "
        "boxed (reason, then \\boxed{answer}), think (<think>...</think>, then \\boxed{answer})",
    )
    stop: list[str] = Field(
        default_factory=list,
        description="extra stop strings besides the model's eos ids; each must be one token",
    )

    @model_validator(mode="after")
    def _check_template(self) -> PromptSettings:
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None]
        except ValueError as e:
            raise ValueError(
                f"prompt.template {self.template!r} is not a valid format string ({e}); "
                "write literal braces as {{ and }}"
            ) from None
        if "prompt" not in fields:
            raise ValueError(
                f"prompt.template {self.template!r} has no {{prompt}} placeholder: the task's "
                "prompt would never reach the model; add {prompt}"
            )
        return self


class TaskLike(Protocol):
    prompt: str
    metadata: dict


class _Tokenizer(Protocol):
    chat_template: Any
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class PromptBuilder:
    """Renders tasks to prompt text and ids (see the module invariants)."""

    def __init__(self, settings: PromptSettings, tokenizer: _Tokenizer) -> None:
        self.settings, self.tokenizer = settings, tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if settings.chat_template == "on" and not has_template:
            raise ValueError(
                "prompt.chat_template is 'on' but the model's tokenizer has no chat template: "
                "use a chat model (e.g. one imported with `areal model import`) or set "
                "prompt.chat_template to auto or off"
            )
        self.use_chat = has_template and settings.chat_template != "off"
        if settings.system_prompt is not None and not self.use_chat:
            raise ValueError(
                "prompt.system_prompt is set but no chat template is applied (the tokenizer "
                "has none, or prompt.chat_template is off): put the instruction into "
                "prompt.template instead"
            )

    def user_message(self, item: TaskLike) -> str:
        fields = {**{k: v for k, v in item.metadata.items() if isinstance(k, str)}}
        fields["prompt"] = item.prompt
        try:
            text = self.settings.template.format(**fields)
        except KeyError as e:
            raise ValueError(
                f"prompt.template uses {{{e.args[0]}}}, which this task does not have "
                f"(fields: {sorted(fields)})"
            ) from None
        instruction = FORMAT_INSTRUCTIONS[self.settings.format]
        return f"{text}\n\n{instruction}" if instruction else text

    def text(self, item: TaskLike) -> str:
        user = self.user_message(item)
        if not self.use_chat:
            return user
        messages = []
        if self.settings.system_prompt is not None:
            messages.append({"role": "system", "content": self.settings.system_prompt})
        messages.append({"role": "user", "content": user})
        return self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, tokenize=False, add_generation_prompt=True
        )

    def ids(self, item: TaskLike) -> list[int]:
        return list(self.tokenizer.encode(self.text(item), add_special_tokens=False))


def stop_token_ids(tokenizer: Any, model_dir: str | Path, extra: list[str] = ()) -> tuple[int, ...]:
    """The ids that end a completion (see the module invariants), in a stable order."""
    ids: list[int] = []

    def add(i: Any) -> None:
        if isinstance(i, int) and i not in ids:
            ids.append(i)

    add(tokenizer.eos_token_id)
    gen_config = Path(model_dir) / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            add(i)
    for s in extra:
        tokens = tokenizer.encode(s, add_special_tokens=False)
        if len(tokens) != 1:
            pieces = tokenizer.convert_ids_to_tokens(tokens)
            raise ValueError(
                f"prompt.stop {s!r} is {len(tokens)} tokens ({pieces}) in this model's vocabulary, "
                "not one: use a single-token stop string (e.g. the chat template's end-of-turn "
                "token) or leave it out"
            )
        add(tokens[0])
    if not ids:
        raise ValueError(
            f"the tokenizer in {model_dir} has no eos token and the model's generation config "
            "names none: add prompt.stop with the string that ends a completion"
        )
    return tuple(ids)
