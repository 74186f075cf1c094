"""The trainer worker as a rank group (`train.nproc` under `areal run`, or torchrun).

`areal worker trainer` reads RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR / MASTER_PORT)
from its environment. Rank 0 is the bus worker: it joins the group in `prepare`, before the
engine is built, and drives the group's engines through `RankZeroEngine`
(`areal.engines.rank_group`, which holds the CONTRACT for distributed engines). Every other
rank runs `follow_main` instead of the worker's connect-and-run: it joins the group, builds the
same engine from the same settings and follows rank 0's calls; it never connects to NATS.

Invariants:
- WORLD_SIZE > 1 with `train.engine: torch` is a config error on every rank (before joining);
- rank 0 ends the group with its exit status (`RankZeroService`): 0 when the trainer service
  returned, 1 when it raised or a rank was lost; followers exit with what rank 0 sent, or 1
  when rank 0 vanished or their own call failed (the launcher then restarts the group from the
  checkpoint: nothing is acked before a checkpoint covers it);
- a follower lost while rank 0 waits for data stops the trainer service at once (its stop
  event), and the worker exits 1.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from typing import Any

import structlog

from areal.config import ConfigError, RunSettings
from areal.launch.exit_codes import EXIT_CONFIG, EXIT_RANK_FAILED

log = structlog.get_logger()

__all__ = ["RankZeroService", "env_rank", "follow_main", "join_rank_group", "lead_rank_group"]


def env_rank() -> int:
    """This process's RANK (0 when unset), without importing torch."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def ping_s_for(timeout_s: float) -> float:
    """How often an idle rank 0 pings: well within the followers' collective timeout."""
    return min(10.0, timeout_s / 4)


def join_rank_group(settings: RunSettings) -> int:
    """Join the trainer's rank group when WORLD_SIZE > 1; returns the world size.
    `ConfigError` when the settings cannot run on that many ranks."""
    from areal.engines.rank_group import RankEnv, init_rank_group

    try:
        env = RankEnv.from_env()
    except ValueError as e:
        raise ConfigError(f"config error: {e}") from None
    t = settings.train
    if env.world_size > 1 and t.engine == "torch":
        raise ConfigError(
            f"config error: WORLD_SIZE={env.world_size} but train.engine=torch runs on one rank:"
            " set train.engine=fsdp or deepspeed"
        )
    if env.world_size > 1 and settings.model.device.startswith("cuda"):
        import torch

        if env.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"config error: trainer rank {env.rank} needs GPU {env.local_rank} but this host "
                f"has {torch.cuda.device_count()}: lower train.nproc (or torchrun's "
                "--nproc-per-node) to the GPUs present"
            )
    if env.world_size > 1:
        try:
            init_rank_group(env, device=settings.model.device, timeout_s=t.dist_timeout_s)
        except ValueError as e:
            raise ConfigError(f"config error: {e}") from None
    return env.world_size


def lead_rank_group(engine: Any, settings: RunSettings, world_size: int) -> Any:
    """Rank 0's engine: `engine` itself on one rank, else a `RankZeroEngine` over the group."""
    if world_size == 1:
        return engine
    from areal.engines.rank_group import RankZeroEngine

    group = RankZeroEngine(engine, ping_s=ping_s_for(settings.train.dist_timeout_s))
    log.info("rank_group_leading", world_size=world_size)
    return group


class RankZeroService:
    """The trainer service on rank 0 of a group: runs it, then ends the group with the
    outcome; a rank lost meanwhile stops the service and fails the worker."""

    def __init__(self, inner: Any, group: Any) -> None:
        self.inner, self.group = inner, group

    async def run(self, stop: asyncio.Event) -> Any:
        loop = asyncio.get_running_loop()
        self.group.on_lost = lambda _e: loop.call_soon_threadsafe(stop.set)
        try:
            result = await self.inner.run(stop)
        except BaseException:
            await asyncio.to_thread(self.group.close, EXIT_RANK_FAILED)
            raise
        lost = self.group.lost
        await asyncio.to_thread(self.group.close, EXIT_RANK_FAILED if lost else 0)
        if lost is not None:
            from areal.engines.rank_group import RankGroupError

            raise RankGroupError(f"a trainer rank was lost ({type(lost).__name__}: {lost})")
        return result


def follow_main(
    settings: RunSettings, worker_id: str, make_engine: Callable[[RunSettings], Any]
) -> int:
    """A follower rank's whole life: join, build the engine, follow rank 0, exit with its
    status. A failure exits at once (`os._exit`: a broken gloo group may abort at exit)."""
    rank = env_rank()
    try:
        join_rank_group(settings)
        engine = make_engine(settings)
    except ConfigError as e:
        print(str(e).splitlines()[0], flush=True)
        return EXIT_CONFIG
    except Exception:
        log.exception("trainer_rank_failed", rank=rank, stage="prepare")
        _exit_now(EXIT_RANK_FAILED)
    import torch.distributed as dist

    from areal.engines.rank_group import follow, leave_group

    log.info("trainer_rank_following", rank=rank, world_size=dist.get_world_size())
    try:
        rc = follow(engine)
    except Exception as e:
        log.error("trainer_rank_failed", rank=rank, error=f"{type(e).__name__}: {e}"[:500])
        _exit_now(EXIT_RANK_FAILED)
    log.info("trainer_rank_stopped", rank=rank, exit_code=rc)
    leave_group()
    return rc


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
