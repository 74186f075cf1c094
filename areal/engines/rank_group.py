"""The trainer as a group of ranks: rank 0 drives, every other rank follows its engine calls.

Only rank 0 is a bus worker: it consumes, acks, checkpoints and publishes exactly as a single
trainer does (`TrainerService`, unchanged). Its engine is a `RankZeroEngine`: each collective
engine call is first broadcast to the followers (method name, full arguments, rank 0's
`version`), then run locally. A follower never connects to NATS; it runs `follow(engine)`,
which receives the calls and runs them on its own engine, until rank 0 sends the stop call.

CONTRACT for a distributed training engine (`FSDPTrainEngine`, `DeepSpeedTrainEngine`):
- every rank builds its engine after `torch.distributed` is initialized (`init_rank_group`),
  from the same `TrainEngineConfig`; with world size 1 the engine behaves like the torch
  engine (same numbers, same stats keys);
- every rank calls the same methods in the same order with the same FULL arguments (the rank
  group broadcasts them: an engine never broadcasts its inputs itself), and `version` is the
  same on every rank before each call (the group sets it from rank 0's);
- inside, micro-batches are packed exactly as `TorchTrainEngine` packs them (its
  `SeqForward.micro_batches` over the whole minibatch) and rank r processes micro-batches
  ``i`` with ``i % world == r``; short ranks run zero-weight dummy passes, so every rank runs
  the same number of forward/backward passes (FSDP/ZeRO collectives must line up or hang);
- losses are divided by the GLOBAL loss-token count of the minibatch and gradients are summed
  over ranks (undo any averaging by world size), so the reduced gradient equals the 1-rank one;
- returned stats are identical on every rank (additive totals all-reduced, `loss_stat_sums` ->
  `stats_from_sums`); the skip decision of the non-finite guard is global (a step whose loss or
  gradient is not finite on any rank changes no weight on any rank);
- `compute_logp` returns the full list on every rank; `export_safetensors` returns the full
  bytes on rank 0 (the others take part in the gather and may return b""); `save_pretrained`
  writes on rank 0; `save_checkpoint` / `load_checkpoint` are collective with the same path on
  every rank (rank 0 may be the only one that touches the file);
- optional `snapshot_checkpoint()` is collective (rank 0 gets the snapshot) and
  `write_checkpoint(snapshot, path)` is local to rank 0 (no collective): the trainer writes a
  snapshot in the background while the next step runs; optional `export_state_dict()` is
  collective (rank 0 gets the full CPU state dict, the others {}), used instead of
  `export_safetensors` where the engine has it (`weights_stream.export_blob`);
- an exception inside a call is fatal for the group: the rank exits non-zero, its peers' next
  collective fails (gloo/nccl raise on a closed peer, or after `timeout_s`), and the launcher
  restarts the whole group from the last checkpoint. Nothing is acked before a checkpoint
  covers it, so a restart loses nothing and trains nothing twice.

Invariants of the group itself:
- calls are serialized (one lock): the trainer's threads (train step, background checkpoint,
  weights export) never interleave broadcasts;
- while rank 0 is idle (waiting for data on the bus) it pings the followers every `ping_s`, so a
  follower never times out in its wait and a dead follower is noticed within `ping_s`: the
  group is then `lost` and `on_lost` runs (the worker stops its service and exits non-zero,
  `areal.launch.ranks.RankZeroService`); no call runs on a lost group (`RankGroupError`);
- rank 0 ends the group with a stop call carrying its exit code, so every rank exits with the
  same status (what torchrun and `areal run` judge the group by); a rank 0 that dies without
  one leaves its followers a closed connection: they exit non-zero.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger()

__all__ = [
    "COLLECTIVE_CALLS",
    "RankEnv",
    "RankGroupError",
    "RankZeroEngine",
    "ensure_rank_group",
    "follow",
    "init_rank_group",
    "resolve_device",
]

# The engine methods the group runs on every rank (the TrainEngine protocol, plus the optional
# collective snapshot). `write_checkpoint` runs on rank 0 alone.
COLLECTIVE_CALLS = frozenset(
    {
        "compute_logp",
        "train_step",
        "export_safetensors",
        "save_pretrained",
        "save_checkpoint",
        "load_checkpoint",
        "snapshot_checkpoint",
        "export_state_dict",
    }
)
_OPTIONAL_CALLS = ("snapshot_checkpoint", "export_state_dict")  # where the engine has them
_PING, _STOP = "__ping__", "__stop__"


class RankGroupError(RuntimeError):
    """The rank group cannot go on (a rank died, or a call failed half-way on rank 0)."""


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the group, from the torchrun / `areal run` environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankEnv:
        env = os.environ if environ is None else environ
        try:
            rank = int(env.get("RANK", "0"))
            world = int(env.get("WORLD_SIZE", "1"))
            local = int(env.get("LOCAL_RANK", str(rank)))
        except ValueError as e:
            raise ValueError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers: {e}") from None
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"RANK={rank} WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
        return cls(rank, world, local)


def resolve_device(spec: str) -> torch.device:
    """``spec`` as a device; a bare "cuda" is this rank's GPU, ``cuda:$LOCAL_RANK``."""
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", RankEnv.from_env().local_rank)
    return device


