"""Follows (`areal tap --history`, `areal top`, the trainer's eval records, KV watches, the
weights subscription) read a stream by sequence with batched direct gets, woken by a core
subscription (`areal.bus.follow`): no consumer on the server to lose at a restart, each record
delivered once and in order, across batches, restarts and extra reads.
"""

from __future__ import annotations

import asyncio

import pytest

from areal.bus.codec import decode
from areal.bus.embedded import EmbeddedNats
from areal.bus.tap import TapClient, TapMessage
from schemas import MetricRecord
from tests.integration.test_bus import make_bus, wait_for

pytestmark = pytest.mark.integration


def _steps(messages: list[TapMessage]) -> list[int]:
    return [decode(m.data, MetricRecord).values["step"] for m in messages]


async def test_a_tap_with_history_resumes_where_it_left_off_after_a_server_restart(
    tmp_path, run_id
):
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        bus = await make_bus(server.url, run_id, role="trainer")
        for step in (1, 2, 3):  # history the tap replays
            await bus.metric("step", {"step": step})
        tap = await TapClient.connect(server.url, run_id)
        got: list[TapMessage] = []

        async def on_msg(msg: TapMessage) -> None:
            got.append(msg)

        await tap.follow("metrics.trainer.step", on_msg, history=-1)
        await bus.metric("step", {"step": 4})
        await wait_for(lambda: len(got) == 4, timeout=60.0)

        server.proc.kill()  # SIGKILL: the ordered consumer goes with it
        server.proc.wait()
        server.start()  # same port, same store
        await wait_for(lambda: tap._nc.stats["reconnects"] == 1, timeout=60.0)
        for step in (5, 6):
            await bus.metric("step", {"step": step})
        await wait_for(lambda: len(got) >= 6, timeout=60.0)
        await asyncio.sleep(0.3)  # a repeat would land now
        assert _steps(got) == [1, 2, 3, 4, 5, 6]
        seqs = [m.stream_seq for m in got]
        assert seqs == sorted(set(seqs))
        assert not tap.lost.is_set()
        await tap.close()
        await bus.close()
    finally:
        server.stop()


async def test_extra_reads_mid_stream_pass_each_record_once_across_batches(nats_url, run_id):
    """Reads woken by the doorbell, by `renew_soon` (what a reconnect calls) and by the idle
    poll overlap while 600 records (over two direct-get batches) are published: each sequence
    is passed on once, in stream order."""
    bus = await make_bus(nats_url, run_id, role="trainer")
    tap = await TapClient.connect(nats_url, run_id)
    got: list[TapMessage] = []

    async def on_msg(msg: TapMessage) -> None:
        got.append(msg)

    await bus.metric("step", {"step": 0})
    await tap.follow("metrics.trainer.step", on_msg, history=-1)
    (sub,) = tap._followers
    publishing = asyncio.ensure_future(
        asyncio.gather(*(bus.metric("step", {"step": s}) for s in range(1, 601)))
    )
    await wait_for(lambda: len(got) >= 20, timeout=60.0)
    for _ in range(5):
        sub.renew_soon()
        await asyncio.sleep(0)
    await publishing
    await wait_for(lambda: len(got) >= 601, timeout=60.0)
    await asyncio.sleep(0.3)  # a repeat would land now
    assert sorted(_steps(got)) == list(range(601))
    seqs = [m.stream_seq for m in got]
    assert seqs == sorted(set(seqs))  # once each, in stream order
    await tap.close()
    await bus.close()


async def test_a_filtered_history_replays_the_last_n_then_goes_live(nats_url, run_id):
    """`areal tap metrics.trainer.step --history 2` on a stream that also holds other
    subjects: the last two matching records, then the new ones."""
    trainer = await make_bus(nats_url, run_id, role="trainer")
    rollout = await make_bus(nats_url, run_id, role="rollout")
    for step in range(1, 6):
        await trainer.metric("step", {"step": step})
        await rollout.metric("heartbeat", {"step": -step})
    tap = await TapClient.connect(nats_url, run_id)
    got: list[TapMessage] = []

    async def on_msg(msg: TapMessage) -> None:
        got.append(msg)

    await tap.follow("metrics.trainer.step", on_msg, history=2)
    await wait_for(lambda: len(got) == 2, timeout=60.0)
    assert all(m.replayed or m is got[-1] for m in got)
    await trainer.metric("step", {"step": 6})
    await wait_for(lambda: len(got) == 3, timeout=60.0)
    assert _steps(got) == [4, 5, 6] and not got[-1].replayed
    await tap.close()
    await trainer.close()
    await rollout.close()


async def test_the_bus_metrics_replay_resumes_after_a_server_restart(tmp_path, run_id):
    """The trainer follows the rollout's eval records with a replay: after a restart it gets
    the records published since, once each, without waiting for nats-py's heartbeat reset."""
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        bus = await make_bus(server.url, run_id, role="rollout")
        await bus.metric("eval", {"step": 1})
        seen: list[int] = []

        async def on_eval(rec: MetricRecord) -> None:
            seen.append(rec.values["step"])

        sub = await bus.subscribe_metrics("rollout", "eval", on_eval, replay=True)
        await wait_for(lambda: seen == [1], timeout=60.0)
        server.proc.kill()
        server.proc.wait()
        server.start()
        await wait_for(lambda: bus.reconnects == 1, timeout=60.0)
        await bus.metric("eval", {"step": 2})
        await wait_for(lambda: len(seen) >= 2, timeout=60.0)
        await asyncio.sleep(0.3)
        assert seen == [1, 2]
        await sub.unsubscribe()
        await bus.close()
    finally:
        server.stop()
