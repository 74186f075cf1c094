"""Optional TensorBoard / Weights & Biases writers for a stream of `metrics.jsonl` records.

Each writer logs the numeric fields of a step record as scalars at `step` (nested dicts such as
`staleness_hist` become `staleness_hist/<lag>`). The libraries are imported only when a writer is
made; a missing one raises `MissingExtra` naming the pip command.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol


class MissingExtra(ImportError):
    pass


class RecordWriter(Protocol):
    def log(self, rec: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """Numeric fields of a step record, nested dicts flattened with '/'; `step` excluded."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        if k == "step" or k.startswith("_"):
            continue
        if isinstance(v, (bool, int, float)):
            out[k] = float(v)
        elif isinstance(v, dict):
            for kk, vv in v.items():
                if isinstance(vv, (int, float)) and not isinstance(vv, bool):
                    out[f"{k}/{kk}"] = float(vv)
    return out


def _require(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(
            f"{extra} logging needs the '{extra}' extra: pip install 'areal-bus[{extra}]' "
            f"(or pip install {extra})"
        ) from e


class TensorBoardWriter:
    def __init__(self, logdir: str | Path) -> None:
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(log_dir=str(logdir))

    def log(self, rec: dict[str, Any]) -> None:
        step = int(rec.get("step", 0))
        for k, v in scalars(rec).items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class WandbWriter:
    def __init__(
        self, project: str, run_name: str | None = None, config: dict | None = None
    ) -> None:
        wandb = _require("wandb", "wandb")
        self.run = wandb.init(project=project, name=run_name, config=config or {})

    def log(self, rec: dict[str, Any]) -> None:
        self.run.log(scalars(rec), step=int(rec.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


def make_writers(
    *, tensorboard: str | None = None, wandb_project: str | None = None, run_name: str | None = None
) -> list[RecordWriter]:
    writers: list[RecordWriter] = []
    if tensorboard:
        writers.append(TensorBoardWriter(tensorboard))
    if wandb_project:
        writers.append(WandbWriter(wandb_project, run_name))
    return writers


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The step records of a `metrics.jsonl` (a torn last line from a live run is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
