"""Token-exact chat turns: the ids to append for a tool result, never re-tokenized history.

An episode's token stream is the prompt's ids, then the model's ids exactly as sampled, then
the environment's ids, and so on. Decoding that stream and tokenizing the text again is not
the identity (a model may sample a non-canonical split, "hel"+"lo" for "hello"; verl #3720 and
#6719), so a chat turn's wrapper is computed from the chat template alone and appended:

    after the model's turn:  ... <|im_start|>assistant\\n{model ids, ending <|im_end|>}
    tool_turn_ids appends:   \\n<|im_start|>tool\\n{result}<|im_end|>\\n<|im_start|>assistant\\n

Invariants:
- `tool_turn_ids(tok, messages, new)` is the template of `messages + new` (with the generation
  prompt) minus the template of `messages` (without it), checked to be a pure append
  (`TemplateNotAppendOnly` otherwise: a template that rewrites earlier turns, such as one that
  drops past reasoning), preceded by what the template writes after the last assistant turn's
  end-of-turn token (SmolLM2 / Qwen2: the newline after `<|im_end|>`).
- So for a model turn whose ids are the template's own (canonical), prompt ids + model ids +
  wrapper ids == the template of the whole conversation, token for token; for any other model
  turn the wrapper is the same and the model's ids stay as sampled.
- The text of `messages` only renders the template; no id of the stream comes from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class TemplateNotAppendOnly(ValueError):
    pass


def template_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    **template_kwargs: Any,
) -> list[int]:
    """The chat template's text for `messages`, encoded without added special tokens (as
    `PromptBuilder.ids` encodes a prompt: the template writes its own)."""
    text = tokenizer.apply_chat_template(
        list(messages),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def default_end_of_turn_id(tokenizer: Any) -> int:
    """The token that ends a model turn in the template: the tokenizer's eos (SmolLM2 and
    Qwen2 chat models: `<|im_end|>`)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token: pass end_of_turn_id")
    return int(tokenizer.eos_token_id)


def tool_turn_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    new_messages: Sequence[Mapping[str, Any]],
    *,
    ended_turn: bool = True,
    end_of_turn_id: int | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """The ids to append after the model's last turn for `new_messages` (tool results) and the
    next assistant header (module docstring).

    `messages`: the conversation so far, ending with the assistant turn the model just wrote
    (its decoded text: it renders the template only). `ended_turn`: the model's ids end with
    the end-of-turn token (False when a stop string ended the turn before it: the wrapper then
    starts with that token). `template_kwargs` go to `apply_chat_template` (e.g. `tools=`)."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("tool_turn_ids: messages must end with the model's assistant turn")
    eot = end_of_turn_id if end_of_turn_id is not None else default_end_of_turn_id(tokenizer)
    before = template_ids(tokenizer, messages, add_generation_prompt=False, **template_kwargs)
    after = template_ids(
        tokenizer,
        [*messages, *new_messages],
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
    if after[: len(before)] != before:
        at = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
        raise TemplateNotAppendOnly(
            "the chat template changes earlier turns when a message is added (first "
            f"difference at token {at} of {len(before)}): the episode's ids cannot be built "
            "by appending; use a template that renders past turns unchanged"
        )
    turn_start = 0  # where the last assistant turn starts in `before`, when that is known
    if len(messages) > 1:
        head = template_ids(tokenizer, messages[:-1], add_generation_prompt=True, **template_kwargs)
        turn_start = len(head) if before[: len(head)] == head else 0
    last = len(before) - 1 - before[::-1].index(eot) if eot in before else -1
    if last < turn_start:
        raise ValueError(
            f"the chat template does not end the assistant turn with token {eot} "
            f"({tokenizer.convert_ids_to_tokens([eot])}): pass the id that does as end_of_turn_id"
        )
    closer = before[last + 1 :] if ended_turn else before[last:]
    return closer + after[len(before) :]
