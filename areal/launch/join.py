"""Workers on other hosts: what `areal run` shares on the bus, and how `--join` uses it.

The launcher's `config.json` names paths of its own host (the model in its cache, the data
file, the cache dir), so it cannot run a worker elsewhere. Instead the launcher shares
(`share_run`) a portable config (the resolved settings with `reward.fn` resolved and no host
paths: `model.path`, `cache_dir`, `nats.url` and `security.keys_dir` cleared), the model dir
and the data files (`areal.data.sources.source_files`: a JSONL / Parquet file, the files of an
`hf:` dataset folder, glob or cached hub dataset), in the run's object store. `areal worker ROLE --join RUN_ID --nats-url URL`
(`join_config`) fetches them into its own cache dir and runs from a config whose paths point
into that copy.

Invariants:
- the files are shared before any worker starts, so a worker that joins while the run goes on
  finds them; the model and each data source's files are shared while their running total is at
  most `nats.share_max_bytes` (model first, a source's files all or none), the config always;
- nothing outside the model dir or a data source's folder is shared: a link that leads out (to
  the run's keys, say), a special file, or a file in the run's keys or credentials folders fails
  the share (and `areal run`'s preflight, before anything starts) naming the path
  (`run_folder_files`, `areal.data.contained`);
- the run's keys never travel on the bus (anyone on it could read the ids secret, or swap the
  verify key for their own): a worker on another host is given a copy of the keys dir without
  the signing key (`--set security.keys_dir=DIR`, as the launcher's join hint says), and one
  without it fails at start naming that setting (`areal.security.keys`);
- nor do the NATS credentials (`HOST_NATS_FILES` are cleared): a worker on another host is given
  a copy of its role's file (`<out>/keys/nats/<role>.json`, or one `areal nats-config` made) and
  passes it with `--credentials FILE`, which also fetches the shared files;
- a joining worker runs on exactly the launcher's resolved settings except the host paths and
  its own `--set` overrides, which win (e.g. `--set model.path=<local copy>` for a model the run
  did not share); a model or data file the run did not share and no override supplies is a
  `JoinError` naming the `--set` to add, before anything starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path
from typing import Any

import structlog
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from areal.config import (
    ConfigError,
    NatsSettings,
    RunSettings,
    WeightsSettings,
    parse_overrides,
)
from schemas.run_files import CONFIG_NAME, DATA_PREFIX, MODEL_PREFIX, RunFilesManifest

log = structlog.get_logger()
DATA_FIELDS = ("source", "eval_source")  # data settings that may name a local file
# nats settings naming files of the launcher's host (credentials, TLS): never shared
HOST_NATS_FILES = (
    "credentials_file",
    "credentials_dir",
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
)

JOINED_SUBDIR = "joined"  # under the model cache dir: one dir per (run, shared files)
WORKER_CONFIG_NAME = "worker-config.json"  # the joined config, paths pointing into the copy


class JoinError(ValueError):
    """A worker cannot join the run as asked; the message names the fix."""


def run_folder_files(settings: RunSettings) -> tuple[list[Path], dict[str, dict[str, Path]]]:
    """The model dir's files and each data source's (`DATA_FIELDS`), every one inside its own
    folder and none of the run's secrets (`areal.data.contained`: a link that leads out raises
    `EscapingPath` naming it). What `shared_files` shares and the preflight checks at start."""
    from areal.data.contained import contained_files
    from areal.data.sources import source_files
    from areal.security.keys import secret_paths

    secrets = secret_paths(settings)
    model = settings.model.path
    model_files = [] if model is None else contained_files(model, forbidden=secrets)
    data: dict[str, dict[str, Path]] = {}
    for name in DATA_FIELDS:
        spec = getattr(settings.data, name)
        data[name] = {} if spec is None else source_files(spec, forbidden=secrets)
    return model_files, data


def portable_config(settings: RunSettings) -> dict[str, Any]:
    """The resolved settings without this host's paths (see the module docstring)."""
    cfg = settings.model_dump(mode="json")
    cfg["reward"]["fn"] = settings.reward_fn_name()
    cfg["model"]["path"] = None
    cfg["nats"]["url"] = None
    cfg["security"]["keys_dir"] = None  # the keys never travel on the bus (module docstring)
    for key in HOST_NATS_FILES:  # credentials never travel on the bus either
        cfg["nats"][key] = None
    cfg.pop("cache_dir", None)
    return cfg


