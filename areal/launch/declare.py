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

from areal.config import RunSettings


async def declare_as_launcher(settings: RunSettings) -> None:
    """Connect with the launcher's credentials (`nats.credentials_dir`/launcher.json, or
    `nats.credentials_file`, or none) and declare the run (`Bus.declare`). Raises
    `RunConflictError` / `StorageLimitError` / `AuthenticationFailed` / `PermissionDenied`
    naming the fix."""
    from areal.bus.client import Bus

    assert settings.nats.url is not None
    bus = await Bus.connect(
        settings.nats.url, settings.run_id, "launcher", "launcher", settings.nats, declare=True
    )
    await bus.close()


def declare_run_now(settings: RunSettings) -> None:
    asyncio.run(declare_as_launcher(settings))
