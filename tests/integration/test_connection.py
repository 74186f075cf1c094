"""`areal.bus.connection.connect` against a real nats-server: a deliberate close is quiet, a lost
server is a warning, and bounded patience gives up with the URL in the error."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

import areal.bus.connection as connection
from areal.bus.connection import Patience, connect
from areal.bus.embedded import EmbeddedNats, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


class Recorder:
    """Stands in for the module's structlog logger: keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str):
        def record(event: str, **fields: Any) -> None:
            self.records.append((level, event, fields))

        return record

    def events(self, level: str) -> list[tuple[str, Any]]:
        return [(event, f.get("client")) for lvl, event, f in self.records if lvl == level]


@pytest.fixture
def logs(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(connection, "log", rec)
    return rec


async def wait_until(pred, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


async def test_a_deliberate_close_is_quiet_and_a_lost_server_is_a_warning(
    tmp_path: Path, logs: Recorder
):
    lost: list[str] = []
    with EmbeddedNats(tmp_path / "nats") as server:
        closed = await connect(server.url, "closer")
        await closed.close()
        drained = await connect(server.url, "drainer")
        await drained.drain()
        await wait_until(lambda: drained.is_closed)
        assert logs.events("warning") == []  # the launcher's end of a good run
        assert logs.events("debug") == [("nats_closed", "closer"), ("nats_closed", "drainer")]
        watcher = await connect(
            server.url, "watcher", patience=Patience(reconnect_s=1.0), on_lost=lost.append
        )
    await wait_until(lambda: bool(lost))  # the server stopped with the block
    assert ("nats_disconnected", "watcher") in logs.events("warning")
    assert lost == [lost[0]] and lost[0].startswith(f"lost the NATS server at {server.url}")
    assert watcher.is_closed


@pytest.mark.slow  # ~10 s on 2 cores: a server restart within the tolerance
async def test_a_reconnect_in_time_keeps_the_connection(tmp_path: Path, logs: Recorder):
    lost: list[str] = []
    server = EmbeddedNats(tmp_path / "nats").start()
    nc = await connect(
        server.url, "patient", patience=Patience(reconnect_s=8.0), on_lost=lost.append
    )
    try:
        server.stop()
        await wait_until(lambda: ("nats_disconnected", "patient") in logs.events("warning"))
        server.start()  # same port, same store
        await wait_until(lambda: nc.is_connected)
        await asyncio.sleep(9.0)  # past reconnect_s: the countdown was cancelled
        assert lost == [] and nc.is_connected
        assert ("nats_reconnected", "patient") in logs.events("info")
    finally:
        await nc.close()
        server.stop()


async def test_first_connect_gives_up_in_time_naming_the_url(logs: Recorder):
    url = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"cannot connect to NATS at {url}: no answer"):
        await connect(url, "hopeful", patience=Patience(first_connect_s=1.0))
    # patience + at most one connect_timeout_s, with room for a loaded machine (a hang guard)
    assert time.monotonic() - t0 < 4 * (1.0 + 5.0)
