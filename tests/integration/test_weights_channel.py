"""Weights through the object store on their own connection and thread (`areal.bus.weights`)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from areal.bus import weights
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


class SlowBlob:
    """8 chunks produced at ~5 MiB/s (a big model cast off the GPU as it streams); `started`
    is set once `at_chunk` chunks were handed out, `calls` counts the uploads that read it."""

    nbytes = 8 * CHUNK_BYTES

    def __init__(self, at_chunk: int = 3) -> None:
        self.started, self.at_chunk, self.calls = threading.Event(), at_chunk, 0

    def chunks(self) -> Iterator[bytes]:
        self.calls += 1
        for i in range(8):
            if i == self.at_chunk:
                self.started.set()
            time.sleep(0.2)
            yield bytes([i]) * CHUNK_BYTES


async def _bucket_messages(bus) -> int:
    """Messages in the run's weights bucket: its objects' chunks and one meta per object."""
    return (await bus._js.stream_info(f"OBJ_{bus.names.weights_bucket}")).state.messages


async def _until(pred, timeout_s: float = 15.0) -> None:
    async def loop() -> None:
        while not await pred():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(loop(), timeout_s)


async def test_a_reconnect_of_the_bus_does_not_restart_an_upload(nats_url, run_id):
    """The bytes move on the weights' own connection: a reconnect of the bus's connection
    neither gives the upload up nor streams the blob again (once a 12 MiB bucket for 8 MiB)."""
    bus = await make_bus(nats_url, run_id, role="trainer")
    try:
        blob = SlowBlob()
        put = asyncio.ensure_future(bus.put_weights(1, blob, "float32", step=1))
        await asyncio.to_thread(blob.started.wait, 10.0)
        bus._on_reconnect()  # what the connection's reconnect callback calls
        ann = await asyncio.wait_for(put, 60)
        assert ann.nbytes == blob.nbytes and blob.calls == 1
        assert await _bucket_messages(bus) == 8 + 1  # the object's chunks and its meta
    finally:
        await bus.close()


async def test_a_cancelled_upload_leaves_no_chunks_behind(nats_url, run_id):
    """A caller that gives an upload up (a shutdown, a retry) takes its chunks with it: no
    object names them, so nothing else would ever delete them."""
    bus = await make_bus(nats_url, run_id)
    ch = WeightsChannel(nats_url, "test-weights", bus.names.weights_bucket)
    await ch.start()
    try:
        blob = SlowBlob()
        put = asyncio.ensure_future(ch.put("v1", blob))
        await asyncio.to_thread(blob.started.wait, 10.0)
        await _until(lambda: _no_fewer(bus, 2))  # some chunks are stored
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        await _until(lambda: _no_more(bus, 0))  # purged on the channel's loop
        await ch.put("v1", SlowBlob())  # the retry: all the bucket holds is its object
        assert await _bucket_messages(bus) == 8 + 1
        assert await ch.get("v1") == b"".join(SlowBlob().chunks())
    finally:
        await ch.close()
        await bus.close()


async def test_an_upload_past_its_deadline_leaves_no_chunks_behind(nats_url, run_id, monkeypatch):
    monkeypatch.setattr(weights, "transfer_timeout_s", lambda nbytes: 0.7)
    bus = await make_bus(nats_url, run_id)
    ch = WeightsChannel(nats_url, "test-weights", bus.names.weights_bucket)
    await ch.start()
    try:
        with pytest.raises(TimeoutError, match="took over"):
            await ch.put("v1", SlowBlob())  # ~3 of its 8 chunks stored by the deadline
        assert await _bucket_messages(bus) == 0  # purged before the error was raised
    finally:
        await ch.close()
        await bus.close()


async def test_closing_during_an_upload_ends_it_and_purges_its_chunks(nats_url, run_id):
    bus = await make_bus(nats_url, run_id)
    ch = WeightsChannel(nats_url, "test-weights", bus.names.weights_bucket)
    await ch.start()
    try:
        blob = SlowBlob()
        put = asyncio.ensure_future(ch.put("v1", blob))
        await asyncio.to_thread(blob.started.wait, 10.0)
        await _until(lambda: _no_fewer(bus, 2))
        await ch.close()  # the purge runs before the connection closes
        assert await _bucket_messages(bus) == 0
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(put, 5)  # ended, not left waiting forever
    finally:
        await bus.close()


async def _no_fewer(bus, n: int) -> bool:
    return await _bucket_messages(bus) >= n


async def _no_more(bus, n: int) -> bool:
    return await _bucket_messages(bus) <= n


async def test_a_start_given_up_during_an_outage_leaves_no_thread_or_connection():
    """The connect retries forever: a caller that stops waiting must not leave it running (the
    next start would make a second channel beside it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    before = len(_channel_threads())
    ch = WeightsChannel(f"nats://127.0.0.1:{port}", "test-weights", "nowhere")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(ch.start(), 1.0)
    await _until(lambda: _threads_back_to(before))
    with pytest.raises(RuntimeError, match="not started"):
        await ch.get("x")


async def _threads_back_to(n: int) -> bool:
    return len(_channel_threads()) == n
