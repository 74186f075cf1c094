"""Experiment trackers (TensorBoard, Weights & Biases, MLflow) fed by the trainer: every step
record of `metrics.jsonl`, every eval round of `eval.jsonl`, and the run's config once at start.

`tracker_for(settings.tracking, ...)` builds the trainer's `Tracker` (`tracker.py`: queues,
threads, failure isolation) over the configured backends (`backends.py`: the adapters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal.config import TrackingSettings
from areal.tracking.backends import MlflowBackend, TensorBoardBackend, WandbBackend
from areal.tracking.tracker import Backend, Record, Tracker, TrackerStats

__all__ = ["Backend", "Record", "Tracker", "TrackerStats", "make_backends", "tracker_for"]


def run_name_of(settings: TrackingSettings, out_dir: Path) -> str:
    return settings.run_name or Path(out_dir).resolve().name


def make_backends(settings: TrackingSettings, out_dir: Path) -> list[Backend]:
    out = Path(out_dir)
    name = run_name_of(settings, out)
    made: dict[str, Backend] = {
        "tensorboard": TensorBoardBackend(out / "tb"),
        "wandb": WandbBackend(
            out_dir=out,
            project=settings.project,
            run_name=name,
            tags=list(settings.tags),
            mode=settings.wandb_mode,
        ),
        "mlflow": MlflowBackend(
            uri=settings.mlflow_uri or (out / "mlruns").resolve().as_uri(),
            project=settings.project,
            run_name=name,
            tags=list(settings.tags),
        ),
    }
    return [made[b] for b in settings.backends]


def tracker_for(
    settings: TrackingSettings, *, out_dir: Path, config: dict[str, Any]
) -> Tracker | None:
    """The run's tracker, or None when `tracking.backends` is empty."""
    if not settings.backends:
        return None
    return Tracker(
        make_backends(settings, out_dir),
        config=config,
        queue_size=settings.queue_size,
        close_timeout_s=settings.close_timeout_s,
    )
