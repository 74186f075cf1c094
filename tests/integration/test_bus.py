"""The bus against a real nats-server: de-duplication, leases, dead letters, weights."""

from __future__ import annotations

import asyncio

import pytest

from areal.bus.client import Bus, MessageTooLarge
from areal.bus.codec import decode
from areal.bus.streams import BusOptions
from schemas import DeadLetter, Sample, Task, WeightAnnouncement
from schemas import subjects as S
from tests.factories import make_sample

pytestmark = pytest.mark.integration


async def make_bus(url, run_id, role="test", **opts) -> Bus:
    return await Bus.connect(url, run_id, role, f"{role}-0", BusOptions(**opts))


async def wait_for(pred, timeout=10.0):
    async def loop():
        while not pred():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(loop(), timeout)


async def test_publish_is_deduplicated_by_msg_id(nats_url, run_id):
    bus = await make_bus(nats_url, run_id)
    s = make_sample()
    for _ in range(3):
        await bus.publish(S.TRAJECTORIES, s)
    info = await bus.js.stream_info(bus.names.stream(S.TRAJECTORIES))
    assert info.state.messages == 1
    await bus.close()


async def test_consume_acks_and_handles_each_message_once(nats_url, run_id):
    bus = await make_bus(nats_url, run_id)
    for i in range(5):
        await bus.publish(
            S.TRAJECTORIES,
            make_sample(sample_idx=i % 4, task_id=f"t{i}"),
        )
    seen: list[str] = []
    stop = asyncio.Event()

    async def handler(sample, lease):
        seen.append(sample.sample_id)
        await lease.ack()

    consumer = asyncio.create_task(
        bus.consume(S.TRAJECTORIES, Sample, handler, max_inflight=2, stop=stop)
    )
    await wait_for(lambda: len(seen) == 5)
    stop.set()
    await consumer
    assert len(set(seen)) == 5
    info = await bus.js.stream_info(bus.names.stream(S.TRAJECTORIES))
    assert info.state.messages == 0  # work queue: acked messages are gone
    await bus.close()


@pytest.mark.parametrize(
    "stage,cls", [(S.PROMPTS, Task), (S.TRAJECTORIES, Sample), (S.REWARDS, Sample)]
)
async def test_malformed_message_goes_to_dead_letter_and_worker_keeps_running(
    nats_url, run_id, stage, cls
):
    bus = await make_bus(nats_url, run_id)
    watcher = await make_bus(nats_url, run_id, role="watch")
    dead: list[DeadLetter] = []

    async def on_dlq(msg):
        dead.append(decode(msg.data, DeadLetter))

    await watcher.nc.subscribe(bus.names.dlq_subject(stage), cb=on_dlq)
    handled: list[str] = []
    stop = asyncio.Event()

    async def handler(obj, lease):
        handled.append(obj.msg_id())
        await lease.ack()

    consumer = asyncio.create_task(bus.consume(stage, cls, handler, max_inflight=4, stop=stop))
    # published by hand, as a person with the nats CLI would
    await bus.js.publish(bus.names.subject(stage), b"this is not msgpack")
    good = (
        make_sample()
        if cls is Sample
        else Task(
            task_id="t-good",
            seq=0,
            dataset_index=0,
            prompt="1+1=",
            prompt_ids=make_sample().prompt_ids,
            answer="2",
            group_size=2,
            admitted_version=0,
        )
    )
    await bus.publish(stage, good)
    await wait_for(lambda: dead and handled)
    assert dead[0].stage == stage and "not msgpack" in dead[0].reason
    assert dead[0].payload == b"this is not msgpack"
    assert handled == [good.msg_id()]  # the worker carried on
    assert not consumer.done()
    stop.set()
    await consumer
    info = await bus.js.stream_info(bus.names.stream(stage))
    assert info.state.messages == 0  # the poison message was removed, not redelivered forever
    await bus.close()
    await watcher.close()


