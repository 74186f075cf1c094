"""Shared entry for one worker process: settings, logging, prepare, connect, run, exit.

A role is a `RoleSpec`: `prepare` does the heavy, synchronous part (warm start, tokenizer,
engine) *before* the worker connects to NATS, so a long warm start can never stall a
connection's pings and get the worker dropped by the server; `build` then wires the prepared
parts to the bus. While `prepare` runs, the worker logs `worker_preparing` every
`PREPARE_REPORT_S` seconds, so a long wait is never silent.

A worker stops on SIGTERM/SIGINT or when the run's `run_finished` event arrives; on stop it
hands unsettled work back to the stream (nak) so another replica picks it up at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import structlog

from areal.bus.client import Bus
from areal.config import ConfigError, RunSettings, load_settings, new_worker_id
from areal.logging import setup_logging
from schemas import Event
from schemas.state import TRAINER_KEY, TrainerState

log = structlog.get_logger()

P = TypeVar("P")
Role = Literal["controller", "rollout", "reward", "trainer"]
PREPARE_REPORT_S = 30.0


class Service(Protocol):
    async def run(self, stop: asyncio.Event) -> Any: ...


@dataclass(frozen=True)
class RoleSpec(Generic[P]):
    role: Role
    prepare: Callable[[RunSettings, str], P]  # (settings, worker_id) -> parts; before connecting
    build: Callable[[P, Bus], Service]  # cheap: wire the parts to the connected bus


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
            cache_dir=settings.cache_dir,
            task_kwargs=settings.data.task_kwargs,
            preset=PRESETS[settings.model.preset],
        )
    )


def main(spec: RoleSpec[Any], argv: list[str] | None = None) -> int:
    args = parse_args(spec.role, argv)
    try:
        overrides = list(args.overrides) + ([f"nats.url={args.nats_url}"] if args.nats_url else [])
        settings = load_settings(args.config, overrides)
    except ConfigError as e:
        print(e)
        return 2
    if not settings.nats.url:
        print("config error: nats.url: a worker needs a NATS server; pass --nats-url URL")
        return 2
    worker_id = args.worker_id or new_worker_id(spec.role)
    setup_logging(
        level=settings.log_level,
        log_format=settings.log_format,
        role=spec.role,
        worker_id=worker_id,
    )
    log.info("config_resolved", config=settings.model_dump(mode="json"))
    return run_worker(spec, settings, worker_id)


def run_worker(spec: RoleSpec[P], settings: RunSettings, worker_id: str) -> int:
    """Prepare (reporting progress), then connect and run until stopped; the exit code."""
    try:
        parts = _prepare_reporting(spec, settings, worker_id)
    except Exception:
        log.exception("worker_prepare_failed", role=spec.role)
        return 1
    return asyncio.run(_run(spec, settings, worker_id, parts))


def _prepare_reporting(spec: RoleSpec[P], settings: RunSettings, worker_id: str) -> P:
    done = threading.Event()
    t0 = time.monotonic()

    def report() -> None:
        while not done.wait(PREPARE_REPORT_S):
            log.info("worker_preparing", role=spec.role, waited_s=round(time.monotonic() - t0))

    reporter = threading.Thread(target=report, name="areal-prepare-report", daemon=True)
    reporter.start()
    try:
        return spec.prepare(settings, worker_id)
    finally:
        done.set()
        log.info("worker_prepared", role=spec.role, prepare_s=round(time.monotonic() - t0, 2))


async def _run(spec: RoleSpec[P], settings: RunSettings, worker_id: str, parts: P) -> int:
    assert settings.nats.url is not None
    bus = await Bus.connect(settings.nats.url, settings.run_id, spec.role, worker_id, settings.nats)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def on_finished(_ev: Event) -> None:
        if spec.role != "trainer":
            stop.set()

    sub = await bus.subscribe_events("run_finished", on_finished)
    rc = 0
    try:
        trainer = await bus.kv_get(TRAINER_KEY, TrainerState)
        if spec.role != "trainer" and trainer is not None and trainer.done:
            log.info("run_already_finished")
        else:
            await spec.build(parts, bus).run(stop)
    except Exception:
        log.exception("worker_failed", role=spec.role)
        rc = 1
    finally:
        with contextlib.suppress(Exception):  # best effort: the connection is closing anyway
            await sub.unsubscribe()
        await bus.close()
        log.info("worker_stopped", role=spec.role)
    return rc
