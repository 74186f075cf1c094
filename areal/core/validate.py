"""Boundary checks: a message that decodes is still a claim; these check it against the run.

Pure functions over decoded messages and the run's `Bounds`; each returns the reason a message
does not fit the run (for the dead-letter record), or None. The services run them before a
message reaches the scheduler, the scorer or the optimizer (DESIGN: nothing untrusted reaches
the model), and a failure never raises: one bad message costs only itself.

What a message of this run must be:
- its task id is the run's id for its admission seq (`<run>-t<seq>`), and its group size is
  the run's G;
- token ids are integers within the model's vocabulary; a prompt is not empty and leaves room
  in the model's context for at least one generated token; prompt + output fit the context;
- an output is model tokens, and in a multi-turn episode environment tokens too (tool output,
  user turns), told apart by the sample's `loss_mask` (uint8, 1 = model, 0 = environment, as
  long as the output; None: every token is a model token); a sample holds at most
  `max_new_tokens * max_turns` model tokens (single-turn: `max_new_tokens`) and at most
  `max_episode_tokens` output tokens;
- behaviour log-probs of model tokens are finite float32 in `[LOGP_FLOOR, LOGP_SLACK]` (a
  log-probability is <= 0; the slack absorbs rounding);
- per-token versions of model tokens are integers in `[0, latest]`, never decreasing along the
  sample's model tokens (weights only move forward), where `latest` is the newest version the
  checker's caller knows was published: a version from the future is a lie;
- an environment token has log-prob exactly 0.0 and version `ENV_VERSION` (-1): no policy made
  it, and nothing about it is trained;
- a reward is finite and within the scorer's declared range;
- a group message (`trajectories`, `rewards`) holds samples of one task (the same task, seq,
  group size and prompt; each index once): all G, or a part when the group was too big for one
  message; or one rejection marker alone.

`latest` and the admitted count come from the run state, which a checker may see late: callers
re-read the run state and check again before they reject for a future version or seq
(`Verdict.stale_view`), so a slow view never rejects a legitimate message.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from areal.workflows.api import ENV_VERSION, EPISODE_FINISH_REASONS
from schemas import PackedArray, Sample, SampleGroup, ScoredGroup, ScoredSample, Task
from schemas.arrays import ITEMSIZE

__all__ = [
    "LOGP_FLOOR",
    "Bounds",
    "Verdict",
    "check_group",
    "check_marker",
    "check_sample",
    "check_scored",
    "check_scored_group",
    "check_task",
]

LOGP_FLOOR = -1e4  # no sampled token of a real model is this unlikely; -1e30 would overflow ratios
LOGP_SLACK = 1e-3  # log-probs are <= 0; fp rounding of a near-certain token may land just above
INT_DTYPES = ("int32", "int64")
FINISH_REASONS = ("stop", "length", *EPISODE_FINISH_REASONS)


@dataclass(frozen=True)
class Bounds:
    """What the run allows (from its config and its model)."""

    run_id: str
    group_size: int | None = None  # None: not checked (a stage that does not know G)
    max_new_tokens: int = 2**31 - 1  # model tokens per turn
    max_turns: int = 1  # model generations per episode (model tokens <= max_new_tokens * this)
    max_episode_tokens: int | None = None  # output tokens, model and environment; None: unchecked
    vocab_size: int | None = None  # None: the checker has no model (token ids not checked)
    max_seq_len: int | None = None  # the model's context (prompt + output), when known
    reward_range: tuple[float, float] = (-math.inf, math.inf)

    @classmethod
    def with_model(cls, model: object, **fields: object) -> Bounds:
        """`fields` plus the vocabulary and context of an engine that holds the model (its
        `vocab_size` and `max_seq_len`, where it has them)."""
        return cls(
            vocab_size=getattr(model, "vocab_size", None),
            max_seq_len=getattr(model, "max_seq_len", None),
            **fields,  # type: ignore[arg-type]
        )

    def task_id(self, seq: int) -> str:
        return f"{self.run_id}-t{seq}"

    @property
    def max_model_tokens(self) -> int:
        """Model tokens a sample may hold: `max_new_tokens` per turn, `max_turns` turns."""
        return self.max_new_tokens * self.max_turns


@dataclass(frozen=True)
class Verdict:
    """A rejection: `reason` for the dead letter; `stale_view` when it rests only on the run
    state the caller holds (a future version or seq), so a fresher view may accept it."""

    reason: str
    stale_view: bool = False


_SMALL = 256  # arrays up to this long are checked as Python lists: numpy's per-call cost
# (a few us per min/max/isfinite/diff) made validation ~0.1 ms per short sample, per stage
_FORMATS = {"int32": ("i", "<i4"), "int64": ("q", "<i8"), "float32": ("f", "<f4")}
_LITTLE = sys.byteorder == "little"


def _values(arr: PackedArray) -> list | np.ndarray:
    """The elements of an int32/int64/float32 packed array: a list when short, else numpy."""
    fmt, np_dtype = _FORMATS[arr.dtype]
    if _LITTLE and len(arr.data) <= _SMALL * ITEMSIZE[arr.dtype]:
        return memoryview(arr.data).cast(fmt).tolist()
    return np.frombuffer(arr.data, dtype=np_dtype)


def _lo_hi(vals: list | np.ndarray) -> tuple:
    """(min, max) of a non-empty `_values` result, as Python numbers."""
    if isinstance(vals, list):
        return min(vals), max(vals)
    return vals.min().item(), vals.max().item()


def _all_finite(vals: list | np.ndarray) -> bool:
    if isinstance(vals, list):
        return all(math.isfinite(v) for v in vals)
    return bool(np.isfinite(vals).all())


def _decreases(vals: list | np.ndarray) -> bool:
    if isinstance(vals, list):
        return any(b < a for a, b in zip(vals, vals[1:], strict=False))
    return bool((np.diff(vals) < 0).any())


def _ints(arr: PackedArray, what: str) -> tuple[list | np.ndarray | None, str | None]:
    if arr.dtype not in INT_DTYPES:
        return None, f"{what} has dtype {arr.dtype}, expected one of {INT_DTYPES}"
    return _values(arr), None


def _check_ids(arr: PackedArray, what: str, b: Bounds) -> str | None:
    ids, err = _ints(arr, what)
    if err is not None:
        return err
    assert ids is not None
    if not len(ids):
        return None
    lo, hi = _lo_hi(ids)
    if lo < 0:
        return f"{what} holds a negative token id {lo}"
    if b.vocab_size is not None and hi >= b.vocab_size:
        return f"{what} holds token id {hi}, outside the vocabulary of {b.vocab_size}"
    return None


def _check_prompt(prompt_ids: PackedArray, b: Bounds, what: str) -> str | None:
    n = len(prompt_ids)
    if n == 0:
        return f"{what}: empty prompt_ids"
    if b.max_seq_len is not None and n >= b.max_seq_len:
        return f"{what}: prompt of {n} tokens leaves no room in the model's context {b.max_seq_len}"
    return _check_ids(prompt_ids, f"{what}: prompt_ids", b)


def _check_identity(task_id: str, seq: int, group_size: int, b: Bounds, what: str) -> str | None:
    if task_id != b.task_id(seq):
        return f"{what}: task id {task_id[:80]!r} is not this run's id for seq {seq}"
    if b.group_size is not None and group_size != b.group_size:
        return f"{what}: group_size {group_size} != the run's {b.group_size}"
    return None


def check_task(task: Task, b: Bounds, *, latest_version: int) -> Verdict | None:
    """A task from `prompts`, before it is scheduled."""
    what = f"task {task.task_id[:80]}"
    err = _check_identity(task.task_id, task.seq, task.group_size, b, what)
    err = err or _check_prompt(task.prompt_ids, b, what)
    if err is not None:
        return Verdict(err)
    if task.admitted_version > latest_version:
        return Verdict(
            f"{what}: admitted at version {task.admitted_version}, but the newest published "
            f"version is {latest_version}",
            stale_view=True,
        )
    return None


def check_sample(sample: Sample, b: Bounds, *, latest_version: int) -> Verdict | None:
    """A sample from `trajectories` (at the reward worker) or inside a scored sample."""
    if sample.rejected:
        return check_marker(sample, b)
    what = f"sample {sample.sample_id[:90]}"
    err = _check_identity(sample.task_id, sample.task_seq, sample.group_size, b, what)
    err = err or _check_prompt(sample.prompt_ids, b, what)
    err = err or _check_ids(sample.output_ids, f"{what}: output_ids", b)
    if err is not None:
        return Verdict(err)
    n = len(sample.output_ids)
    mask, err = _loss_mask(sample.loss_mask, n, what)
    if err is not None:
        return Verdict(err)
    err = _check_budget(sample, n, mask, b, what)
    if err is not None:
        return Verdict(err)
    if b.max_seq_len is not None and len(sample.prompt_ids) + n > b.max_seq_len:
        return Verdict(f"{what}: prompt + output exceed the model's context {b.max_seq_len}")
    if sample.behav_logp.dtype != "float32":
        return Verdict(f"{what}: behav_logp has dtype {sample.behav_logp.dtype}, not float32")
    if sample.finish_reason not in FINISH_REASONS:
        return Verdict(
            f"{what}: finish_reason {sample.finish_reason[:40]!r} not in {FINISH_REASONS}"
        )
    if n:
        logp = _values(sample.behav_logp)
        if mask is not None:  # environment tokens: exactly 0; the model's are checked below
            logp, env = _split(logp, mask)
            if (env != 0.0).any():
                bad = float(env[env != 0.0][0])
                return Verdict(
                    f"{what}: an environment token (loss mask 0) has behav_logp {bad:g}, not 0"
                )
        if len(logp) and not _all_finite(logp):
            return Verdict(f"{what}: behav_logp holds a non-finite value")
        if len(logp):
            lo, hi = _lo_hi(logp)
            if hi > LOGP_SLACK or lo < LOGP_FLOOR:
                # + 0.0 turns -0.0 into 0.0: Python's min and numpy's may pick either of 0.0 and
                # -0.0 (they compare equal), and the reason must not depend on which path ran
                return Verdict(
                    f"{what}: behav_logp outside [{LOGP_FLOOR:g}, 0] "
                    f"(min {lo + 0.0:g}, max {hi + 0.0:g})"
                )
    versions, err = _ints(sample.versions, f"{what}: versions")
    if err is not None:
        return Verdict(err)
    assert versions is not None
    if n:
        if mask is not None:  # environment tokens: ENV_VERSION; the model's are checked below
            versions, env = _split(versions, mask)
            if (env != ENV_VERSION).any():
                bad = int(env[env != ENV_VERSION][0])
                return Verdict(
                    f"{what}: an environment token (loss mask 0) has version {bad}, "
                    f"not {ENV_VERSION}"
                )
        if len(versions):
            lo, hi = _lo_hi(versions)
            if lo < 0:
                return Verdict(f"{what}: negative policy version {lo}")
            if len(versions) > 1 and _decreases(versions):
                return Verdict(f"{what}: per-token versions decrease (weights only move forward)")
            if hi > latest_version:
                return Verdict(
                    f"{what}: generated at version {hi}, but the newest published "
                    f"version is {latest_version}",
                    stale_view=True,
                )
    if not math.isfinite(sample.tool_s):
        return Verdict(f"{what}: tool_s is not finite")
    if not all(math.isfinite(t) for t in sample.timings.values()):
        return Verdict(f"{what}: a timing is not finite")
    return None


def _loss_mask(arr: PackedArray | None, n: int, what: str) -> tuple[np.ndarray | None, str | None]:
    """The sample's loss mask as `[n]` bool (None: every token is a model token), or why not."""
    if arr is None:
        return None, None
    if arr.dtype != "uint8":
        return None, f"{what}: loss_mask has dtype {arr.dtype}, not uint8"
    if len(arr) != n:
        return None, f"{what}: loss_mask has {len(arr)} entries for {n} output tokens"
    mask = np.frombuffer(arr.data, dtype=np.uint8)
    if n and int(mask.max()) > 1:
        return None, f"{what}: loss_mask holds {int(mask.max())}, not only 0 and 1"
    return mask.astype(bool), None


