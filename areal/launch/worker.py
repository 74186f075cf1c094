"""Shared entry for one worker process: settings, logging, bus, signals, run, exit.

A worker stops on SIGTERM/SIGINT or when the run's `run_finished` event arrives; on stop it
hands unsettled work back to the stream (nak) so another replica picks it up at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable

import structlog

from areal.config import ConfigError, RunSettings, load_settings, new_worker_id
from areal.logging import setup_logging

log = structlog.get_logger()

# build(settings, bus, worker_id) -> a coroutine function run(stop) of the role's service
Builder = Callable[
    [RunSettings, "object", str], Awaitable[Callable[[asyncio.Event], Awaitable[object]]]
]


def parse_args(role: str, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"areal worker {role}", description=f"Run one {role} replica.")
    p.add_argument("--config", help="run config (YAML, or the config.json written by `areal run`)")
    p.add_argument("--nats-url", help="NATS server URL (overrides nats.url)")
    p.add_argument("--worker-id", help="stable id of this replica (default: role-host-pid-rand)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return p.parse_args(argv)


def resolve_model_path(settings: RunSettings) -> str:
    """The model dir; builds (or reuses the cached) warm-started tiny preset when unset."""
    if settings.model.path:
        return settings.model.path
    from areal.data.tiny_model import PRESETS
    from areal.data.warm_start import ensure_warm_model

    return str(
        ensure_warm_model(
            settings.data.source,
            sft_steps=settings.model.warm_start_steps,
            seed=settings.seed,
            task_kwargs=settings.data.task_kwargs,
            preset=PRESETS[settings.model.preset],
        )
    )


def main(role: str, build: Builder, argv: list[str] | None = None) -> int:
    args = parse_args(role, argv)
    try:
        overrides = list(args.overrides) + ([f"nats.url={args.nats_url}"] if args.nats_url else [])
        settings = load_settings(args.config, overrides)
    except ConfigError as e:
        print(e)
        return 2
    if not settings.nats.url:
        print("config error: nats.url: a worker needs a NATS server; pass --nats-url URL")
        return 2
    worker_id = args.worker_id or new_worker_id(role)
    setup_logging(role=role, worker_id=worker_id)
    log.info("config_resolved", config=settings.model_dump(mode="json"))
    return asyncio.run(_run(role, build, settings, worker_id))


async def _run(role: str, build: Builder, settings: RunSettings, worker_id: str) -> int:
    from areal.bus.client import Bus
    from areal.bus.streams import BusOptions

    opts = BusOptions(
        ack_wait_s=settings.nats.ack_wait_s,
        max_deliver=settings.nats.max_deliver,
        memory_storage=settings.nats.memory_storage,
    )
    bus = await Bus.connect(settings.nats.url, settings.run_id, role, worker_id, opts)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def on_finished(_msg) -> None:
        if role != "trainer":
            stop.set()

    sub = await bus.nc.subscribe(bus.names.events_subject("run_finished"), cb=on_finished)
    if role != "trainer":
        from areal.services.controller import TRAINER_KEY

        state = await bus.kv_get(TRAINER_KEY)
        if state and state.get("done"):
            log.info("run_already_finished")
            await bus.close()
            return 0
    rc = 0
    try:
        run = await build(settings, bus, worker_id)
        await run(stop)
    except Exception:
        log.exception("worker_failed", role=role)
        rc = 1
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        await bus.close()
        log.info("worker_stopped", role=role)
    return rc