def init_rank_group(env: RankEnv, *, device: str, timeout_s: float) -> None:
    """Join the group (gloo on CPU, nccl on CUDA); a no-op when already initialized. World 1
    needs no rendezvous; more ranks meet at MASTER_ADDR:MASTER_PORT (torchrun and `areal run`
    set them)."""
    if dist.is_initialized():
        return
    dev = resolve_device(device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    if env.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise ValueError(
            f"WORLD_SIZE={env.world_size} but {', '.join(missing)} unset: start the trainer "
            "ranks with torchrun or `areal run` (train.nproc), which set them"
        )
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )
    log.info("rank_group_joined", rank=env.rank, world_size=env.world_size, backend=backend)


def ensure_rank_group(device: torch.device) -> None:
    """What an engine built outside a group calls: a 1-rank group when none is initialized."""
    if not dist.is_initialized():
        init_rank_group(RankEnv.from_env(), device=str(device), timeout_s=600.0)


@dataclass
class _Call:
    """One message rank 0 broadcasts: an engine call (with rank 0's version), a ping or stop."""

    name: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    version: int = 0
    rc: int = 0  # the exit code, on the stop call


def _broadcast(call: _Call | None) -> _Call:
    box = [call]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


class RankZeroEngine:
    """Rank 0's view of a group's engines: a `TrainEngine` whose collective calls are
    broadcast to the followers, then run locally (see the module docstring)."""

    def __init__(
        self,
        engine: Any,
        *,
        ping_s: float = 10.0,
        on_lost: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._closed = False
        self.lost: BaseException | None = None  # why the group cannot go on, once it cannot
        self.on_lost = on_lost  # called (from the ping thread) when a ping fails
        self._ping_s = ping_s
        self._last_call = time.monotonic()
        self._stopping = threading.Event()
        self._pinger = threading.Thread(target=self._ping_loop, name="areal-rank-ping", daemon=True)
        self._pinger.start()

    # ------------------------------------------------------------ TrainEngine
    @property
    def version(self) -> int:
        return self._engine.version

    @version.setter
    def version(self, value: int) -> None:  # reaches the followers with the next call
        self._engine.version = value

    def compute_logp(self, seqs: list, max_tokens_per_mb: int) -> list[torch.Tensor]:
        return self._call("compute_logp", seqs, max_tokens_per_mb)

    def train_step(self, seqs: list, max_tokens_per_mb: int) -> dict[str, float]:
        return self._call("train_step", seqs, max_tokens_per_mb)

    def export_safetensors(self) -> bytes:
        return self._call("export_safetensors")

    def save_pretrained(self, path: str) -> None:
        self._call("save_pretrained", path)

    def save_checkpoint(self, path: str) -> None:
        self._call("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._call("load_checkpoint", path)

    def __getattr__(self, name: str) -> Any:
        """The optional calls where the engine has them (`snapshot_checkpoint` and
        `export_state_dict` collective, `write_checkpoint` local); plain attributes
        (``vocab_size``, ...) as they are; any other method is refused (running it on rank 0
        alone could hang the group)."""
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._engine, name)
        if name in _OPTIONAL_CALLS:
            return partial(self._call, name)
        if name == "write_checkpoint" or not callable(value):
            return value
        raise AttributeError(
            f"{type(self._engine).__name__}.{name} is not a rank-group call; add it to "
            "areal.engines.rank_group.COLLECTIVE_CALLS if every rank must run it"
        )

    # ------------------------------------------------------------ the group
    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        assert name in COLLECTIVE_CALLS, name
        with self._lock:
            self._check_usable()
            try:
                _broadcast(_Call(name, args, kwargs, version=self._engine.version))
                return getattr(self._engine, name)(*args, **kwargs)
            except BaseException as e:
                # the followers may be inside a collective of this call: no further call may
                # follow it, or the group would run mismatched collectives
                self.lost = self.lost or e
                raise
            finally:
                self._last_call = time.monotonic()

    def _check_usable(self) -> None:
        if self._closed:
            raise RankGroupError("the rank group is closed")
        if self.lost is not None:
            raise RankGroupError(
                f"the rank group broke ({type(self.lost).__name__}: {self.lost}); the trainer "
                "must restart (the launcher restarts the group from its checkpoint)"
            )

    def _ping_loop(self) -> None:
        while not self._stopping.wait(self._ping_s / 4):
            if time.monotonic() - self._last_call < self._ping_s:
                continue
            if not self._lock.acquire(blocking=False):
                continue  # a call is running: it talks to the followers itself
            try:
                if self._closed or self.lost is not None:
                    return
                _broadcast(_Call(_PING))
                self._last_call = time.monotonic()
            except Exception as e:
                self.lost = e
                log.error("trainer_rank_lost", error=f"{type(e).__name__}: {e}"[:500])
                if self.on_lost is not None:
                    self.on_lost(e)
                return
            finally:
                self._lock.release()

    def close(self, rc: int = 0) -> None:
        """End the group: the followers exit with ``rc`` (nothing is sent to a broken group:
        its followers see the closed connection and exit non-zero)."""
        self._stopping.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stopped = False
            if self.lost is None:
                try:
                    _broadcast(_Call(_STOP, rc=rc))
                    stopped = True
                except Exception as e:  # a follower died meanwhile: it exits on its own
                    log.warning("rank_group_stop_failed", error=str(e)[:300])
        self._pinger.join(timeout=5.0)
        if stopped:
            leave_group()


def leave_group() -> None:
    """Leave the process group once every rank got the stop call (a barrier, then destroy):
    a rank that exits with its gloo group still up can abort in exit-time teardown
    (SIGABRT, "terminate called without an active exception") after its work is done. Best
    effort: a peer gone meanwhile only costs the barrier's error, logged."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # a peer died after the stop call: exit as planned all the same
        log.warning("rank_group_leave_failed", error=f"{type(e).__name__}: {e}"[:300])


def follow(engine: Any) -> int:
    """A follower's loop: run rank 0's calls on ``engine`` until the stop call; returns the
    exit code rank 0 sent. A failed call or a lost rank 0 raises (the caller exits
    non-zero)."""
    while True:
        call = _broadcast(None)
        if call.name == _PING:
            continue
        if call.name == _STOP:
            return call.rc
        if call.name not in COLLECTIVE_CALLS:
            raise RankGroupError(f"rank 0 sent an unknown call {call.name!r}")
        engine.version = call.version
        getattr(engine, call.name)(*call.args, **call.kwargs)