def shared_files(settings: RunSettings) -> dict[str, bytes | Path]:
    """Object name -> content for `publish_run_files`: the config, and the model dir and the
    data file while the running total stays within `nats.share_max_bytes`."""
    if settings.model.path is None:
        raise ValueError("resolve model.path before sharing the run (resolve_model_path)")
    files: dict[str, bytes | Path] = {
        CONFIG_NAME: json.dumps(portable_config(settings), indent=1).encode()
    }
    budget = settings.nats.share_max_bytes
    model_dir = Path(settings.model.path)
    model_files, data_files = run_folder_files(settings)
    model_bytes = sum(p.stat().st_size for p in model_files)
    if model_bytes <= budget:
        budget -= model_bytes
        files.update(
            {f"{MODEL_PREFIX}{p.relative_to(model_dir).as_posix()}": p for p in model_files}
        )
    else:
        log.warning("model_not_shared", bytes=model_bytes, share_max_bytes=budget)
    for name in DATA_FIELDS:
        spec = getattr(settings.data, name)
        data = data_files[name]
        size = sum(p.stat().st_size for p in data.values())
        if not data:
            continue
        if size <= budget:
            budget -= size
            files.update({f"{DATA_PREFIX}{name}/{rel}": p for rel, p in data.items()})
        else:
            log.warning("data_not_shared", setting=f"data.{name}", path=spec, bytes=size)
    return files


def share_run(settings: RunSettings, public_url: str | None) -> str | None:
    """Share the run's files on `settings.nats.url`; the command a worker on another host runs
    (None when `public_url`, the server's address for other hosts, is None: loopback only)."""
    from areal.bus.auth import credentials_for
    from areal.bus.run_files import publish_run_files

    assert settings.nats.url is not None
    asyncio.run(
        publish_run_files(
            settings.nats.url,
            settings.run_id,
            shared_files(settings),
            credentials=credentials_for(settings.nats, "launcher"),
            replicas=settings.nats.replicas,
        )
    )
    if public_url is None:
        return None
    from areal.security.keys import IDS_SECRET_FILE, VERIFY_KEY_FILE, keys_dir_of

    keys = keys_dir_of(settings)
    return (
        f"workers on other hosts join with: areal worker rollout --join {settings.run_id} "
        f"--nats-url {public_url} --set security.keys_dir=DIR{_credentials_hint(settings)}"
        f"   (or reward), after copying the run's public keys there: {keys / VERIFY_KEY_FILE} "
        f"and {keys / IDS_SECRET_FILE} into DIR (mode 0700; never the signing key)"
    )


def _credentials_hint(settings: RunSettings) -> str:
    """` --credentials FILE` (the role's NATS credentials to copy) when the run has them."""
    d = settings.nats.credentials_dir
    return "" if d is None else f" --credentials <a copy of {Path(d) / 'rollout.json'}, 0600>"


def public_url_of(url: str) -> str | None:
    """`url` when it names a host other hosts can reach, None for a loopback address; of
    several servers (comma-separated, a cluster), those others can reach, None if none."""
    from areal.bus.connection import server_urls

    public = [u for u in server_urls(url) if not _loopback(u)]
    return ",".join(public) or None


def _loopback(url: str) -> bool:
    host = url.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


class _CacheDirSetting(BaseSettings):
    """`cache_dir` before the run's config is known (env `AREAL_CACHE_DIR`, as in RunSettings)."""

    model_config = SettingsConfigDict(env_prefix="AREAL_", extra="ignore")

    cache_dir: str | None = Field(
        None, description=RunSettings.model_fields["cache_dir"].description
    )


def _cache_dir(overrides: list[str]) -> str | None:
    given = parse_overrides(overrides)
    if "cache_dir" in given:
        return given["cache_dir"]
    return _CacheDirSetting().cache_dir


class _NatsSetting(BaseSettings):
    """`nats` before the run's config is known (env `AREAL_NATS__...`, as in RunSettings)."""

    model_config = SettingsConfigDict(
        env_prefix="AREAL_", env_nested_delimiter="__", extra="ignore"
    )

    nats: NatsSettings = Field(default_factory=NatsSettings, description="NATS connection")