async def test_failing_handler_is_retried_then_dead_lettered(nats_url, run_id):
    bus = await make_bus(nats_url, run_id, max_deliver=2)
    dead: list[DeadLetter] = []

    async def on_dlq(m):
        dead.append(decode(m.data, DeadLetter))

    await bus.nc.subscribe(bus.names.dlq_subject(S.TRAJECTORIES), cb=on_dlq)
    attempts: list[int] = []
    stop = asyncio.Event()

    async def handler(obj, lease):
        attempts.append(lease.num_delivered)
        raise RuntimeError("scorer exploded")

    consumer = asyncio.create_task(
        bus.consume(S.TRAJECTORIES, Sample, handler, max_inflight=1, stop=stop)
    )
    await bus.publish(S.TRAJECTORIES, make_sample())
    await wait_for(lambda: dead, timeout=15)
    assert attempts == [1, 2]
    assert "scorer exploded" in dead[0].reason
    stop.set()
    await consumer
    await bus.close()


async def test_lease_heartbeat_prevents_redelivery_of_long_work(nats_url, run_id):
    bus = await make_bus(nats_url, run_id, ack_wait_s=1.5)
    await bus.publish(S.TRAJECTORIES, make_sample())
    deliveries: list[int] = []
    stop = asyncio.Event()

    async def slow(obj, lease):
        deliveries.append(lease.num_delivered)
        await asyncio.sleep(4.0)  # > 2x ack_wait: only in_progress keeps it ours
        await lease.ack()

    consumer = asyncio.create_task(
        bus.consume(S.TRAJECTORIES, Sample, slow, max_inflight=4, stop=stop)
    )
    await wait_for(lambda: deliveries)
    await asyncio.sleep(4.5)
    stop.set()
    await consumer
    assert deliveries == [1]
    await bus.close()


async def test_unacked_work_comes_back_after_close(nats_url, run_id):
    """A worker that stops mid-task hands the task back (nak); another replica gets it."""
    a = await make_bus(nats_url, run_id, role="a")
    await a.publish(S.TRAJECTORIES, make_sample())
    got = asyncio.Event()
    stop_a = asyncio.Event()

    async def hold(obj, lease):
        got.set()  # never settles

    ca = asyncio.create_task(a.consume(S.TRAJECTORIES, Sample, hold, max_inflight=1, stop=stop_a))
    await asyncio.wait_for(got.wait(), 10)
    stop_a.set()
    await ca
    await a.close()
    b = await make_bus(nats_url, run_id, role="b")
    again: list[int] = []
    stop_b = asyncio.Event()

    async def take(obj, lease):
        again.append(lease.num_delivered)
        await lease.ack()

    cb = asyncio.create_task(b.consume(S.TRAJECTORIES, Sample, take, max_inflight=1, stop=stop_b))
    await wait_for(lambda: again, timeout=10)
    assert again == [2]
    stop_b.set()
    await cb
    await b.close()


async def test_weights_roundtrip_and_digest_check(nats_url, run_id):
    bus = await make_bus(nats_url, run_id)
    data = bytes(range(256)) * 5000
    ann = await bus.put_weights(1, data, "float32", step=1)
    assert ann.nbytes == len(data)
    assert await bus.get_weights(ann) == data
    assert (await bus.latest_weights()).version == 1
    bad = WeightAnnouncement(**{**ann.model_dump(by_alias=True), "sha256": "0" * 64})
    with pytest.raises(ValueError, match="failed verification"):
        await bus.get_weights(bad)
    await bus.close()


async def test_oversized_message_is_refused_with_a_clear_error(nats_url, run_id):
    bus = await make_bus(nats_url, run_id)
    with pytest.raises(MessageTooLarge, match="max_payload"):
        await bus.publish_raw(bus.names.subject(S.TRAJECTORIES), b"x" * (bus.nc.max_payload + 1))
    await bus.close()


async def test_weights_through_a_shared_directory(nats_url, run_id, tmp_path):
    bus = await make_bus(nats_url, run_id, weights_keep=2)
    for v in range(1, 5):
        ann = await bus.put_weights(v, bytes([v]) * 1000, "float32", step=v, file_dir=str(tmp_path))
    assert ann.uri == f"file://{tmp_path.resolve()}/v4.safetensors"
    assert await bus.get_weights(ann) == bytes([4]) * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3.safetensors", "v4.safetensors"]
    await bus.close()