def _check_budget(
    sample: Sample, n: int, mask: np.ndarray | None, b: Bounds, what: str
) -> str | None:
    """Model tokens within `max_new_tokens * max_turns`, the whole output within
    `max_episode_tokens`, tool counts consistent."""
    n_model = n if mask is None else int(np.count_nonzero(mask))
    if n_model > b.max_model_tokens:
        kind = "output" if mask is None else "model"
        if b.max_turns == 1:
            return f"{what}: {n_model} {kind} tokens, more than max_new_tokens {b.max_new_tokens}"
        return (
            f"{what}: {n_model} {kind} tokens, more than max_new_tokens * max_turns = "
            f"{b.max_model_tokens}"
        )
    if b.max_episode_tokens is not None and n > b.max_episode_tokens:
        return f"{what}: {n} output tokens, more than max_episode_tokens {b.max_episode_tokens}"
    if sample.n_tool_errors > sample.n_tool_calls:
        return f"{what}: {sample.n_tool_errors} tool errors in {sample.n_tool_calls} tool calls"
    return None


def _split(vals: list | np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(model tokens' values, environment tokens' values) of a per-token array."""
    arr = np.asarray(vals)
    return arr[mask], arr[~mask]


def check_marker(sample: Sample, b: Bounds) -> Verdict | None:
    """A rejection marker (`Sample.rejected`): only its identity can be checked."""
    what = f"rejection marker {sample.task_id[:80]}"
    err = _check_identity(sample.task_id, sample.task_seq, sample.group_size, b, what)
    return Verdict(err) if err is not None else None


def check_scored(scored: ScoredSample, b: Bounds, *, latest_version: int) -> Verdict | None:
    """A scored sample from `rewards`, before the trainer files it."""
    r = scored.reward
    lo, hi = b.reward_range
    if not math.isfinite(r):
        return Verdict(f"sample {scored.sample.sample_id[:90]}: reward {r} is not finite")
    if not lo <= r <= hi:
        return Verdict(
            f"sample {scored.sample.sample_id[:90]}: reward {r:g} outside the scorer's range "
            f"[{lo:g}, {hi:g}]"
        )
    return check_sample(scored.sample, b, latest_version=latest_version)


def _group_shape(samples: Sequence[Sample]) -> str | None:
    first = samples[0]
    what = f"group {first.task_id[:80]}"
    if any(s.rejected for s in samples):
        if len(samples) == 1:
            return None
        return f"{what}: a rejection marker travels alone, not with {len(samples) - 1} samples"
    for s in samples[1:]:
        if (s.task_id, s.task_seq, s.group_size) != (
            first.task_id,
            first.task_seq,
            first.group_size,
        ):
            return (
                f"{what}: sample {s.sample_id[:90]} (seq {s.task_seq}, group_size "
                f"{s.group_size}) is not of this task (seq {first.task_seq}, group_size "
                f"{first.group_size})"
            )
        if s.prompt_ids != first.prompt_ids:
            return f"{what}: its samples' prompts differ"
    indices = [s.sample_idx for s in samples]
    if len(set(indices)) != len(indices):
        return f"{what}: a sample index appears more than once in {sorted(indices)[:20]}"
    return None


def check_group(group: SampleGroup, b: Bounds, *, latest_version: int) -> Verdict | None:
    """A group from `trajectories`, at the reward worker: its shape, then each sample."""
    return _check_each(group.samples, group.samples, check_sample, b, latest_version)


def check_scored_group(group: ScoredGroup, b: Bounds, *, latest_version: int) -> Verdict | None:
    """A scored group from `rewards`, before the trainer files it: its shape, then each scored
    sample (reward and sample)."""
    samples = [sc.sample for sc in group.scored]
    return _check_each(samples, group.scored, check_scored, b, latest_version)


def _check_each(
    samples: Sequence[Sample], items: Sequence, check: Callable, b: Bounds, latest_version: int
) -> Verdict | None:
    """The group's shape (`samples`), then `check` on each of `items`: the first verdict."""
    err = _group_shape(samples)
    if err is not None:
        return Verdict(err)
    for item in items:
        verdict = check(item, b, latest_version=latest_version)
        if verdict is not None:
            return verdict
    return None
