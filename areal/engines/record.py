"""The batches a trainer trained on, recorded (`train.record_batches`) and replayed.

`BatchRecorder` wraps a `TrainEngine`: before each `train_step` it writes the step's batch to
`<dir>/step-<N>.pt` (N = the version the step produces), then passes the call on. `replay` runs
recorded steps through another engine and returns its step stats, so a run's engine can be
checked against a reference on exactly the batches the pipeline formed (e.g. 2 FSDP ranks
against the 1-process torch engine), and a run that went wrong can be re-run offline.

Invariants:
- a file holds the batch exactly as `train_step` received it (the TrainSeqs before the engine
  fills `prox_logp`), written atomically, named by the version the step produces (a step
  record's `version` in metrics.jsonl). A step redone after a restart overwrites its file, or,
  when the restored trainer rolled its version forward past weights already announced, gets a
  new one and leaves the old file stale: replay the versions metrics.jsonl lists;
- the recorder changes nothing else: every other attribute and call is the wrapped engine's.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from areal.engines.base import TrainEngine, TrainSeq

__all__ = ["BatchRecorder", "load_step", "replay", "step_file", "step_files"]


class BatchRecorder:
    """A `TrainEngine` that records each `train_step`'s batch into `dir`."""

    def __init__(self, engine: TrainEngine, dir: str | Path) -> None:
        self.__dict__["_engine"] = engine
        self.__dict__["_dir"] = Path(dir)
        self._dir.mkdir(parents=True, exist_ok=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._engine, name, value)

    def train_step(self, seqs: list[TrainSeq], max_tokens_per_mb: int) -> dict[str, float]:
        version = self._engine.version + 1
        path = step_file(self._dir, version)
        tmp = path.with_suffix(".tmp")
        record = {
            "version": version,
            "max_tokens_per_mb": max_tokens_per_mb,
            "seqs": [asdict(s) for s in seqs],
        }
        torch.save(record, tmp)
        os.replace(tmp, path)
        return self._engine.train_step(seqs, max_tokens_per_mb)


def step_files(dir: str | Path) -> list[Path]:
    """The recorded steps in `dir`, in step order."""
    return sorted(Path(dir).glob("step-*.pt"))


def load_step(path: str | Path) -> tuple[list[TrainSeq], int]:
    """One recorded step: its batch and the micro-batch token budget it was trained with."""
    record = torch.load(path, weights_only=True)
    return [TrainSeq(**s) for s in record["seqs"]], int(record["max_tokens_per_mb"])


def step_file(dir: str | Path, version: int) -> Path:
    """The record of the step that produced `version`."""
    return Path(dir) / f"step-{version:06d}.pt"


def replay(
    engine: TrainEngine, dir: str | Path, versions: list[int] | None = None
) -> list[dict[str, float]]:
    """Train `engine` on the recorded steps of `dir` that produced `versions` (a run's
    metrics.jsonl `version`s; None: every file, in order); the step stats of each."""
    paths = step_files(dir) if versions is None else [step_file(dir, v) for v in versions]
    out = []
    for path in paths:
        seqs, max_tokens = load_step(path)
        out.append(engine.train_step(seqs, max_tokens))
    return out
