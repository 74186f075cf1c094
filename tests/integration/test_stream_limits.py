"""Stream limits sized to the run: several runs share a server with a 2 GB JetStream limit.

nats-server reserves a stream's `max_bytes` against its `max_file_store` when the stream is
created, used or not (`reserved_storage` in its `/jsz` monitoring page). The old sizing (three
history streams at 512 MiB each) reserved 1.5 GiB per run, so the second run on a 2 GiB server
failed with error 10047; the default now reserves nothing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from areal.bus.client import Bus
from areal.bus.embedded import EmbeddedNats, free_port
from areal.bus.streams import StorageLimitError
from areal.config import NatsSettings
from schemas import subjects as S
from schemas.state import TrainerState
from tests.factories import make_sample, make_task
from tests.integration.test_bus import raw_client

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TWO_GIB = 2 * 1024**3
OLD_HISTORY_MAX_BYTES = 512 * 1024 * 1024


@dataclass
class SmallServer:
    server: EmbeddedNats
    monitor_port: int

    @property
    def url(self) -> str:
        return self.server.url

    def reserved_storage(self) -> int:
        """Bytes of file storage the server has reserved for streams' `max_bytes` (/jsz)."""
        url = f"http://127.0.0.1:{self.monitor_port}/jsz"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(json.load(resp)["reserved_storage"])


@pytest.fixture
def small_server(tmp_path: Path) -> Iterator[SmallServer]:
    monitor_port = free_port()
    with EmbeddedNats(
        tmp_path / "nats",
        extra_conf=f"http: 127.0.0.1:{monitor_port}\n",
        max_file_store_bytes=TWO_GIB,
    ) as server:
        yield SmallServer(server, monitor_port)


async def use_every_stream(bus: Bus) -> None:
    """Publish into every stream of the run, the KV bucket and the object store."""
    await bus.publish(S.PROMPTS, make_task(task_id=f"{bus.names.run_id}-t0"))
    await bus.publish(S.TRAJECTORIES, make_sample(task_id=f"{bus.names.run_id}-t0"))
    await bus.publish(S.REWARDS, make_sample(task_id=f"{bus.names.run_id}-t1"))
    await bus.put_weights(1, b"\0" * 4096, "float32", step=1)
    await bus.metric("step", {"step": 1, "reward_mean": 0.5})
    await bus.event("run_started")
    await bus.publish_raw(bus.names.dlq_subject("rewards"), b"poison", msg_id="dl-1")
    await bus.kv_put("trainer", TrainerState(step=1))


async def depths(bus: Bus) -> dict[str, int]:
    return {stream: await bus.stream_depth(stream) for stream in S.ALL_STREAMS}


async def test_two_runs_fit_on_a_server_with_a_2gb_limit(small_server):
    buses = [await Bus.connect(small_server.url, rid, "trainer", "t-0") for rid in ("a1", "b2")]
    try:
        for bus in buses:
            await use_every_stream(bus)
        for bus in buses:
            assert await depths(bus) == {stream: 1 for stream in S.ALL_STREAMS}
            assert (await bus.kv_get("trainer", TrainerState)) == TrainerState(step=1)
        assert small_server.reserved_storage() == 0  # no stream of either run reserves
        async with raw_client(small_server.url) as raw:
            for info in await raw.jetstream().streams_info():
                assert info.config.max_bytes == -1, info.config.name
    finally:
        for bus in buses:
            await bus.close()


async def test_history_streams_discard_the_oldest_per_subject(small_server):
    settings = NatsSettings(history_max_msgs_per_subject=3)
    bus = await Bus.connect(small_server.url, "capped", "trainer", "t-0", settings)
    try:
        for step in range(1, 6):
            await bus.metric("step", {"step": step})
        await bus.metric("heartbeat", {"busy_frac": 0.5})
        # 3 step records left (the newest) + 1 heartbeat: subjects are capped separately
        assert await bus.stream_depth(S.METRICS) == 4
    finally:
        await bus.close()


async def test_the_old_sizing_fills_the_server_and_says_how_to_fix_it(small_server):
    old = NatsSettings(history_max_bytes=OLD_HISTORY_MAX_BYTES)
    first = await Bus.connect(small_server.url, "old-1", "trainer", "t-0", old)
    assert small_server.reserved_storage() == 3 * OLD_HISTORY_MAX_BYTES
    with pytest.raises(StorageLimitError) as err:
        await Bus.connect(small_server.url, "old-2", "trainer", "t-0", old)
    msg = str(err.value)
    assert "error 10047" in msg and "nats.history_max_bytes" in msg and "max_file_store" in msg
    # redeclared with the defaults, both runs (the second's streams that did fit included)
    # drop their reservations and work side by side
    again = await Bus.connect(small_server.url, "old-1", "trainer", "t-1")
    second = await Bus.connect(small_server.url, "old-2", "trainer", "t-0")
    assert small_server.reserved_storage() == 0
    try:
        for bus in (again, second):
            await use_every_stream(bus)
        assert await depths(second) == {stream: 1 for stream in S.ALL_STREAMS}
    finally:
        for bus in (first, again, second):
            await bus.close()


async def _areal_run(url: str, run_id: str, out: Path) -> tuple[int, str]:
    """A short `areal run` of the quickstart example against the server at `url`."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "areal.cli",
        "run",
        str(REPO / "examples" / "arithmetic.yaml"),
        "--nats-url",
        url,
        "--set",
        f"run_id={run_id}",
        "--set",
        "train.total_steps=3",
        "--quiet",
        "--out",
        str(out),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(proc.communicate(), 800)  # hang guard
    assert proc.returncode is not None
    return proc.returncode, output.decode()


@pytest.mark.e2e
@pytest.mark.slow  # two real 4-process runs side by side: ~40 s on 2 cores (minutes when busy)
@pytest.mark.timeout(900)
async def test_two_areal_runs_at_once_on_a_server_with_a_2gb_limit(small_server, tmp_path):
    runs = {"first": tmp_path / "first", "second": tmp_path / "second"}
    results = await asyncio.gather(
        *(_areal_run(small_server.url, rid, out) for rid, out in runs.items())
    )
    for (rc, output), out in zip(results, runs.values(), strict=True):
        assert rc == 0, output[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["in_flight"] == 0
        # a good run shuts down quietly: no connection warnings from the launcher or a worker
        logs = [output] + [p.read_text() for p in (out / "logs").glob("*.log")]
        assert not [log for log in logs if "nats_disconnected" in log]
    assert small_server.reserved_storage() == 0
