"""Shared entry for one worker process: settings, logging, prepare, connect, run, exit.

A role is a `RoleSpec`: `prepare` does the heavy, synchronous part (warm start, tokenizer,
engine) *before* the worker connects to NATS, so a long warm start can never stall a
connection's pings and get the worker dropped by the server; `build` then wires the prepared
parts to the bus. While `prepare` runs, the worker logs `worker_preparing` every
`PREPARE_REPORT_S` seconds, so a long wait is never silent.

A worker stops on SIGTERM/SIGINT or when the run's `run_finished` event arrives; on stop it
hands unsettled work back to the stream (nak) so another replica picks it up at once.

Before `prepare` the worker loads the run's keys (`areal.security.keys.keys_for_worker`): the
trainer its signing key, a rollout worker the verify key; without them (and with
`security.sign_weights` on) it exits with `EXIT_CONFIG` naming `security.keys_dir` and the fix.

It connects with its role's NATS credentials (`areal.bus.auth.credentials_for`: a missing file
fails before prepare). With per-role accounts no worker declares the run's streams: the
launcher did (`nats_config.DECLARERS`; `areal declare` where no launcher runs) and every worker
waits for them (`Bus.wait_declared`); without accounts the controller and the trainer declare
them (`nats_config.SELF_DECLARERS`). A server that refuses the credentials, or refuses the
account something its role does, is an `EXIT_CONFIG`.

A `run_finished` event stops a worker only when the trainer signed it with the run's key
(`Bus.trusted_event`); where the worker holds no run keys (a run without them) any
`run_finished` on the run's subject does.

Exit codes: 0 stopped or the run is finished; `EXIT_CONFIG` (2) a deterministic failure (a
config error, a missing dependency: the role's `preflight` checks, or a `ConfigError` /
`ImportError` from prepare), whose one-line reason is the last line the worker prints, and which
a restart cannot fix (the launcher does not restart it); `EXIT_BUS_UNAVAILABLE` (3) the NATS
server did not answer for `nats.outage_tolerance_s` (the launcher restarts it without spending
its restart budget); 1 anything else (restartable).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import structlog

from areal.bus.auth import credentials_for
from areal.bus.client import Bus
from areal.bus.errors import (
    AuthenticationFailed,
    BusUnavailable,
    PermissionDenied,
    RunConflictError,
)
from areal.bus.nats_config import SELF_DECLARERS
from areal.bus.role_lock import RoleLock, RoleLockHeld, RoleLockLost
from areal.bus.streams import StorageLimitError
from areal.config import ConfigError, RunSettings, load_settings, new_worker_id
from areal.launch.exit_codes import EXIT_BUS_UNAVAILABLE, EXIT_CONFIG
from areal.launch.preflight import check_role
from areal.logging import setup_logging
from areal.security.keys import RunKeys, keys_for_worker
from schemas import Event
from schemas.state import TRAINER_KEY, TrainerState

log = structlog.get_logger()

P = TypeVar("P")
Role = Literal["controller", "rollout", "reward", "trainer"]
PREPARE_REPORT_S = 30.0
STOPPED_EVENT_WAIT_S = 2.0  # the most a stop waits to say so on the bus
SINGLE_ROLES = ("controller", "trainer")  # one per run: they hold a RoleLock while serving


class Service(Protocol):
    async def run(self, stop: asyncio.Event) -> Any: ...


@dataclass(frozen=True)
class RoleSpec(Generic[P]):
    role: Role
    prepare: Callable[[RunSettings, str], P]  # (settings, worker_id) -> parts; before connecting
    build: Callable[[P, Bus], Service]  # cheap: wire the parts to the connected bus
    # a role that runs as a group of ranks (the trainer): what RANK > 0 runs instead of prepare
    # + connect + run; returns the exit code (`areal.launch.ranks`)
    follow: Callable[[RunSettings, str], int] | None = None


def parse_args(role: str, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"areal worker {role}", description=f"Run one {role} replica.")
    p.add_argument("--config", help="run config (YAML, or the config.json written by `areal run`)")
    p.add_argument(
        "--join",
        metavar="RUN_ID",
        help="join run RUN_ID started by `areal run` on --nats-url, from any host: fetch its "
        "config, model and data from the bus (instead of --config)",
    )
    p.add_argument("--nats-url", help="NATS server URL (overrides nats.url)")
    p.add_argument(
        "--credentials",
        metavar="FILE",
        help="this role's NATS credentials file (overrides nats.credentials_file): a copy of "
        "the launcher's <out>/keys/nats/<role>.json, or one `areal nats-config` wrote",
    )
    p.add_argument("--worker-id", help="stable id of this replica (default: role-host-pid-rand)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return p.parse_args(argv)


def resolve_model_path(settings: RunSettings) -> str:
    """The model dir: `model.path` when set (for a worker that joined with `--join`, the copy
    of the run's model fetched from the bus into this host's cache: `areal.launch.join`), else
    the warm-started built-in preset, built once and then taken from the cache."""
    if settings.model.path:
        return settings.model.path
    from areal.data.presets import PRESETS
    from areal.data.warm_start import ensure_warm_model

    d = settings.data
    source = settings.model.warm_start_source or d.source
    # a synthetic warm start takes the task's options only when it is the run's own task
    task_kwargs = dict(d.task_kwargs) if source == d.source else {}
    if not source.startswith("synthetic:"):  # the file's field names, as the controller reads it
        task_kwargs.update(prompt_field=d.prompt_field, answer_field=d.answer_field)
    return str(
        ensure_warm_model(
            source,
            sft_steps=settings.model.warm_start_steps,
            label_smoothing=settings.model.warm_start_label_smoothing,
            seed=settings.seed,
            cache_dir=settings.cache_dir,
            task_kwargs=task_kwargs,
            preset=PRESETS[settings.model.preset],
            lock_timeout_s=settings.model.warm_start_lock_timeout_s,
        )
    )


def _join(
    role: str, run_id: str, config: str | None, nats_url: str | None, overrides: list[str]
) -> str:
    """The config of a worker joining `run_id` (`areal.launch.join`); `ConfigError` with the
    fix when the arguments do not allow it."""
    from areal.launch.join import JoinError, join_config

    if config is not None:
        raise ConfigError("config error: --join and --config exclude each other; pass one")
    if not nats_url:
        raise ConfigError(
            "config error: --join needs --nats-url URL (the server the run's launcher printed)"
        )
    try:
        return str(join_config(run_id, nats_url, overrides, role=role))
    except JoinError as e:
        raise ConfigError(f"config error: {e}") from None


def main(spec: RoleSpec[Any], argv: list[str] | None = None) -> int:
    args = parse_args(spec.role, argv)
    try:
        overrides = list(args.overrides) + ([f"nats.url={args.nats_url}"] if args.nats_url else [])
        if args.credentials:
            overrides.append(f"nats.credentials_file={args.credentials}")
        config = args.config
        if args.join:
            config = _join(spec.role, args.join, args.config, args.nats_url, overrides)
        settings = load_settings(config, overrides)
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
    """Check, prepare (reporting progress), then connect and run until stopped; the exit code
    (`EXIT_CONFIG` for a deterministic failure, its reason printed as the last line). A rank
    > 0 of a role's rank group (RANK in the environment) follows rank 0 instead."""
    if spec.follow is not None:
        from areal.launch.ranks import env_rank

        if env_rank() > 0:
            return spec.follow(settings, worker_id)
    try:
        check_role(spec.role, settings)
        keys = keys_for_worker(settings, spec.role)  # before prepare: a missing key fails fast
        credentials_for(settings.nats, spec.role)  # so does a missing credentials file
        if spec.role in SINGLE_ROLES:  # a second trainer is refused before it loads a model
            asyncio.run(_refuse_if_held(spec.role, settings, worker_id))
        parts = _prepare_reporting(spec, settings, worker_id)
    except RoleLockHeld as e:
        log.error("worker_refused_single_role", role=spec.role, error=str(e))
        print(str(e), flush=True)
        return EXIT_CONFIG
    except (ConfigError, ImportError) as e:
        if not isinstance(e, ConfigError):
            log.exception("worker_prepare_failed", role=spec.role)
        reason = (
            str(e)
            if isinstance(e, ConfigError)
            else f"config error: {spec.role} prepare: {e}; install the missing package"
        )
        print(reason.splitlines()[0] if reason else "config error", flush=True)
        return EXIT_CONFIG
    except Exception:
        log.exception("worker_prepare_failed", role=spec.role)
        return 1
    return asyncio.run(_run(spec, settings, worker_id, parts, keys))


