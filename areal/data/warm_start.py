"""Supervised warm start of the tiny model on a task, cached on disk.

A randomly initialised tiny model never earns a reward, so RL could not start from it. The
warm start trains it briefly with supervision (prompt -> target completion + `<eos>`, loss on
completion tokens only) until it knows the task but is unsure of it: with the default recipe
for `synthetic:arithmetic` (1-2 digit addition) it decodes ~90% right greedily but samples a
right answer at the quickstart's temperature 1.5 for only ~6-11% of the prompts (seeds 0-2),
so RL has something to sharpen. The build takes ~10-35 s on a busy 2-core CPU.

Invariants:
- The cache key covers everything that changes the weights: the preset dims, task spec and
  kwargs (and the file's size and mtime for dataset files), steps, lr, batch size, seed and
  `WARM_CODE_VERSION` (bump it whenever the training code changes its result).
- A cached directory is complete or absent: it is built in a temporary sibling directory and
  renamed into place; an fcntl lock on `warm-<key>.lock` makes concurrent callers (other
  processes) wait for one build instead of racing.
- A wait for that lock is never silent and never endless: the waiter logs who holds it (pid,
  host, what it builds, since when, written into the lock file by the holder) at once and every
  `lock_progress_s`, and raises `WarmStartLockTimeout` after `lock_timeout_s`. The lock is
  released when its holder exits, however it exits (flock), so it cannot go stale.
- The caller's torch RNG state and thread count are restored afterwards.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import structlog

from areal.data.presets import TINY_PRESET, TinyPreset
from areal.data.tasks import SYNTHETIC_TASKS, TaskSource

if TYPE_CHECKING:
    import torch

# torch and transformers are imported where a model is built, not here: the launcher finds a
# cached warm start through this module, and their imports took seconds of its start-up

__all__ = [
    "DEFAULT_RECIPES",
    "SftRecipe",
    "WarmStartLockTimeout",
    "ensure_warm_model",
    "warm_key",
]

WARM_CODE_VERSION = "warm-v2"
# One intra-op thread: the tiny model's matmuls gain nothing from more, and on a shared 2-core
# box two OpenMP threads made a training step ~80x slower (3.4 s vs 0.04 s) under load.
WARM_NUM_THREADS = 1
log = structlog.get_logger()


@dataclass(frozen=True)
class SftRecipe:
    steps: int
    lr: float
    batch_size: int = 64
    warmup_steps: int = 10
    label_smoothing: float = 0.0


# Calibrated on a shared 2-core CPU, lr constant after warmup. Arithmetic accuracy (T=1 / greedy)
# vs steps, seed 0: 300 -> 0.17 / 0.31, 350 -> 0.25 / 0.40, 400 -> 0.31 / 0.51, 500 -> 0.42 / 0.67.
# lr 3e-3 learns far slower (0.06 / 0.07 at 400 steps). Running sum: ~0.50 / 0.51 at 300 steps,
# mostly the one-term tasks (the long tail is what RL has to learn).
# The arithmetic default is longer and label-smoothed (0.1): the model then decodes greedily
# right far more often than it samples right at the quickstart's T=1.5 (it knows, but is
# unsure), the regime where RL shows a clear rise within minutes. Measured on 256 prompts, seeds
# 0 / 1 / 2: greedy 0.93 / 0.88 / 0.93, T=1 0.64 / 0.54 / 0.65, T=1.5 0.07 / 0.06 / 0.11.
# lr 3e-3 (the default until 2026-12) sits at the edge of stability: the same code and seed gave
# greedy 0.60 on one CPU and 0.41 on another (float rounding decides the trajectory), and the
# quickstart then rose to ~0.7 on the first and only ~0.38 on the second.
# Tool arithmetic (a*b+c through the calc tool, `examples/tool_arithmetic.yaml`): the format is
# learnt fast (greedy episodes right 0.996 on 256 prompts at 400 steps, seed 0), so the recipe is
# short (~65-75 s) and label-smoothed: at the example's T=1.0 a sampled episode is right for
# ~0.09 (0.41 call the tool, 0.21 with a call that runs); the runs start at 0.14-0.20.
DEFAULT_RECIPES: dict[str, SftRecipe] = {
    "synthetic:arithmetic": SftRecipe(steps=1500, lr=1e-3, label_smoothing=0.1),
    "synthetic:running_sum": SftRecipe(steps=300, lr=1e-3),
    "synthetic:tool_arithmetic": SftRecipe(steps=400, lr=1e-3, label_smoothing=0.1),
}
FALLBACK_RECIPE = SftRecipe(steps=200, lr=1e-3)
# A build takes ~10 s to ~3 min on a busy 2-core CPU: waiting 15 min for another process's
# build means that process is stuck (or the machine is far too loaded) and the caller should know.
LOCK_TIMEOUT_S = 900.0
LOCK_PROGRESS_S = 15.0
_LOCK_POLL_S = 0.2


class WarmStartLockTimeout(TimeoutError):
    """Another process held the warm-start build lock for longer than the caller would wait."""


def cache_root(cache_dir: str | Path | None) -> Path:
    """The model cache dir: `cache_dir` (the settings' `cache_dir`, env `AREAL_CACHE_DIR`), or
    `~/.cache/areal-bus/models` when it is None."""
    return Path(cache_dir) if cache_dir is not None else Path.home() / ".cache/areal-bus/models"


def warm_key(
    task_spec: str,
    task_kwargs: dict[str, Any],
    recipe: SftRecipe,
    seed: int,
    preset: TinyPreset = TINY_PRESET,
) -> str:
    """Stable short hash of everything that determines the warm model's weights."""
    spec_id: Any = task_spec
    if task_spec not in SYNTHETIC_TASKS and Path(task_spec).is_file():
        stat = Path(task_spec).stat()
        spec_id = [str(Path(task_spec).resolve()), stat.st_size, stat.st_mtime_ns]
    blob = json.dumps(
        [WARM_CODE_VERSION, preset.as_dict(), spec_id, task_kwargs, recipe.__dict__, seed],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


FIELD_KWARGS = ("prompt_field", "answer_field")  # a file's field names, among the task kwargs


def warm_source(task_spec: str, seed: int, task_kwargs: dict[str, Any]) -> TaskSource:
    """The source the warm start trains on, from the one factory (`sources.make_source`):
    `task_kwargs` are a synthetic task's options, or a file's field names (`FIELD_KWARGS`); a
    file is read in file order (no shuffle)."""
    from areal.config import DataSettings
    from areal.data.sources import make_source

    fields = {k: v for k, v in task_kwargs.items() if k in FIELD_KWARGS}
    options = {k: v for k, v in task_kwargs.items() if k not in FIELD_KWARGS}
    data = DataSettings(source=task_spec, task_kwargs=options, **fields)
    return make_source(task_spec, data, seed, shuffle=False)


def _batch(source: TaskSource, tokenizer: Any, indices: list[int]) -> dict[str, torch.Tensor]:
    """Right-padded prompt+target+eos rows; labels are -100 on prompt and padding."""
    import torch

    rows, labels = [], []
    for i in indices:
        item = source.get(i % len(source))
        prompt = tokenizer.encode(item.prompt, add_special_tokens=False)
        target = tokenizer.encode(
            str(item.metadata.get("target", item.answer)), add_special_tokens=False
        )
        target.append(tokenizer.eos_token_id)
        rows.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    label_ids = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return {"input_ids": input_ids, "attention_mask": mask, "labels": label_ids}


def train_sft(model_dir: Path, source: TaskSource, recipe: SftRecipe, seed: int) -> list[float]:
    """Train the model in `model_dir` in place; returns the loss of every step."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=0.0)

    def lr_factor(step: int) -> float:
        # Linear warmup, then constant: the model after k steps is the same whatever the total,
        # so the calibration curve (accuracy vs steps) reads directly as a choice of `steps`.
        return min(1.0, (step + 1) / recipe.warmup_steps)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    # SFT data comes from the far half of the index space, away from what RL starts on.
    start = len(source) // 2 + seed
    losses: list[float] = []
    for step in range(recipe.steps):
        first = start + step * recipe.batch_size
        batch = _batch(source, tokenizer, list(range(first, first + recipe.batch_size)))
        labels = batch.pop("labels")[:, 1:]  # [B, S-1]: logits at p predict token p+1
        logits = model(**batch).logits[:, :-1]  # [B, S-1, V]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=-100,
            label_smoothing=recipe.label_smoothing,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == recipe.steps - 1:
            log.info("warm_sft_step", step=step, steps=recipe.steps, loss=round(losses[-1], 4))
    model.save_pretrained(model_dir, safe_serialization=True)
    return losses


def _holder(path: Path) -> str:
    """Who holds the lock at `path`, as its holder wrote it (best effort: it may be mid-write)."""
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "an unknown process"
    age = time.time() - float(info.get("since", time.time()))
    return (
        f"pid {info.get('pid')} on {info.get('host')}, building {info.get('building')} "
        f"for {age:.0f} s"
    )


@contextlib.contextmanager
def build_lock(
    path: Path,
    building: str,
    *,
    timeout_s: float = LOCK_TIMEOUT_S,
    progress_s: float = LOCK_PROGRESS_S,
) -> Iterator[IO[str]]:
    """Hold the exclusive build lock at `path` (see the module invariants): wait for it at most
    `timeout_s`, logging who holds it at once and every `progress_s`, then record this process
    as the holder (`building` names what it builds) until the block exits."""
    with open(path, "a+") as lock:  # "a+": opening must not erase the holder's record
        t0 = time.monotonic()
        next_report = t0
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            waited = time.monotonic() - t0
            if waited >= timeout_s:
                raise WarmStartLockTimeout(
                    f"gave up after {timeout_s:g} s waiting for the warm-start lock {path}, held "
                    f"by {_holder(path)}: let that process finish or stop it, or wait longer "
                    "(--set model.warm_start_lock_timeout_s=SECONDS)"
                )
            if time.monotonic() >= next_report:
                log.info(
                    "warm_model_lock_wait",
                    lock=str(path),
                    holder=_holder(path),
                    waited_s=round(waited),
                    gives_up_in_s=round(timeout_s - waited),
                )
                next_report += progress_s
            time.sleep(min(_LOCK_POLL_S, max(0.0, timeout_s - waited)))
        if time.monotonic() > t0 + _LOCK_POLL_S:
            log.info(
                "warm_model_lock_acquired", lock=str(path), waited_s=round(time.monotonic() - t0, 1)
            )
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        lock.seek(0)
        lock.truncate()
        lock.write(json.dumps({**record, "building": building}))
        lock.flush()
        try:
            yield lock
        finally:  # the record goes first, then the lock (when the file closes)
            lock.seek(0)
            lock.truncate()


def ensure_warm_model(
    task_spec: str = "synthetic:arithmetic",
    *,
    sft_steps: int | None = None,
    seed: int = 0,
    cache_dir: str | Path | None,
    task_kwargs: dict[str, Any] | None = None,
    lr: float | None = None,
    label_smoothing: float | None = None,
    preset: TinyPreset = TINY_PRESET,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
    lock_progress_s: float = LOCK_PROGRESS_S,
) -> Path:
    """Path of the warm-started model directory for (task, recipe, seed), building it if it is
    not cached under `cache_root(cache_dir)` (pass the settings' `cache_dir`; None = the default
    dir). `sft_steps` / `lr` / `label_smoothing` default to the task's entry in
    `DEFAULT_RECIPES`. While another process builds the same model this waits for it, at most
    `lock_timeout_s` (then `WarmStartLockTimeout`), logging the holder every `lock_progress_s`."""
    task_kwargs = dict(task_kwargs or {})
    base = DEFAULT_RECIPES.get(task_spec, FALLBACK_RECIPE)
    recipe = SftRecipe(
        steps=base.steps if sft_steps is None else sft_steps,
        lr=base.lr if lr is None else lr,
        batch_size=base.batch_size,
        warmup_steps=min(base.warmup_steps, max(1, sft_steps or base.steps)),
        label_smoothing=base.label_smoothing if label_smoothing is None else label_smoothing,
    )
    if recipe.steps < 0:
        raise ValueError(f"sft_steps must be >= 0, got {recipe.steps}")
    root = cache_root(cache_dir)
    key = warm_key(task_spec, task_kwargs, recipe, seed, preset)
    slug = task_spec.split(":")[-1] if task_spec in SYNTHETIC_TASKS else Path(task_spec).stem
    final = root / f"warm-{slug}-{recipe.steps}-{key}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with build_lock(
        root / f"warm-{key}.lock",
        final.name,
        timeout_s=lock_timeout_s,
        progress_s=lock_progress_s,
    ):
        if final.is_dir():  # another process built it while we waited
            log.info("warm_model_cached", path=str(final))
            return final
        import torch

        from areal.data.tiny_model import build_tiny_model

        tmp = root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        t0 = time.monotonic()
        threads = torch.get_num_threads()
        log.info("warm_model_build_started", task=task_spec, steps=recipe.steps, path=str(final))
        try:
            torch.set_num_threads(WARM_NUM_THREADS)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                build_tiny_model(tmp, seed=seed, preset=preset)
                source = warm_source(task_spec, seed, task_kwargs)
                losses = train_sft(tmp, source, recipe, seed) if recipe.steps else []
            meta = {
                "task_spec": task_spec,
                "task_kwargs": task_kwargs,
                "recipe": recipe.__dict__,
                "seed": seed,
                "preset": preset.as_dict(),
                "code_version": WARM_CODE_VERSION,
                "final_loss": losses[-1] if losses else None,
                "build_s": round(time.monotonic() - t0, 2),
            }
            (tmp / "areal_warm_start.json").write_text(json.dumps(meta, indent=2, default=str))
            os.rename(tmp, final)
        finally:
            torch.set_num_threads(threads)
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("warm_model_built", path=str(final), **{k: meta[k] for k in ("final_loss", "build_s")})
    return final
