"""JetStream spoken directly (`areal.bus.jetstream`), against a real nats-server.

Pull consumer: the in-flight bound holds while messages trickle in, expired pull requests are
renewed, and delivered but unhandled messages are handed back at once when a worker stops.
Publish acks: the stream's sequence comes back, and a missing stream, a refused message and a
silent responder each raise the error the bus's retry loop expects."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from structlog.testing import capture_logs

from areal.bus import client
from areal.bus.codec import encode
from areal.bus.jetstream import PublishAcks, PullInbox
from schemas import Sample
from schemas import subjects as S
from tests.factories import make_sample
from tests.integration.test_bus import make_bus, raw_client, wait_for

pytestmark = pytest.mark.integration


def sample(i: int) -> Sample:
    return make_sample(sample_idx=0, task_id=f"t{i}")


def acking_handler(seen: list[str]):
    """A handler that records each sample's task id and acks it."""

    async def handler(s, lease):
        seen.append(s.task_id)
        await lease.ack()

    return handler


def pull_trouble(logs: list[dict]) -> list[dict]:
    """Log events of a pull request presumed lost or ended by an unexpected status."""
    return [e for e in logs if e["event"] in ("pull_requests_lost", "pull_status")]


async def test_inflight_bound_holds_while_messages_trickle_in(nats_url, run_id):
    bus = await make_bus(nats_url, run_id)
    held, peak, seen = [], 0, []
    stop = asyncio.Event()

    async def hold(s, lease):
        nonlocal peak
        seen.append(s.task_id)
        held.append(lease)
        peak = max(peak, bus.held_leases)

    consumer = asyncio.create_task(
        bus.consume(S.TRAJECTORIES, Sample, hold, max_inflight=3, stop=stop, inline=True)
    )
    for i in range(10):  # one at a time, as a pipeline produces them
        await bus.publish(S.TRAJECTORIES, sample(i))
        await asyncio.sleep(0.01)
    await wait_for(lambda: len(seen) == 3)
    await asyncio.sleep(0.5)
    assert len(seen) == 3 and peak == 3  # no room: nothing more is delivered
    for lease in held[:2]:
        await lease.ack()
    await wait_for(lambda: len(seen) == 5)
    await asyncio.sleep(0.3)
    assert len(seen) == 5 and bus.held_leases == 3
    while len(seen) < 10:  # settle as they come: all ten, each once
        for lease in list(held):
            await lease.ack()
            held.remove(lease)
        await asyncio.sleep(0.05)
    stop.set()
    await consumer
    assert sorted(seen) == sorted(f"t{i}" for i in range(10))
    await bus.close()


async def test_expired_pull_requests_are_renewed(nats_url, run_id):
    bus = await make_bus(nats_url, run_id)
    seen, stop = [], asyncio.Event()
    handler = acking_handler(seen)
    with capture_logs() as logs:
        consumer = asyncio.create_task(
            bus.consume(S.TRAJECTORIES, Sample, handler, max_inflight=4, stop=stop, expires_s=0.2)
        )
        for n in range(1, 4):  # gaps of several request lifetimes between messages
            await asyncio.sleep(0.7)
            await bus.publish(S.TRAJECTORIES, sample(n))
            await wait_for(lambda n=n: len(seen) == n, timeout=5)
        stop.set()
        await consumer
    # every expired request was accounted by its 408, none had to be presumed lost
    assert not pull_trouble(logs)
    await bus.close()


async def test_stop_hands_back_delivered_messages_at_once(nats_url, run_id):
    """Messages the server delivered to a stopping worker are nak'ed, not left to ack_wait."""
    a = await make_bus(nats_url, run_id, ack_wait_s=60)
    await a.publish(S.TRAJECTORIES, sample(0))
    stop = asyncio.Event()
    first = []

    async def stopping(s, lease):  # the worker is told to stop while more arrive for it
        first.append(s.task_id)
        stop.set()
        for i in range(1, 6):
            await a.publish(S.TRAJECTORIES, sample(i))
        await asyncio.sleep(0.3)  # delivered to this worker's inbox meanwhile
        await lease.ack()

    await a.consume(S.TRAJECTORIES, Sample, stopping, max_inflight=6, stop=stop, inline=True)
    assert first == ["t0"]
    b = await make_bus(nats_url, run_id, role="other", ack_wait_s=60)
    rest, stop_b = [], asyncio.Event()
    take = acking_handler(rest)
    cb = asyncio.create_task(b.consume(S.TRAJECTORIES, Sample, take, max_inflight=6, stop=stop_b))
    await wait_for(lambda: len(first) + len(rest) >= 6, timeout=10)  # far under ack_wait
    stop_b.set()
    await cb
    assert sorted(first + rest) == sorted(f"t{i}" for i in range(6))
    await a.close()
    await b.close()


