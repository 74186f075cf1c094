"""`areal prepare`: what `areal run` does before its workers start, for workers started by
someone else (docker compose's one-shot `setup` service, a Kubernetes Job).

It writes, into the run's out dir (a bind mount or volume every worker shares):
- the run's keys (`security.keys_dir`, default `<out_dir>/keys`: `ensure_run_keys`);
- with `--nats-config DIR`, a nats-server config with one user per role of the run and their
  credentials files (`areal.bus.nats_config.write_server_config`), as `areal nats-config`;
- the warm-started built-in model into `cache_dir` (unless `model.path` is set), so the workers
  find it built instead of each waiting on the build lock.

Invariants:
- nothing is replaced: keys and passwords that exist are kept (a restarted stack keeps its run);
- a run that is finished in `out_dir` (summary.json and a checkpoint at `train.total_steps`) is
  refused with one line naming the fix, before anything is written: its workers would only
  report `run_already_finished` and a second `docker compose up` would look like a hang.
"""

from __future__ import annotations

import json
from pathlib import Path

from areal.config import ConfigError, RunSettings
from areal.launch import run_dir
from areal.security.keys import ensure_run_keys, keys_dir_of


def refuse_finished(settings: RunSettings) -> None:
    """`ConfigError` when `out_dir` holds a run finished at `train.total_steps`."""
    out = Path(settings.out_dir)
    if not (out / "summary.json").is_file():
        return
    try:
        step = int(json.loads((out / run_dir.CHECKPOINT_STATE).read_text())["trainer"]["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # no readable checkpoint: the trainer decides (it refuses a bad one itself)
    if step is not None and step >= settings.train.total_steps:
        raise ConfigError(
            f"config error: run {settings.run_id!r} already finished in {out} (step {step} of "
            f"train.total_steps={settings.train.total_steps}): start a new run with another "
            "run id (AREAL_RUN_ID=NAME; its out dir follows), delete that dir (and the bus state: "
            "`docker compose down -v`), or extend it with a larger AREAL_TRAIN__TOTAL_STEPS"
        )


def prepare_run(
    settings: RunSettings,
    *,
    nats_config_dir: str | None,
    listen: str,
    store_dir: str | None,
    build_model: bool = True,
) -> list[str]:
    """Prepare the run's files (see the module docstring); the lines to report."""
    from areal.bus.nats_config import write_server_config

    refuse_finished(settings)
    out = Path(settings.out_dir)
    run_dir.ensure_writable(out)
    keys_dir = keys_dir_of(settings)
    keys = ensure_run_keys(keys_dir)
    lines = [f"run {settings.run_id}: keys in {keys_dir} (verify key {keys.fingerprint})"]
    if nats_config_dir is not None:
        try:
            conf, _ = write_server_config(
                nats_config_dir, [settings.run_id], listen=listen, store_dir=store_dir
            )
        except ValueError as e:
            raise ConfigError(f"config error: --nats-config: {e}") from None
        lines.append(f"nats-server config {conf}, credentials {conf.parent}/<role>.json")
    if build_model and not settings.model.path:
        from areal.launch.worker import resolve_model_path

        lines.append(f"model {resolve_model_path(settings)}")
    return lines