async def _refuse_if_held(role: str, settings: RunSettings, worker_id: str) -> None:
    """`RoleLock.refuse_if_held` on a short connection of its own, before prepare; anything
    else that goes wrong here (no server yet, no run state yet) is left to `_run`, which
    acquires the lock for real."""
    assert settings.nats.url is not None
    url, ttl_s = settings.nats.url, settings.nats.role_lock_ttl_s

    async def look() -> None:
        bus = await Bus.connect(url, settings.run_id, role, worker_id, settings.nats, declare=False)
        try:
            await RoleLock(bus, role, worker_id, ttl_s).refuse_if_held()
        finally:
            await bus.close()

    try:
        await asyncio.wait_for(look(), 10 + ttl_s)
    except RoleLockHeld:
        raise
    except Exception as e:  # only a look ahead: _run decides
        log.debug("role_lock_precheck_skipped", role=role, error=repr(e))


async def await_open_run(bus: Bus, total_steps: int, stop: asyncio.Event) -> bool:
    """True when the run has training left (this worker should serve it), False when it is
    finished for `total_steps` or the worker was stopped while waiting.

    Why a wait, and why it is race-free: `done` in the run state is the trainer's, and only the
    trainer resets it (`TrainerService.restore` publishes `done = False` before it trains). A
    run resumed with a larger `train.total_steps` still shows the previous incarnation's
    `done = True` until then, and the other roles usually start before the trainer (its prepare
    loads the model). So a `done` state whose `step` is below this worker's `total_steps` (the
    same config.json for every role) means "being extended": wait for the reset, never exit on
    it. The watch is opened before the first read, so the reset cannot slip between the two.
    A `done` state at or past `total_steps` is a finished run: return False at once."""
    watch = await bus.kv_watch(TRAINER_KEY)
    t0 = next_report = time.monotonic()
    try:
        while not stop.is_set():
            trainer = await bus.kv_get(TRAINER_KEY, TrainerState)
            if trainer is None or not trainer.done:
                return True
            if trainer.step >= total_steps:
                return False
            if time.monotonic() >= next_report:  # at once, then every PREPARE_REPORT_S
                next_report = time.monotonic() + PREPARE_REPORT_S
                log.info(
                    "waiting_for_trainer",
                    reason="the run finished at an earlier total_steps: waiting for the "
                    "trainer to resume it",
                    step=trainer.step,
                    total_steps=total_steps,
                    waited_s=round(time.monotonic() - t0),
                )
            await watch.wait(timeout_s=1.0)
        return False
    finally:
        await watch.stop()


