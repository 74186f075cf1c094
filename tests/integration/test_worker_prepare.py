"""Bug 4 of issue 10: a worker whose warm start outlasts the server's ping budget must stay
connected. Before the fix a worker connected first and then blocked its event loop through the
whole warm start; the server dropped it as a stale connection (no PONG within `ping_interval *
ping_max`), and on a cold cache the worker crashed on the timeouts that followed. Now a role's
heavy `prepare` runs before the worker connects.
"""

from __future__ import annotations

import time

import pytest

from areal.bus.client import Bus
from areal.bus.embedded import EmbeddedNats
from areal.config import RunSettings, load_settings
from areal.launch.worker import RoleSpec, run_worker
from schemas.state import CONTROLLER_KEY, ControllerState

pytestmark = pytest.mark.integration
PING_INTERVAL_S, PING_MAX = 1, 2  # the server drops a client that misses 2 pings of 1 s


@pytest.fixture
def strict_server(tmp_path):
    server = EmbeddedNats(
        store_dir=tmp_path / "nats",
        extra_conf=f'ping_interval: "{PING_INTERVAL_S}s"\nping_max: {PING_MAX}\n',
    ).start()
    yield server
    server.stop()


class Probe:
    """A service that proves its connection is the one it started with and is alive."""

    def __init__(self, bus: Bus, seen: dict) -> None:
        self.bus, self.seen = bus, seen

    async def run(self, stop) -> None:
        await self.bus.kv_put(CONTROLLER_KEY, ControllerState(admitted=7))
        state = await self.bus.kv_get(CONTROLLER_KEY, ControllerState)
        self.seen.update(reconnects=self.bus.reconnects, admitted=state.admitted if state else None)


@pytest.mark.slow  # ~6 s on 2 cores: waits out a ping budget
def test_a_warm_start_longer_than_the_ping_budget_keeps_the_worker_connected(strict_server, run_id):
    warm_start_s = 3 * PING_INTERVAL_S * PING_MAX  # well past the budget (6 s vs 2 s)
    seen: dict = {}

    def prepare(settings: RunSettings, worker_id: str) -> str:
        time.sleep(warm_start_s)  # a synchronous warm start (lock wait + training)
        return "parts"

    spec = RoleSpec("controller", prepare, lambda parts, bus: Probe(bus, seen))
    settings = load_settings(None, [f"nats.url={strict_server.url}", f"run_id={run_id}"])
    assert run_worker(spec, settings, "controller-0") == 0
    assert seen == {"reconnects": 0, "admitted": 7}
