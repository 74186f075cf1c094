"""The bus against a real nats-server: de-duplication, leases, dead letters, weights, typed
run state, events. Raw protocol (garbage payloads, plain subscriptions) goes through a client
of the test's own (`raw_client`): the bus hands out no nats object."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats.errors
import pytest
from nats.aio.client import Client
from nats.js.errors import NotFoundError
from pydantic import BaseModel

from areal.bus import StateDecodeError
from areal.bus import client as bus_client
from areal.bus.client import Bus, MessageTooLarge
from areal.bus.codec import decode
from areal.bus.connection import connect
from areal.bus.embedded import EmbeddedNats
from areal.config import NatsSettings
from schemas import DeadLetter, Event, Sample, Task, WeightAnnouncement
from schemas import subjects as S
from tests.factories import make_sample, make_task

pytestmark = pytest.mark.integration


async def make_bus(url, run_id, role="test", **nats) -> Bus:
    return await Bus.connect(url, run_id, role, f"{role}-0", NatsSettings(**nats))


@asynccontextmanager
async def raw_client(url: str) -> AsyncIterator[Client]:
    """A plain nats connection of the test's own (to publish garbage, subscribe, inspect)."""
    nc = await connect(url, "test-raw")
    try:
        yield nc
    finally:
        await nc.close()


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
    assert await bus.stream_depth(S.TRAJECTORIES) == 1
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
    assert await bus.stream_depth(S.TRAJECTORIES) == 0  # work queue: acked messages are gone
    await bus.close()


@pytest.mark.parametrize(
    "stage,cls", [(S.PROMPTS, Task), (S.TRAJECTORIES, Sample), (S.REWARDS, Sample)]
)
async def test_malformed_message_goes_to_dead_letter_and_worker_keeps_running(
    nats_url, run_id, stage, cls
):
    bus = await make_bus(nats_url, run_id)
    async with raw_client(nats_url) as raw:
        await _poison_goes_to_dlq(bus, raw, stage, cls)
    await bus.close()


async def _poison_goes_to_dlq(bus: Bus, raw: Client, stage: str, cls: type) -> None:
    dead: list[DeadLetter] = []

    async def on_dlq(msg):
        dead.append(decode(msg.data, DeadLetter))

    await raw.subscribe(bus.names.dlq_subject(stage), cb=on_dlq)
    handled: list[str] = []
    stop = asyncio.Event()

    async def handler(obj, lease):
        handled.append(obj.msg_id())
        await lease.ack()

    consumer = asyncio.create_task(bus.consume(stage, cls, handler, max_inflight=4, stop=stop))
    # published by hand, as a person with the nats CLI would
    await raw.jetstream().publish(bus.names.subject(stage), b"this is not msgpack")
    good = make_sample() if cls is Sample else make_task()
    await bus.publish(stage, good)
    await wait_for(lambda: dead and handled)
    assert dead[0].stage == stage and "not msgpack" in dead[0].reason
    assert dead[0].payload == b"this is not msgpack"
    assert handled == [good.msg_id()]  # the worker carried on
    assert not consumer.done()
    stop.set()
    await consumer
    assert await bus.stream_depth(stage) == 0  # the poison was removed, not redelivered forever
    assert await bus.stream_depth(S.DLQ) == 1


async def test_failing_handler_is_retried_then_dead_lettered(nats_url, run_id):
    bus = await make_bus(nats_url, run_id, max_deliver=2)
    async with raw_client(nats_url) as raw:
        await _handler_failures_dead_letter(bus, raw)
    await bus.close()


async def _handler_failures_dead_letter(bus: Bus, raw: Client) -> None:
    dead: list[DeadLetter] = []

    async def on_dlq(m):
        dead.append(decode(m.data, DeadLetter))

    await raw.subscribe(bus.names.dlq_subject(S.TRAJECTORIES), cb=on_dlq)
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


