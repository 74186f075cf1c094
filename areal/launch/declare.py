"""Declaring a run's streams, stage consumers and buckets as the launcher, before any worker.

With per-role accounts (`areal.bus.nats_config`) no worker may create or change a stream or a
consumer: those grants would let one role deliver records onto another's subjects or delete
what another stage has queued. The launcher's account declares the run instead: `areal run`
does it before it starts a worker, and `areal declare` does it where no launcher runs
(compose's `declare` service, Kubernetes, workers started by hand). Declaring is idempotent: a
resumed run brings its streams to the current settings, nothing is deleted.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from areal.config import RunSettings

log = structlog.get_logger()

PROBE_S = 5.0  # the most `areal run` waits for a nats.url to answer before it gives up


async def declare_as_launcher(
    settings: RunSettings,
    *,
    first_connect_s: float | None = None,
    started: dict[str, Any] | None = None,
) -> None:
    """Connect with the launcher's credentials (`nats.credentials_dir`/launcher.json, or
    `nats.credentials_file`, or none) and declare the run (`Bus.declare`). Raises
    `RunConflictError` / `StorageLimitError` / `AuthenticationFailed` / `PermissionDenied`
    naming the fix, and `ConnectionError` naming the URL when the server does not answer
    within `first_connect_s` (None: `nats.outage_tolerance_s`).

    With `started` (its detail), then publish the `run_started` event: observers (`areal tap`,
    `top`) take a `run_finished` stored before it for an earlier launch's, not this one's end
    (`--resume` extending a finished run). Best effort: a server whose accounts predate the
    event refuses it, and that is logged, not fatal."""
    from areal.bus.client import Bus
    from areal.bus.errors import PermissionDenied

    assert settings.nats.url is not None
    bus = await Bus.connect(
        settings.nats.url,
        settings.run_id,
        "launcher",
        "launcher",
        settings.nats,
        declare=True,
        first_connect_s=first_connect_s or settings.nats.outage_tolerance_s,
    )
    try:
        if started is not None:
            try:
                await bus.event("run_started", **started)
            except PermissionDenied as e:
                log.warning(
                    "run_started_not_published",
                    error=str(e),
                    hint="regenerate the server's accounts (`areal nats-config`)",
                )
    finally:
        await bus.close()


def declare_run_now(
    settings: RunSettings,
    *,
    first_connect_s: float | None = None,
    started: dict[str, Any] | None = None,
) -> None:
    asyncio.run(declare_as_launcher(settings, first_connect_s=first_connect_s, started=started))


async def _probe(settings: RunSettings, wait_s: float) -> None:
    from areal.bus.auth import credentials_for
    from areal.bus.connection import Patience, connect

    assert settings.nats.url is not None
    nc = await connect(
        settings.nats.url,
        f"areal-{settings.run_id}-launcher-probe",
        patience=Patience(first_connect_s=wait_s),
        hint="start that server (with JetStream: `nats-server -js`), fix --nats-url / "
        "nats.url, or omit it so that `areal run` starts its own",
        credentials=credentials_for(settings.nats, "launcher"),
        quiet_until_connected=True,
    )
    await nc.close()


def probe_server(settings: RunSettings) -> None:
    """Connect to `nats.url` once as the launcher and close: raises `ConnectionError` (one
    line naming the URL and the fix) when it does not answer within `PROBE_S` (at most
    `nats.outage_tolerance_s`), `AuthenticationFailed` when it refuses the credentials. A
    launch on a server that is not there then fails in seconds, before `--out` is touched."""
    asyncio.run(_probe(settings, min(PROBE_S, settings.nats.outage_tolerance_s)))
