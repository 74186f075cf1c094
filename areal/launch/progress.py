"""The launcher's progress bar, fed by the trainer's per-step metric records.

On a terminal: a rich progress bar with step, policy version, mean reward, staleness and
throughput. Elsewhere (CI, pipes): one plain line per step.

Invariant: samples/s is this launch's samples over this launch's trainer wall time
(`samples_per_s`): after `--resume` both count from the checkpoint the trainer resumed from,
never this launch's samples over the run's cumulative wall time.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@dataclass(frozen=True)
class Start:
    """Where the trainer stood when this launch began: the step and the trainer wall time
    (`wall_s`, cumulative over the run) of the checkpoint it resumes from; zero for a new run."""

    step: int = 0
    wall_s: float = 0.0


def samples_per_s(samples: Mapping[int, int], wall_s: float, start: Start) -> float:
    """The samples of the steps after `start.step` (`samples`: step -> samples trained in it;
    a step redone after a trainer restart counts once) over the trainer wall time since
    `start` (`wall_s`: the latest record's, cumulative). 0.0 before any time has passed."""
    n = sum(k for step, k in samples.items() if step > start.step)
    elapsed_s = wall_s - start.wall_s
    return n / elapsed_s if elapsed_s > 0 else 0.0


def describe(rec: dict[str, Any], rate: float) -> str:
    """One step record as the progress line's text; `rate` in samples/s (`samples_per_s`)."""
    return (
        f"v{rec.get('version', 0)} reward {rec.get('reward_mean', 0.0):.3f} "
        f"stale≤{rec.get('staleness_max', 0)} dropped {rec.get('dropped_stale', 0)} "
        f"{rate:.1f} samples/s "
        f"loss {rec.get('loss', 0.0):+.4f}"
    )


class StepProgress:
    def __init__(self, total_steps: int, quiet: bool = False, start: Start | None = None) -> None:
        self.total = total_steps
        self.quiet = quiet
        self.tty = sys.stdout.isatty()
        self.start = start or Start()
        self.samples: dict[int, int] = {}  # step -> samples trained in it (this launch)
        self._progress: Progress | None = None
        self._task = None

    def __enter__(self) -> StepProgress:
        if self.tty and not self.quiet:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("waiting for the first step…", total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def update(self, rec: dict[str, Any]) -> None:
        step = int(rec.get("step", 0))
        self.samples[step] = int(rec.get("samples", 0))
        text = describe(rec, samples_per_s(self.samples, float(rec.get("wall_s", 0.0)), self.start))
        if self._progress is not None:
            self._progress.update(self._task, completed=rec.get("step", 0), description=text)
        elif not self.quiet:
            print(f"step {rec.get('step', 0)}/{self.total} {text}", flush=True)