async def test_a_message_handed_back_past_max_deliver_is_given_up_not_stranded(nats_url, run_id):
    """Workers that stop or die holding a message hand it back without failing: the server
    never stops delivering it (a message it gave up on would sit in the work queue unseen), and
    the bus gives it to the stage's `refuse` on the delivery after `max_deliver`, before the
    handler runs."""
    bus = await make_bus(nats_url, run_id, max_deliver=2)
    seen: list[int] = []
    refused: list[tuple[str, int, str]] = []
    stop = asyncio.Event()

    async def handler(obj, lease):  # as a worker that stops holding it: handed back unhandled
        seen.append(lease.num_delivered)
        await lease.nak()

    async def refuse(obj, lease, reason):
        refused.append((obj.task_id, lease.num_delivered, reason))
        await lease.dead_letter(reason)

    consumer = asyncio.create_task(
        bus.consume(S.TRAJECTORIES, Sample, handler, max_inflight=1, stop=stop, refuse=refuse)
    )
    s = make_sample()
    await bus.publish(S.TRAJECTORIES, s)
    await wait_for(lambda: refused, timeout=15)
    assert seen == [1, 2]
    assert refused[0][:2] == (s.task_id, 3)
    assert "delivered 3 times" in refused[0][2] and "max_deliver=2" in refused[0][2]
    await wait_for(lambda: not bus.held_leases, timeout=5)
    assert await bus.stream_depth(S.TRAJECTORIES) == 0  # removed, not left undelivered
    assert await bus.stream_depth(S.DLQ) == 1
    stop.set()
    await consumer
    await bus.close()


async def test_a_failing_refuse_hands_the_message_back_for_another_try(nats_url, run_id):
    """Giving up needs the bus too (a dead letter, a marker): if that fails, the message is
    handed back and given up on at its next delivery; the consumer keeps running."""
    bus = await make_bus(nats_url, run_id, max_deliver=1)
    tries: list[int] = []
    stop = asyncio.Event()

    async def handler(obj, lease):
        raise RuntimeError("scorer exploded")

    async def refuse(obj, lease, reason):
        tries.append(lease.num_delivered)
        if len(tries) == 1:
            raise nats.errors.TimeoutError
        await lease.dead_letter(reason)

    consumer = asyncio.create_task(
        bus.consume(S.TRAJECTORIES, Sample, handler, max_inflight=1, stop=stop, refuse=refuse)
    )
    await bus.publish(S.TRAJECTORIES, make_sample())
    await wait_for(lambda: len(tries) == 2, timeout=15)
    assert tries == [1, 2]  # the handler's failure at the limit, then the next arrival
    await wait_for(lambda: not bus.held_leases, timeout=5)
    assert await bus.stream_depth(S.DLQ) == 1
    assert not consumer.done()
    stop.set()
    await consumer
    await bus.close()


@pytest.mark.slow  # ~5 s on 2 cores: outlives an ack wait
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
        await bus.publish_raw(bus.names.subject(S.TRAJECTORIES), b"x" * (bus.max_payload + 1))
    await bus.close()


async def test_weights_through_a_shared_directory(nats_url, run_id, tmp_path):
    settings = NatsSettings(weights_keep=2)
    bus = await Bus.connect(nats_url, run_id, "test", "test-0", settings, weights_dir=str(tmp_path))
    for v in range(1, 5):
        ann = await bus.put_weights(v, bytes([v]) * 1000, "float32", step=v, file_dir=str(tmp_path))
    assert ann.uri == f"file://{tmp_path.resolve()}/v4.safetensors"
    assert await bus.get_weights(ann) == bytes([4]) * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3.safetensors", "v4.safetensors"]
    await bus.close()


async def test_latest_weights_is_none_only_before_the_first_announcement(nats_url, run_id):
    """Bug 3: a failed lookup used to read as "no weights yet" (and a restoring trainer then
    started over from its initial weights)."""
    bus = await make_bus(nats_url, run_id)
    assert await bus.latest_weights() is None  # a fresh run: nothing announced
    ann = await bus.put_weights(3, b"w" * 100, "float32", step=3)
    assert await bus.latest_weights() == ann
    async with raw_client(nats_url) as raw:
        await raw.jetstream().delete_stream(bus.names.stream(S.WEIGHTS))
    with pytest.raises(NotFoundError, match="stream not found"):
        await bus.latest_weights()  # the weights stream is gone: an error, not "no weights"
    await bus.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        await bus.latest_weights()


class _Counter(BaseModel):
    admitted: int
    note: str = ""


