"""Read back what the experiment trackers wrote, with each tracker's own reader where it has one:
TensorBoard's `EventAccumulator`, MLflow's client on the file store, and for an offline W&B run
its `.wandb` file (a LevelDB-style log of W&B's protobuf records; wandb >= 0.19 has no Python
reader of its own)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any


def tb_scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def tb_tags(logdir: Path) -> dict[str, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return acc.Tags()


def wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """The rows `run.log` wrote to an offline run's `run-<id>.wandb`, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos = run_file.read_bytes(), 32768, 7  # 7: ":W&B", magic, version
    assert data[:4] == b":W&B", run_file
    payloads, part = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # a block's padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            payloads.append(part + chunk)
            part = b""
        else:  # the first or a middle piece
            part += chunk
    rows = []
    for p in payloads:
        rec = pb.Record()
        rec.ParseFromString(p)
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {
                    "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                    for i in rec.history.item
                }
            )
    return rows


def mlflow_runs(mlruns: Path, experiment: str = "areal-bus") -> list[Any]:
    """The MLflow runs of `experiment` in the file store `mlruns` (a client of its own)."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: a file store, knowingly
    client = MlflowClient(tracking_uri=mlruns.resolve().as_uri())
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


def mlflow_metric(mlruns: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlruns.resolve().as_uri())
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