def _cpus_here() -> str | None:
    """The cores this process may run on (`cpu_affinity`), as a cpu list; None off Linux."""
    from areal.proc import format_cpu_list

    return format_cpu_list(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


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
        log.info(
            "worker_prepared",
            role=spec.role,
            prepare_s=round(time.monotonic() - t0, 2),
            cpus=_cpus_here(),
        )


async def _run(
    spec: RoleSpec[P], settings: RunSettings, worker_id: str, parts: P, keys: RunKeys | None
) -> int:
    assert settings.nats.url is not None
    # with per-role accounts the launcher declared the run; without, two roles declare it
    declare = spec.role in SELF_DECLARERS and not credentials_for(settings.nats, spec.role).given
    try:
        bus = await Bus.connect(
            settings.nats.url,
            settings.run_id,
            spec.role,
            worker_id,
            settings.nats,
            keys=keys,
            sign_weights=settings.security.sign_weights,
            weights_dir=settings.weights.file_dir(settings.out_dir),
            declare=declare,  # the others may not create streams: they wait
        )
    # the same on every retry: do not (a refused account included: its file or permissions
    # are wrong, a restart cannot fix them)
    except (RunConflictError, StorageLimitError, AuthenticationFailed, PermissionDenied) as e:
        print(f"config error: {e}", flush=True)
        return EXIT_CONFIG
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def on_finished(ev: Event) -> None:
        if spec.role == "trainer":
            return
        why = bus.event_rejection(ev)
        if why is not None:
            log.error("run_finished_refused", reason=why, worker_id=ev.worker_id)
            return
        stop.set()

    sub = await bus.subscribe_events("run_finished", on_finished)
    rc = 0
    lock = (
        RoleLock(bus, spec.role, worker_id, settings.nats.role_lock_ttl_s)
        if spec.role in SINGLE_ROLES
        else None
    )
    try:
        if not declare and not await bus.wait_declared(stop):
            pass  # stopped before the run's streams existed
        elif lock is not None and not await lock.acquire(stop):
            pass  # stopped while waiting out a dead holder
        elif spec.role != "trainer" and not await await_open_run(
            bus, settings.train.total_steps, stop
        ):
            if not stop.is_set():
                log.info("run_already_finished")
            if lock is not None:
                await lock.release()
        elif lock is not None:
            await lock.serve(spec.build(parts, bus).run(stop), stop)
        else:
            await spec.build(parts, bus).run(stop)
    except (RoleLockHeld, RoleLockLost) as e:  # a second controller / trainer: not restarted
        log.error("worker_refused_single_role", role=spec.role, error=str(e))
        print(str(e), flush=True)
        rc = EXIT_CONFIG
    except BusUnavailable as e:  # the server, not this worker: the launcher restarts it freely
        log.error("worker_failed_bus_unavailable", role=spec.role, error=str(e))
        print(f"bus unavailable: {e}", flush=True)
        rc = EXIT_BUS_UNAVAILABLE
    except PermissionDenied as e:  # this account may not do what the role does: not restarted
        log.error("worker_failed_permission_denied", role=spec.role, error=str(e))
        print(f"config error: {e}", flush=True)
        rc = EXIT_CONFIG
    except Exception:
        log.exception("worker_failed", role=spec.role)
        rc = 1
    finally:
        with contextlib.suppress(Exception):  # best effort: the connection is closing anyway
            await sub.unsubscribe()
        # a watchdog then takes the silence that follows for a stop, not a freeze
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                bus.event("worker_stopped", exit_code=rc, pid=os.getpid()), STOPPED_EVENT_WAIT_S
            )
        await bus.close()
        log.info("worker_stopped", role=spec.role)
    return rc