async def test_byte_capped_pull_requests_end_and_are_renewed(nats_url, run_id, monkeypatch):
    """A request that reaches its byte cap ends with a 409 carrying what it did not deliver;
    the loop asks again at once (expiry is far off, so a miscount would stall the test)."""
    monkeypatch.setattr(client, "PULL_MAX_BYTES", 3 * len(encode(sample(0))))
    bus = await make_bus(nats_url, run_id)
    for i in range(20):
        await bus.publish(S.TRAJECTORIES, sample(i))
    seen, stop = [], asyncio.Event()
    handler = acking_handler(seen)
    with capture_logs() as logs:
        consumer = asyncio.create_task(
            bus.consume(S.TRAJECTORIES, Sample, handler, max_inflight=20, stop=stop, expires_s=60)
        )
        await wait_for(lambda: len(seen) == 20, timeout=10)
        stop.set()
        await consumer
    assert sorted(seen) == sorted(f"t{i}" for i in range(20))
    assert not pull_trouble(logs)
    await bus.close()


def _status(code: str, pending: int | None, desc: str = "Request Timeout") -> Msg:
    headers = {"Status": code, "Description": desc}
    if pending is not None:
        headers["Nats-Pending-Messages"] = str(pending)
    return Msg(_client=None, subject="_INBOX.x", data=b"", headers=headers)


async def test_status_messages_release_what_their_request_did_not_deliver(nats_url):
    async with raw_client(nats_url) as raw:
        await _status_accounting(raw)


async def _status_accounting(raw) -> None:
    pull = PullInbox(raw, "S", "c", batch_cap=8, max_bytes=1 << 20, expires_s=5.0)
    await pull.top_up(max_inflight=8)  # asks for 8 (no consumer behind it: nothing arrives)
    assert pull.outstanding == 8
    await pull.top_up(max_inflight=8)
    assert pull.outstanding == 8  # nothing more while everything there is room for is asked
    pull.buf.extend([Msg(_client=None, subject="x", data=b"1"), _status("408", 5)])
    taken = pull.take()
    assert len(taken) == 1 and pull.outstanding == 8 - 1 - 5
    pull.buf.append(_status("100", None))  # an idle heartbeat changes nothing
    pull.take()
    assert pull.outstanding == 2
    with capture_logs() as logs:  # routine ends of a request are quiet, errors are not
        pull.buf.extend(
            [_status("409", 0, "Batch Completed"), _status("409", 0, "Exceeded MaxWaiting")]
        )
        pull.take()
    assert [e["description"] for e in logs if e["event"] == "pull_status"] == [
        "Exceeded MaxWaiting"
    ]
    pull.last_expiry = time.monotonic() - 10  # its 408 was lost (e.g. a reconnect)
    await pull.top_up(max_inflight=8)
    assert pull.outstanding == 8  # reset, then asked again for all there is room for


