"""One controller and one trainer per run (`areal.bus.role_lock`): a second live one is refused
with the holder's name, a dead one is taken over, a stalled one that was taken over stops.

No wall clock decides these tests: the ttl is short so they are quick, and every wait has a
generous hang guard only."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from areal.bus.client import Bus
from areal.bus.role_lock import RoleLock, RoleLockHeld, RoleLockLost, lock_key
from areal.config import NatsSettings
from schemas.state import RoleLockState

pytestmark = pytest.mark.integration

TTL_S = 2.0
ROOT = Path(__file__).resolve().parents[2]


async def connect(url: str, run_id: str, role: str, wid: str) -> Bus:
    return await Bus.connect(url, run_id, role, wid, NatsSettings(), declare=True)


async def holder_of(bus: Bus, role: str) -> RoleLockState | None:
    got = await bus.kv_get_rev(lock_key(role), RoleLockState)
    return None if got is None else got[0]


async def test_a_second_live_trainer_is_refused_naming_the_holder(nats_url, run_id):
    a, b = [await connect(nats_url, run_id, "trainer", w) for w in ("trainer-a", "trainer-b")]
    stop = asyncio.Event()
    first = RoleLock(a, "trainer", "trainer-a", TTL_S)
    assert await first.acquire(stop)
    renewer = asyncio.create_task(first.renew_forever(stop))
    with pytest.raises(RoleLockHeld, match=r"already has a trainer: worker 'trainer-a'"):
        await asyncio.wait_for(RoleLock(b, "trainer", "trainer-b", TTL_S).acquire(stop), 60)
    # a duplicate under the holder's own worker id (compose --scale trainer=2) too
    with pytest.raises(RoleLockHeld):
        await asyncio.wait_for(RoleLock(b, "trainer", "trainer-a", TTL_S).acquire(stop), 60)
    assert (await holder_of(a, "trainer")).token == first.state.token  # untouched
    stop.set()
    await renewer
    await first.release()
    assert await holder_of(a, "trainer") is None
    # released: the next one takes it at once (create), without waiting out a ttl
    assert await asyncio.wait_for(
        RoleLock(b, "trainer", "trainer-b", TTL_S).acquire(asyncio.Event()), 60
    )
    assert (await holder_of(b, "trainer")).worker_id == "trainer-b"
    await a.close()
    await b.close()


@pytest.mark.parametrize("taker_id", ["controller-0", "controller-new"])
async def test_a_dead_holder_is_taken_over(nats_url, run_id, taker_id):
    """A holder that stopped renewing (SIGKILLed) is taken over: by a restart under its own id
    after 2 renewal periods, by any other after the ttl."""
    dead = await connect(nats_url, run_id, "controller", "controller-0")
    assert await RoleLock(dead, "controller", "controller-0", TTL_S).acquire(asyncio.Event())
    await dead.close()  # never renews, never releases
    bus = await connect(nats_url, run_id, "controller", taker_id)
    taker = RoleLock(bus, "controller", taker_id, TTL_S)
    assert await asyncio.wait_for(taker.acquire(asyncio.Event()), 120)
    held = await holder_of(bus, "controller")
    assert (held.worker_id, held.token) == (taker_id, taker.state.token)
    await taker.renew()  # and it renews its own revision
    assert (await holder_of(bus, "controller")).renewals == 1
    await bus.close()


async def test_a_holder_whose_lock_was_taken_stops(nats_url, run_id):
    """A holder that stalled past the ttl finds its lock taken at its next renewal: serving
    stops (its stop event is set) and `RoleLockLost` names who holds it now."""
    a, b = [await connect(nats_url, run_id, "trainer", w) for w in ("trainer-a", "trainer-b")]
    stop = asyncio.Event()
    stalled = RoleLock(a, "trainer", "trainer-a", TTL_S)
    assert await stalled.acquire(stop)
    taker = RoleLock(b, "trainer", "trainer-b", TTL_S)
    assert await asyncio.wait_for(taker.acquire(asyncio.Event()), 120)  # it never renewed

    async def service() -> str:
        await stop.wait()  # a service runs until its stop event
        return "stopped"

    with pytest.raises(RoleLockLost, match=r"worker 'trainer-b'"):
        await asyncio.wait_for(stalled.serve(service(), stop), 60)
    assert stop.is_set()
    assert (await holder_of(b, "trainer")).worker_id == "trainer-b"  # its release took nothing
    await a.close()
    await b.close()


async def test_a_clean_serve_releases(nats_url, run_id):
    bus = await connect(nats_url, run_id, "controller", "controller-0")
    stop = asyncio.Event()
    lock = RoleLock(bus, "controller", "controller-0", TTL_S)
    assert await lock.acquire(stop)

    async def service() -> None:
        await asyncio.sleep(3 * lock.period_s)  # long enough to renew a few times
        stop.set()

    await asyncio.wait_for(lock.serve(service(), stop), 60)
    assert lock.state.renewals >= 1
    assert await holder_of(bus, "controller") is None
    await bus.close()


@pytest.mark.slow  # ~6 s on 2 cores: two worker processes
async def test_a_second_controller_worker_exits_with_a_config_error(nats_url, run_id, tmp_path):
    """The whole worker path: `areal worker controller` on a run whose controller is alive
    exits with EXIT_CONFIG (not restarted) and says who holds the run, before its prepare (a
    second trainer does not load a model first)."""
    bus = await connect(nats_url, run_id, "controller", "controller-0")
    stop = asyncio.Event()
    lock = RoleLock(bus, "controller", "controller-0", 30.0)
    assert await lock.acquire(stop)
    renewer = asyncio.create_task(lock.renew_forever(stop))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "run_id": run_id,
                "out_dir": str(tmp_path / "out"),
                "nats": {"url": nats_url, "role_lock_ttl_s": 30.0},
                "security": {"sign_weights": False},
            }
        )
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "workers.controller",
        "--config",
        str(cfg),
        "--worker-id",
        "controller-1",
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 600)  # hang guard
    text = out.decode()
    assert proc.returncode == 2, text[-3000:]
    printed = [ln for ln in text.splitlines() if ln.startswith("config error:")]
    assert printed and "already has a controller: worker 'controller-0'" in printed[-1], text[
        -3000:
    ]
    assert "worker_prepared" not in text  # refused before it prepared anything
    assert (await holder_of(bus, "controller")).worker_id == "controller-0"
    stop.set()
    await renewer
    await lock.release()
    await bus.close()
