"""Accuracy of a model on a task source, by sampling (or greedy decoding) and scoring.

Invariants:
- Prompts are encoded exactly as the rollout engines do (characters only, no BOS) and a
  completion is the generated tokens up to and including the first `eos`, decoded with special
  tokens skipped. Prompts are batched by token length, so no padding ever shifts positions.
- The same (model, source, n, temperature, seed) gives the same number: the eval indices and
  the sampling RNG depend on `seed` only, and the caller's torch RNG state is left untouched.
- `temperature <= 0` means greedy decoding.
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from areal.data.tasks import TaskItem, TaskSource
from areal.data.tokenizer import load_tokenizer
from areal.rewards.registry import RewardFn, default_reward_for, get_reward_fn


def eval_items(task_source: TaskSource, n: int, seed: int) -> list[TaskItem]:
    """`n` consecutive items from a seed-chosen start (files wrap around)."""
    start = random.Random(f"eval:{seed}").randrange(len(task_source))
    return [task_source.get((start + i) % len(task_source)) for i in range(n)]


@torch.no_grad()
def model_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task_source: TaskSource,
    n: int,
    temperature: float,
    seed: int = 0,
    reward_fn: RewardFn | None = None,
    max_new_tokens: int | None = None,
    batch_size: int = 128,
) -> float:
    """Mean reward of one completion per item over `n` items (see module invariants)."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    reward_fn = reward_fn or get_reward_fn(default_reward_for(task_source.name))
    items = eval_items(task_source, n, seed)
    if max_new_tokens is None:
        longest = max(len(str(it.metadata.get("target", it.answer))) for it in items)
        max_new_tokens = longest + 8
    by_len: dict[int, list[tuple[TaskItem, list[int]]]] = defaultdict(list)
    for item in items:
        ids = tokenizer.encode(item.prompt, add_special_tokens=False)
        by_len[len(ids)].append((item, ids))
    sampling = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for length in sorted(by_len):
            group = by_len[length]
            for i in range(0, len(group), batch_size):
                chunk = group[i : i + batch_size]
                input_ids = torch.tensor([ids for _, ids in chunk])
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_new_tokens,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    **sampling,
                )
                for (item, _), row in zip(chunk, out[:, length:].tolist(), strict=True):
                    if tokenizer.eos_token_id in row:
                        row = row[: row.index(tokenizer.eos_token_id) + 1]
                    text = tokenizer.decode(row, skip_special_tokens=True)
                    total += reward_fn(text, item.answer)
    model.train(was_training)
    return total / n


def evaluate_accuracy(
    model_dir: str | Path,
    task_source: TaskSource,
    n: int,
    temperature: float,
    seed: int = 0,
    reward_fn: RewardFn | None = None,
    max_new_tokens: int | None = None,
) -> float:
    """Load the Hugging Face model in `model_dir` and return its `model_accuracy`."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = load_tokenizer(model_dir)
    return model_accuracy(
        model, tokenizer, task_source, n, temperature, seed, reward_fn, max_new_tokens
    )
