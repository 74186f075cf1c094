"""The run directory (`--out`): what a run writes there, and what the launcher may do to it.

Invariants:
- nothing in `--out` is deleted implicitly: a new run needs an empty (or missing) directory;
  `--overwrite` deletes only the artifacts a run writes (`RUN_ARTIFACTS`, plus the default
  weights dir), never other files;
- every decision here raises `ConfigError` (one line naming the fix) *before* anything is
  deleted or started, and the launcher calls it only after the whole config is checked;
- a run is finished when `summary.json` exists and its checkpoint is at `total_steps` or past
  it: `--resume` of such a run has nothing to do (a larger `train.total_steps` extends it).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from areal.config import ConfigError

# what `areal run` and its workers write into --out (config.json first, so a run dir is known
# by it); `weights` only when weights.dir is unset (then it lies inside --out)
RUN_ARTIFACTS = (
    "config.json",
    "metrics.jsonl",
    "metrics.jsonl.tmp",
    "eval.jsonl",  # the held-out rounds: a rerun over --overwrite must not skip the old rounds
    "summary.json",
    "summary.json.tmp",
    "checkpoint",
    "final",
    "nats",
    "logs",
    "keys",  # the default security.keys_dir: a new run gets new keys
    "tb",  # experiment trackers (`tracking`): TensorBoard, W&B, MLflow's default file store
    "wandb",
    "mlruns",
)
CHECKPOINT_STATE = Path("checkpoint") / "trainer_state.json"


@dataclass(frozen=True)
class ResumePoint:
    """Where a run in `--out` stands: the checkpoint's step (None before the first checkpoint)
    and `summary.json` when a previous incarnation finished."""

    step: int | None
    summary: Path | None
    wall_s: float = 0.0  # the trainer's wall time at the checkpoint (s, cumulative)

    def finished_at(self, total_steps: int) -> bool:
        """True when resuming with `total_steps` has nothing left to train."""
        return self.summary is not None and self.step is not None and self.step >= total_steps


def artifacts(out: Path, *, weights_in_out: bool) -> list[Path]:
    """The run artifacts present in `out` (deletable by `--overwrite`), in a stable order."""
    names = RUN_ARTIFACTS + (("weights",) if weights_in_out else ())
    return [out / n for n in names if (out / n).exists() or (out / n).is_symlink()]


def _describe(out: Path, limit: int = 6) -> str:
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
    more = f", ... ({len(entries)} entries)" if len(entries) > limit else ""
    return ", ".join(entries[:limit]) + more


def prepare_new(out: Path, *, overwrite: bool, weights_in_out: bool) -> list[Path]:
    """Make `out` ready for a new run; returns what `--overwrite` deleted.

    Without `overwrite` a non-empty `out` is refused (nothing is touched); with it only the run
    artifacts go, and unrelated files stay."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory: choose another --out")
    if not out.is_dir() or not any(out.iterdir()):
        return []
    if not overwrite:
        raise ConfigError(
            f"--out {out} is not empty ({_describe(out)}): pass --resume to continue the run "
            "there, --overwrite to delete its run artifacts, or choose another --out"
        )
    gone = artifacts(out, weights_in_out=weights_in_out)
    for p in gone:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    return gone


def ensure_writable(out: Path) -> None:
    """Create `out` (and its parents) and prove a file can be written there, or raise one
    `ConfigError` line naming the cause: a parent that is a file, a read-only or immutable
    directory, a pseudo filesystem such as /proc, a full disk. Runs after every other check."""
    probe = out / f".areal-write-probe-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(probe) else ""
        raise ConfigError(
            f"--out {out} cannot be written: {reason}{where}; choose a directory you can write "
            "(e.g. --out runs/<name>)"
        ) from None


def resume_point(out: Path) -> ResumePoint:
    """The state of the run in `out` for `--resume`; refuses a directory that holds no run."""
    if not (out / "config.json").is_file():
        raise ConfigError(
            f"--resume: {out} holds no run (no config.json): check --out, or drop --resume "
            "to start a new run"
        )
    step, wall_s = None, 0.0
    state = out / CHECKPOINT_STATE
    if state.is_file():
        try:
            trainer = json.loads(state.read_text())["trainer"]
            step, wall_s = int(trainer["step"]), float(trainer.get("wall_s", 0.0))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(
                f"--resume: {state} is unreadable ({e}): restore it, or start a new run with "
                "--overwrite"
            ) from None
    summary = out / "summary.json"
    return ResumePoint(step=step, summary=summary if summary.is_file() else None, wall_s=wall_s)