async def test_run_state_is_typed_and_a_bad_value_is_an_error(nats_url, run_id):
    bus = await make_bus(nats_url, run_id)
    assert await bus.kv_get("controller", _Counter) is None  # never written
    await bus.kv_put("controller", _Counter(admitted=3, note="x"))
    assert await bus.kv_get("controller", _Counter) == _Counter(admitted=3, note="x")
    async with raw_client(nats_url) as raw:  # a value of another shape, written by hand
        kv = await raw.jetstream().key_value(bus.names.state_bucket)
        await kv.put("controller", b'{"admitted": "three"}')
    with pytest.raises(StateDecodeError, match=rf"'controller'.*{bus.names.state_bucket}"):
        await bus.kv_get("controller", _Counter)  # never None for a value that is there
    await bus.close()


async def test_kv_watch_reports_writes_after_it_started(nats_url, run_id):
    bus = await make_bus(nats_url, run_id)
    await bus.kv_put("trainer", _Counter(admitted=1))
    watch = await bus.kv_watch("trainer")
    assert await watch.wait(0.3) is False  # the value current at the start is not a change
    await bus.kv_put("trainer", _Counter(admitted=2))
    assert await watch.wait(10.0) is True
    assert await watch.wait(0.3) is False  # one write, reported once
    await bus.kv_put("other", _Counter(admitted=9))  # another key: not this watch's business
    assert await watch.wait(0.3) is False
    await watch.stop()
    assert await watch.wait(0.3) is False
    await bus.close()


async def test_a_reconnect_retries_at_once_a_request_the_old_server_owed_an_answer(
    nats_url, run_id
):
    """A KV write or read sent just before the server died is never answered; nats-py would
    hold it for its 5 s timeout (the trainer's state write stalled the quickstart ~3 s per
    restart). At the reconnect the bus gives it up and tries it again at once."""
    bus = await make_bus(nats_url, run_id)
    async with raw_client(nats_url) as raw:
        await raw.subscribe(f"silent.{run_id}")  # a responder that never answers
        await raw.flush()
        calls: list[int] = []

        async def op() -> str:
            calls.append(1)
            if len(calls) == 1:  # the request the dead server owed an answer
                await bus._nc.request(f"silent.{run_id}", b"x", timeout=600.0)
            return "answered"

        waiting = asyncio.ensure_future(bus._through_outage(op, "a test request"))
        await wait_for(lambda: len(calls) == 1)
        await asyncio.sleep(0.1)
        assert not waiting.done()
        bus._on_reconnect()  # what the connection's reconnect callback calls
        assert await asyncio.wait_for(waiting, 60.0) == "answered"  # a hang guard
        assert len(calls) == 2
        assert await bus._through_outage(op, "a test request") == "answered"  # no reconnect
        assert len(calls) == 3
    await bus.close()


async def test_a_publish_dropped_without_an_answer_is_retried_after_a_short_first_wait(
    nats_url, run_id, monkeypatch
):
    """A publish that reaches a stream while its cluster elects a new leader gets no answer at
    all. Its first try waits only a fraction of `publish_timeout_s` (here 1 s of 600: the whole
    timeout would trip the hang guard), and the retry, with the same `Nats-Msg-Id`, is acked."""
    monkeypatch.setattr(bus_client, "SHORT_WAIT_PART", 600)
    bus = await make_bus(nats_url, run_id, publish_timeout_s=600.0)
    subject = f"electing.{run_id}"
    tries: list[str] = []

    async def stream_during_an_election(msg) -> None:
        tries.append(msg.headers["Nats-Msg-Id"])
        if len(tries) > 1:  # the leader is elected: the retry is stored and acked
            await msg.respond(json.dumps({"stream": "S", "seq": 7}).encode())

    async with raw_client(nats_url) as raw:
        await raw.subscribe(subject, cb=stream_during_an_election)
        await raw.flush()
        await asyncio.wait_for(bus.publish_raw(subject, b"x", "m-1"), 120.0)  # a hang guard
    assert tries == ["m-1", "m-1"]
    await bus.close()


