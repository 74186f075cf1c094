"""The trackers: TensorBoard, Weights & Biases and MLflow behind one small `Backend` interface.

Each imports its library in `open()` (on the tracker's own thread: the trainer never pays for
the import) and may raise anywhere; `areal.tracking.tracker` turns a raise into one warning and
switches the tracker off. `fix()` names what the user can do about an error.

Where the files go (`<out>` is the run's `out_dir`): TensorBoard event files in `<out>/tb`; W&B
run dirs in `<out>/wandb/` (offline runs are `offline-run-*`, for `wandb sync`); MLflow a file
store in `<out>/mlruns` unless `tracking.mlflow_uri` names another store or a server.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import re
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from areal.tracking.tracker import Record

INSTALL = "pip install 'areal-bus[tracking]'"
WANDB_INIT_TIMEOUT_S = 30.0  # a W&B server that answers the connect but not the run's start
REACH_TIMEOUT_S = 5.0


def reachable(url: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Raise `ConnectionError` naming `url` when nothing accepts a TCP connection at its host
    and port within `timeout_s`. Skipped behind a proxy (the library goes through it, not us)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
        return
    u = urlparse(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname or "localhost", port), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"{url} is not reachable: {e}") from None


def _unreachable(e: BaseException) -> bool:
    return isinstance(e, ConnectionError | TimeoutError) or "connect" in str(e).lower()


def config_text(config: dict[str, Any]) -> str:
    """The run's config as a Markdown code block (TensorBoard's text tab renders Markdown)."""
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
    return "\n".join("    " + ln for ln in body.splitlines())


class TensorBoardBackend:
    name = "tensorboard"

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir

    def open(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter  # ImportError without tensorboard

        self.writer = SummaryWriter(log_dir=str(self.logdir))
        self.writer.add_text("config", config_text(config), 0)
        self.writer.flush()

    def log(self, rec: Record) -> None:
        for k, v in rec.values.items():
            self.writer.add_scalar(k, v, rec.step)
        self.writer.flush()  # readable while the run goes on

    def close(self) -> None:
        self.writer.close()

    def fix(self, error: BaseException) -> str:
        if isinstance(error, ImportError):
            return f"{INSTALL} (or pip install tensorboard)"
        return f"check that {self.logdir} is writable"


def wandb_mode(mode: str, env: dict[str, str], base_url: str) -> str:
    """`tracking.wandb_mode` resolved: `auto` is WANDB_MODE when set, else online with an API
    key (WANDB_API_KEY, or a `wandb login` entry in ~/.netrc for the server), else offline."""
    if mode != "auto":
        return mode
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    if env.get("WANDB_API_KEY"):
        return "online"
    try:
        host = urlparse(base_url).hostname or ""
        found = netrc.netrc(env.get("NETRC") or None).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        found = None
    return "online" if found else "offline"


class WandbBackend:
    name = "wandb"

    def __init__(self, *, out_dir: Path, project: str, run_name: str, tags: list[str], mode: str):
        self.out_dir, self.project, self.run_name, self.tags = out_dir, project, run_name, tags
        self.mode = mode
        self.base_url = ""

    def open(self, config: dict[str, Any]) -> None:
        import wandb

        default_url = str(wandb.Settings.model_fields["base_url"].default)
        self.base_url = os.environ.get("WANDB_BASE_URL") or default_url
        mode = wandb_mode(self.mode, dict(os.environ), self.base_url)
        if mode == "online":
            reachable(self.base_url)
        settings = wandb.Settings(
            console="off",  # the worker's own stdout and stderr stay its own
            silent=True,
            x_disable_stats=True,  # no system-metrics sampler taking CPU from training
            save_code=False,
            disable_git=True,
            init_timeout=WANDB_INIT_TIMEOUT_S,
        )
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.project,
            name=self.run_name,
            tags=self.tags or None,
            config=config,
            dir=str(self.out_dir),  # -> <out>/wandb/
            mode=mode,
            settings=settings,
        )
        # eval rounds arrive out of step order: each kind on its own x axis
        for axis in ("train/step", "eval/version"):
            self.run.define_metric(axis)
            self.run.define_metric(axis.split("/")[0] + "/*", step_metric=axis)

    def log(self, rec: Record) -> None:
        self.run.log({rec.axis: rec.step, **rec.values})

    def close(self) -> None:
        self.run.finish()

    def fix(self, error: BaseException) -> str:
        if isinstance(error, ImportError):
            return f"{INSTALL} (or pip install wandb)"
        if _unreachable(error):
            return (
                f"check the network and WANDB_BASE_URL ({self.base_url}), or set "
                "tracking.wandb_mode=offline and `wandb sync` the run dir later"
            )
        return "check the W&B settings (WANDB_API_KEY, WANDB_ENTITY, tracking.project)"


def params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config flattened (`algo.batch_size`) into MLflow params: keys in MLflow's alphabet,
    values as text of at most 500 characters (what any MLflow server takes)."""
    out: dict[str, str] = {}
    for k, v in config.items():
        key = re.sub(r"[^\w\-. /]", "_", f"{prefix}{k}")[:250]
        if isinstance(v, dict) and v:
            out.update(params(v, f"{key}."))
        else:
            text = v if isinstance(v, str) else json.dumps(v)
            out[key] = text[:500]
    return out


def is_file_store(uri: str) -> bool:
    return urlparse(uri).scheme in ("", "file")


class MlflowBackend:
    name = "mlflow"

    def __init__(self, *, uri: str, project: str, run_name: str, tags: list[str]) -> None:
        self.uri, self.project, self.run_name, self.tags = uri, project, run_name, tags

    def open(self, config: dict[str, Any]) -> None:
        if is_file_store(self.uri):
            # MLflow 3 refuses a file store unless told: it is the local default here
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        elif urlparse(self.uri).scheme in ("http", "https"):
            reachable(self.uri)  # else MLflow retries a dead server for minutes
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = c = MlflowClient(tracking_uri=self.uri)
        exp = c.get_experiment_by_name(self.project)
        exp_id = exp.experiment_id if exp is not None else c.create_experiment(self.project)
        tags = {t: "true" for t in self.tags}
        tags["areal.run_id"] = str(config.get("run_id", ""))
        self.run_id = c.create_run(exp_id, run_name=self.run_name, tags=tags).info.run_id
        ps = [Param(k, v) for k, v in params(config).items()]
        for i in range(0, len(ps), 100):  # MLflow takes 100 params per batch
            c.log_batch(self.run_id, params=ps[i : i + 100])

    def log(self, rec: Record) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(k, v, ts, rec.step) for k, v in rec.values.items() if math.isfinite(v)]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)

    def fix(self, error: BaseException) -> str:
        if isinstance(error, ImportError):
            return f"{INSTALL} (or pip install mlflow-skinny)"
        return (
            f"check tracking.mlflow_uri ({self.uri}): start its server or fix the URI "
            "(unset: a file store in <out_dir>/mlruns)"
        )