async def test_leadership_change_and_reconnect_reissue_the_pulls_at_once(nats_url):
    """A consumer leader that moved (409 "Leadership Change", no pending count) or a reconnect
    (another server of the cluster) drops every open request: asked again at the next top-up,
    not at the requests' expiry."""
    async with raw_client(nats_url) as raw:
        pull = PullInbox(raw, "S", "c", batch_cap=8, max_bytes=1 << 20, expires_s=60.0)
        await pull.top_up(max_inflight=8)
        assert pull.outstanding == 8
        with capture_logs() as logs:
            pull.buf.append(_status("409", None, "Leadership Change"))
            pull.take()
        assert pull.outstanding == 0 and pull.wake.is_set()
        assert not [e for e in logs if e["event"] == "pull_status"]  # expected: not a warning
        await pull.top_up(max_inflight=8)
        assert pull.outstanding == 8
        raw.stats["reconnects"] += 1  # as nats-py counts a reconnect
        asked = pull.last_expiry
        with capture_logs() as logs:
            await pull.top_up(max_inflight=8)
        # reset, then asked again at once (the old requests' expiry is 60 s away)
        assert [e["cause"] for e in logs if e["event"] == "pull_reissued"] == ["reconnect"]
        assert pull.outstanding == 8 and pull.last_expiry > asked
        pull.last_heard -= 60  # no heartbeat for a minute: the requests' server died
        with capture_logs() as logs:
            await pull.top_up(max_inflight=8)
        assert [e["cause"] for e in logs if e["event"] == "pull_reissued"] == ["heartbeats missed"]
        assert pull.outstanding == 8
        pull.buf.append(_status("503", None, "No Responders"))  # JetStream electing: no spin
        pull.take()
        await pull.top_up(max_inflight=8)
        assert pull.outstanding == 0  # not asked again before NO_RESPONDERS_BACKOFF_S
        pull.not_before = 0.0
        await pull.top_up(max_inflight=8)
        assert pull.outstanding == 8


async def test_publish_ack_returns_the_stream_sequence(nats_url, run_id):
    bus = await make_bus(nats_url, run_id)  # declares the run's streams
    subject = bus.names.subject(S.TRAJECTORIES)
    async with raw_client(nats_url) as raw:
        acks = PublishAcks(raw)
        await acks.start()
        seqs = [await acks.publish(subject, b"x", None, 5.0) for _ in range(3)]
        assert seqs == [1, 2, 3]
        # the same Nats-Msg-Id twice: stored once, acked both times with the first sequence
        dup = [await acks.publish(subject, b"y", {"Nats-Msg-Id": "m1"}, 5.0) for _ in range(2)]
        assert dup == [4, 4]
    await bus.close()


async def test_publish_ack_errors(nats_url, run_id):
    bus = await make_bus(nats_url, run_id)  # declares the run's streams
    async with raw_client(nats_url) as raw:
        acks = PublishAcks(raw)
        await acks.start()
        with pytest.raises(nats.errors.NoRespondersError):  # no stream listens on the subject
            await acks.publish(f"nostream.{run_id}", b"x", None, 5.0)
        with pytest.raises(nats.js.errors.APIError):  # the stream refuses it
            await acks.publish(
                bus.names.subject(S.TRAJECTORIES), b"x", {"Nats-Expected-Stream": "other"}, 5.0
            )
        await raw.subscribe(f"silent.{run_id}")  # a responder that never answers
        await raw.flush()
        with pytest.raises(nats.errors.TimeoutError):
            await acks.publish(f"silent.{run_id}", b"x", None, 0.3)
        assert not acks._waiting  # nothing left behind by the failures
    await bus.close()


async def test_a_reconnect_times_out_the_publishes_waiting_for_an_ack(nats_url, run_id):
    """An ack the server that went away owed never comes: at the reconnect the publish raises
    the timeout its caller retries on (same `Nats-Msg-Id`), not after the whole timeout."""
    async with raw_client(nats_url) as raw:
        acks = PublishAcks(raw)
        await acks.start()
        await raw.subscribe(f"silent.{run_id}")  # a responder that never answers
        await raw.flush()
        waiting = asyncio.ensure_future(acks.publish(f"silent.{run_id}", b"x", None, 600.0))
        await wait_for(lambda: bool(acks._waiting))
        acks.reconnected()
        with pytest.raises(nats.errors.TimeoutError):
            await asyncio.wait_for(waiting, 60.0)  # a hang guard: it is failed at once
        assert not acks._waiting
        # a publish after the reconnect is acked as usual
        bus = await make_bus(nats_url, run_id)  # declares the run's streams
        assert await acks.publish(bus.names.subject(S.TRAJECTORIES), b"y", None, 10.0) >= 1
        await bus.close()