def _nats_settings(overrides: list[str]) -> NatsSettings:
    """The `--set nats.*` overrides over the environment's: the credentials and TLS files a
    joining worker fetches the run's files with."""
    given = parse_overrides(overrides).get("nats")
    try:
        return _NatsSetting(**({"nats": given} if isinstance(given, dict) else {})).nats
    except ValueError as e:
        raise ConfigError(f"config error: nats: {e}") from None


def _overridden(overrides: dict[str, Any], section: str, key: str) -> bool:
    part = overrides.get(section)
    return isinstance(part, dict) and part.get(key) is not None


def joined_config(manifest: RunFilesManifest, files_dir: Path, overrides: list[str]) -> Path:
    """Write (atomically) and return the config of a worker that joins from `files_dir`."""
    cfg = json.loads((files_dir / CONFIG_NAME).read_text())
    given = parse_overrides(overrides)
    if manifest.under(MODEL_PREFIX):
        cfg["model"]["path"] = str((files_dir / MODEL_PREFIX).resolve())
    elif not _overridden(given, "model", "path"):
        raise JoinError(
            f"run {manifest.run_id!r} did not share its model (larger than the launcher's "
            "nats.share_max_bytes): pass --set model.path=<a local copy of the run's model dir>"
        )
    from areal.data.sources import reads_files, with_copy

    for name in DATA_FIELDS:
        spec = cfg["data"].get(name)
        if spec is None or not reads_files(str(spec)):
            continue
        if manifest.under(f"{DATA_PREFIX}{name}/"):
            cfg["data"][name] = with_copy(str(spec), (files_dir / f"{DATA_PREFIX}{name}").resolve())
        elif not _overridden(given, "data", name):
            raise JoinError(
                f"run {manifest.run_id!r} did not share its data.{name} {spec!r} "
                "(larger than the launcher's nats.share_max_bytes): pass --set "
                f"data.{name}=<a local copy>"
            )
    _check_weights_dir(manifest.run_id, cfg, given)
    path = files_dir / WORKER_CONFIG_NAME
    tmp = files_dir / f".{WORKER_CONFIG_NAME}.{os.getpid()}-{uuid.uuid4().hex[:6]}"
    tmp.write_text(json.dumps(cfg, indent=1))
    os.replace(tmp, path)  # same content from every replica: the last rename is as good
    return path


def _check_weights_dir(run_id: str, cfg: dict, given: dict) -> None:
    """A run whose weights travel as files (`weights.transport: file`, which `areal run` picks
    for a NATS server no other host can reach) is joinable only where its weights dir is."""
    here = (given.get("weights") or {}).get("dir")  # where this host mounts the dir
    weights = WeightsSettings(**{**(cfg.get("weights") or {}), **({"dir": here} if here else {})})
    weights_dir = weights.file_dir(str(cfg.get("out_dir")))
    if weights_dir is None:  # the object store (or an unsettled auto, which reads as one)
        return
    if not Path(weights_dir).is_dir():
        raise JoinError(
            f"run {run_id!r} sends its weights as files under {weights_dir} "
            "(weights.transport=file) and this host does not see that dir: mount it at the "
            "same path (or --set weights.dir=<where it is mounted here>), or start the run "
            "with --set weights.transport=object_store"
        )


def join_config(run_id: str, nats_url: str, overrides: list[str], role: str = "rollout") -> Path:
    """Fetch run `run_id`'s shared files from `nats_url` into this host's cache dir (connecting
    with `role`'s credentials: `--credentials FILE`, `--set nats.credentials_file=...` or
    `AREAL_NATS__CREDENTIALS_FILE`); the path of the config this worker runs with. Raises
    `JoinError` (or `ConfigError` for a malformed `--set`) naming the fix."""
    from areal.bus.auth import credentials_for
    from areal.bus.run_files import RunFilesCorrupt, RunFilesMissing, fetch_run_files
    from areal.data.warm_start import cache_root

    try:
        dest_root = cache_root(_cache_dir(overrides)) / JOINED_SUBDIR
        credentials = credentials_for(_nats_settings(overrides), role)
        manifest, files_dir = asyncio.run(
            fetch_run_files(nats_url, run_id, dest_root, credentials=credentials)
        )
    except (RunFilesMissing, RunFilesCorrupt, ConnectionError) as e:
        raise JoinError(f"cannot join run {run_id!r}: {e}") from None
    return joined_config(manifest, files_dir, overrides)
