"""Weights through the object store on their own connection and thread (`areal.bus.weights`)."""

from __future__ import annotations

import os
import threading

import pytest

from areal.bus.weights import CHUNK_BYTES, THREAD_NAME, WeightsChannel, transfer_timeout_s
from tests.integration.test_bus import make_bus, raw_client

pytestmark = pytest.mark.integration


def _channel_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


async def test_weights_move_on_their_own_connection_in_chunks(nats_url, run_id):
    trainer = await make_bus(nats_url, run_id, role="trainer")
    rollout = await make_bus(nats_url, run_id, role="rollout")
    data = os.urandom(3 * CHUNK_BYTES + 12345)  # four chunks, the last one partial
    ann = await trainer.put_weights(7, data, "float32", step=7)
    got = await rollout.get_weights(ann)
    assert got == data
    async with raw_client(nats_url) as raw:
        obs = await raw.jetstream().object_store(trainer.names.weights_bucket)
        info = await obs.get_info("v7")
    assert info.chunks == 4 and info.size == len(data)
    # the workers' own connections carried the announcement, not the bytes
    assert trainer.connection_stats().out_bytes < len(data) // 10
    assert rollout.connection_stats().in_bytes < len(data) // 10
    assert len(_channel_threads()) >= 2  # one per worker that moved weights
    await trainer.close()
    await rollout.close()


async def test_old_versions_are_deleted_and_a_missing_one_is_a_clear_error(nats_url, run_id):
    bus = await make_bus(nats_url, run_id, weights_keep=2)
    anns = [await bus.put_weights(v, bytes([v]) * 1000, "float32", step=v) for v in range(4)]
    assert await bus.get_weights(anns[3]) == bytes([3]) * 1000
    assert await bus.get_weights(anns[2]) == bytes([2]) * 1000
    with pytest.raises(FileNotFoundError, match="no object v1 in bucket"):
        await bus.get_weights(anns[1])  # only the newest weights_keep versions are kept
    await bus.close()


async def test_close_stops_the_thread_and_a_stopped_channel_refuses(nats_url, run_id):
    bus = await make_bus(nats_url, run_id)
    ch = WeightsChannel(nats_url, "test-weights", bus.names.weights_bucket)
    before = len(_channel_threads())
    await ch.start()
    await ch.put("x", b"abc")
    assert await ch.get("x") == b"abc"
    assert len(_channel_threads()) == before + 1
    await ch.close()
    assert len(_channel_threads()) == before
    with pytest.raises(RuntimeError, match="not started"):
        await ch.get("x")
    await bus.close()


def test_transfer_deadline_grows_with_size():
    assert transfer_timeout_s(0) == 30.0
    assert transfer_timeout_s(10 * 1024**3) > 1000  # 10 GiB: minutes, not the small default
