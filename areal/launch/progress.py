"""The launcher's progress bar, fed by the trainer's per-step metric records.

On a terminal: a rich progress bar with step, policy version, mean reward, staleness and
throughput. Elsewhere (CI, pipes): one plain line per step.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def describe(rec: dict[str, Any], t_first: float | None = None) -> str:
    wall = rec.get("wall_s", 0.0) or 1e-9
    return (
        f"v{rec.get('version', 0)} reward {rec.get('reward_mean', 0.0):.3f} "
        f"stale≤{rec.get('staleness_max', 0)} dropped {rec.get('dropped_stale', 0)} "
        f"{rec.get('samples_total', 0) / wall:.1f} samples/s "
        f"loss {rec.get('loss', 0.0):+.4f}"
    )


class StepProgress:
    def __init__(self, total_steps: int, quiet: bool = False) -> None:
        self.total = total_steps
        self.quiet = quiet
        self.tty = sys.stdout.isatty()
        self.samples_total = 0
        self.t0 = time.time()
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
        self.samples_total += int(rec.get("samples", 0))
        rec = {**rec, "samples_total": self.samples_total}
        text = describe(rec)
        if self._progress is not None:
            self._progress.update(self._task, completed=rec.get("step", 0), description=text)
        elif not self.quiet:
            print(f"step {rec.get('step', 0)}/{self.total} {text}", flush=True)
