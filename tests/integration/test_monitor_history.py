"""`areal tap` history and peeking against a real nats-server (no pipeline: messages are
published by hand, as any worker would)."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import BaseModel

from areal.bus.client import Bus
from areal.bus.embedded import EmbeddedNats
from areal.bus.tap import TapClient, discover_run, list_runs
from areal.cli import main
from schemas import MetricRecord, SampleGroup
from schemas import subjects as S
from tests.factories import make_sample
from tests.integration.test_bus import raw_client

pytestmark = pytest.mark.integration


async def tap_cli(capsys, *argv: str) -> tuple[int, list[str]]:
    rc = await asyncio.to_thread(main, ["tap", *argv])
    return rc, capsys.readouterr().out.splitlines()


@pytest.mark.slow  # ~6 s on 2 cores: a CLI in a subprocess
async def test_history_replays_the_last_n_then_follows_live(nats_url, run_id, capsys):
    bus = await Bus.connect(nats_url, run_id, "trainer", "trainer-0")
    for step in range(1, 6):
        await bus.metric("step", {"step": step, "reward_mean": step / 10})
        await bus.metric("heartbeat", {"busy_frac": 0.5})
    conn = ("--run", run_id, "--nats-url", nats_url, "--timeout", "10")
    rc, lines = await tap_cli(
        capsys, "metrics.trainer.step", "--history", "2", "--count", "2", "--fields", "step", *conn
    )
    assert rc == 0 and lines == ["metric step=4", "metric step=5"]  # last 2 of the step subject
    rc, lines = await tap_cli(capsys, "metrics", "--history", "3", "--count", "3", "--json", *conn)
    recs = [json.loads(line) for line in lines]
    assert [(r["type"], r["values"].get("step")) for r in recs] == [
        ("heartbeat", None),
        ("step", 5),
        ("heartbeat", None),
    ]  # last 3 of the whole stream
    assert [r["seq"] for r in recs] == [8, 9, 10]

    async def publish_later():
        await asyncio.sleep(1.5)
        await bus.metric("step", {"step": 6})

    later = asyncio.ensure_future(publish_later())
    rc, lines = await tap_cli(
        capsys, "metrics.trainer.step", "--history", "1", "--count", "2", "--fields", "step", *conn
    )
    await later
    assert rc == 0 and lines == ["metric step=5", "metric step=6"]  # history, then live
    await bus.close()


async def test_work_queue_history_is_a_peek_that_consumes_nothing(nats_url, run_id, capsys):
    bus = await Bus.connect(nats_url, run_id, "rollout", "rollout-0")
    for i in range(3):
        part = SampleGroup(samples=[make_sample(task_id=f"{run_id}-t{i}")])  # 1 of G = 4
        await bus.publish(S.TRAJECTORIES, part)
    rc, lines = await tap_cli(
        capsys,
        "trajectories",
        "--history",
        "2",
        "--count",
        "2",
        "--run",
        run_id,
        "--nats-url",
        nats_url,
        "--timeout",
        "10",
    )
    assert rc == 0
    assert [line.split()[1] for line in lines] == [f"{run_id}-t1/1", f"{run_id}-t2/1"]
    client = await TapClient.connect(nats_url, run_id)
    stats = (await client.stream_stats())[S.TRAJECTORIES]
    await client.close()
    assert stats.messages == 3 and stats.consumers == 1  # still all there, no consumer added
    await bus.close()


async def test_count_not_reached_times_out_with_rc_1(nats_url, run_id, capsys):
    bus = await Bus.connect(nats_url, run_id, "trainer", "trainer-0")
    rc, lines = await tap_cli(
        capsys,
        "events",
        "--count",
        "1",
        "--timeout",
        "0.5",
        "--run",
        run_id,
        "--nats-url",
        nats_url,
    )
    assert rc == 1 and lines == []
    await bus.close()


async def test_unknown_run_and_stream_errors_name_the_fix(nats_url, run_id, capsys):
    rc = await asyncio.to_thread(
        main, ["tap", "metrics", "--run", "nope-run", "--nats-url", nats_url]
    )
    assert rc == 2 and "pass --run ID" in capsys.readouterr().err
    rc = await asyncio.to_thread(main, ["tap", "bogus", "--run", run_id, "--nats-url", nats_url])
    assert rc == 2 and "unknown stream 'bogus'" in capsys.readouterr().err
    with pytest.raises(LookupError, match="pass --run ID|no areal run"):
        await discover_run(nats_url)  # the session server holds several runs (or none)


async def test_stream_stats_and_kv_state(nats_url, run_id):
    bus = await Bus.connect(nats_url, run_id, "controller", "controller-0")
    await bus.publish(S.PROMPTS, make_sample())  # any payload: stats only count
    await bus.kv_put("controller", _ControllerState(admitted=3, cursor=3))
    await bus.publish_raw(bus.names.dlq_subject("rewards"), b"x")
    client = await TapClient.connect(nats_url, run_id)
    stats = await client.stream_stats()
    assert set(stats) == set(S.ALL_STREAMS)
    assert stats["prompts"].messages == 1 and stats["prompts"].pending == 1
    assert stats["dlq"].subjects == {bus.names.dlq_subject("rewards"): 1}
    assert (await client.kv_state()) == {"controller": {"admitted": 3, "cursor": 3}}
    await client.close()
    await bus.close()


class _ControllerState(BaseModel):
    """Any pydantic model: the tap reads the bucket back as JSON objects."""

    admitted: int
    cursor: int


async def test_discover_run_reads_run_ids_back_from_stream_names(tmp_path):
    """`list_runs` inverts `RunNames.stream`: ids with `-` and `_` come back as they are, and a
    stream with an areal-looking name but foreign subjects is not taken for a run."""
    with EmbeddedNats(store_dir=tmp_path / "nats") as server:
        buses = [await Bus.connect(server.url, rid, "trainer", "t-0") for rid in ("run-a", "run_a")]
        async with raw_client(server.url) as raw:
            js = raw.jetstream()
            assert await list_runs(raw) == ["run-a", "run_a"]
            await js.add_stream(name="AREAL_LOOKS-LIKE_METRICS", subjects=["elsewhere.>"])
            assert await list_runs(raw) == ["run-a", "run_a"]
            for name in ("AREAL_RUN-A_PROMPTS", "AREAL_RUN-A_TRAJECTORIES", "AREAL_RUN-A_REWARDS"):
                await js.delete_stream(name)  # a run is found by its metrics stream
            await js.delete_stream("AREAL_RUN_A_METRICS")
            assert await list_runs(raw) == ["run-a"]
        assert await discover_run(server.url) == "run-a"
        for bus in buses:
            await bus.close()


def test_metric_record_time_is_what_state_uses():
    # guards the assumption the monitors make: heartbeats carry the publisher's clock
    assert MetricRecord(role="r", worker_id="w", type="heartbeat").time > 0