async def test_kv_watch_outlives_a_server_restart(tmp_path, run_id):
    """The watch reads the key's writes by sequence (direct gets, no consumer on the server):
    a SIGKILLed and restarted server delays a report, and the first write after the restart is
    reported once, not after any heartbeat timeout (the controller admits a batch or two per
    second)."""
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        bus = await make_bus(server.url, run_id)
        await bus.kv_put("trainer", _Counter(admitted=1))
        watch = await bus.kv_watch("trainer")
        assert await watch.wait(0.3) is False  # the value current at the start is no change
        await bus.kv_put("trainer", _Counter(admitted=2))
        assert await watch.wait(10.0) is True
        server.proc.kill()
        server.proc.wait()
        server.start()  # same port, same store
        await wait_for(lambda: bus.reconnects == 1, timeout=60.0)
        await bus.kv_put("trainer", _Counter(admitted=3))
        assert await watch.wait(60.0) is True  # the write after the restart
        assert await watch.wait(0.3) is False  # reported once
        assert (await bus.kv_get("trainer", _Counter)).admitted == 3
        await watch.stop()
        await bus.close()
    finally:
        server.stop()


async def test_weight_announcements_resume_at_once_after_a_server_restart(tmp_path, run_id):
    """The rollout learns of new versions by following the weights stream by sequence (no
    consumer to lose with the server): each announcement once, in order, whether it was
    published before, during or after a server restart."""
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        bus = await make_bus(server.url, run_id)
        seen: list[int] = []

        async def on_weights(ann: WeightAnnouncement) -> None:
            seen.append(ann.version)

        sub = await bus.subscribe_weights(on_weights)
        await bus.put_weights(1, b"x" * 64, "float32", step=1)
        await wait_for(lambda: 1 in seen, timeout=60.0)
        server.proc.kill()
        server.proc.wait()
        server.start()  # same port, same store
        await wait_for(lambda: bus.reconnects == 1, timeout=60.0)
        await bus.put_weights(2, b"y" * 64, "float32", step=2)
        await wait_for(lambda: 2 in seen, timeout=60.0)
        assert seen == [1, 2]  # once each, in order
        await sub.unsubscribe()
        await bus.close()
    finally:
        server.stop()


async def test_watches_and_followers_make_no_consumer_on_the_server(nats_url, run_id):
    """No role may create a consumer (`areal.bus.nats_config`): a KV watch, the weights
    subscription and a metrics replay leave every stream of the run without one beyond the
    stages' durables. `reopen` (a caller read a write not reported yet) makes the next wait
    say True at once."""
    bus = await make_bus(nats_url, run_id)
    await bus.kv_put("trainer", _Counter(admitted=1))
    watch = await bus.kv_watch("trainer")

    async def ignore(_x) -> None:
        return None

    weights = await bus.subscribe_weights(ignore)
    metrics = await bus.subscribe_metrics("rollout", "eval", ignore, replay=True)
    async with raw_client(nats_url) as raw:
        js = raw.jetstream()
        names = [bus.names.stream(s) for s in S.ALL_STREAMS] + [f"KV_{bus.names.state_bucket}"]
        for name in names:
            expected = 1 if any(name == bus.names.stream(s) for s in S.CONSUMER_OF) else 0
            assert (await js.stream_info(name)).state.consumer_count == expected, name
    watch.reopen()
    assert await watch.wait(0.0) is True and watch.reopened == 1
    assert await watch.wait(0.3) is False
    await watch.stop()
    await weights.unsubscribe()
    await metrics.unsubscribe()
    await bus.close()


async def test_subscribe_events_delivers_typed_events_and_skips_garbage(nats_url, run_id):
    bus = await make_bus(nats_url, run_id)
    got: list[Event] = []

    async def on_event(ev: Event) -> None:
        got.append(ev)

    sub = await bus.subscribe_events("run_finished", on_event)
    async with raw_client(nats_url) as raw:
        await raw.publish(bus.names.events_subject("run_finished"), b"not an event")
        await raw.flush()
    await bus.event("task_dropped", task_id="t1")  # another kind: not delivered here
    await bus.event("run_finished", step=7)
    await wait_for(lambda: got)
    assert [(e.type, e.detail) for e in got] == [("run_finished", {"step": 7})]
    await sub.unsubscribe()
    assert await bus.stream_depth(S.EVENTS) == 3  # all three were stored in the events stream
    await bus.close()
