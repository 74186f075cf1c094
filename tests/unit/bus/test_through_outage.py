"""`Bus._through_outage`: which failures are an outage (retried until the op goes through, or
`BusUnavailable` after `nats.outage_tolerance_s`) and which are answers (raised at once).

A JetStream API request that finds no responders, as while a cluster elects the leader of the
run-state bucket, raises nats-py's `ServiceUnavailableError` (its 503), not
`NoRespondersError`: it must be ridden out like the others, not end the worker."""

from __future__ import annotations

import itertools
import types

import nats.errors
import nats.js.errors
import pytest

from areal.bus.client import Bus, ack_waits
from areal.bus.errors import BusUnavailable
from areal.config import NatsSettings


def _bus(tolerance_s: float = 30.0) -> types.SimpleNamespace:
    """What `_through_outage` reads and calls, without a server."""
    denials = types.SimpleNamespace(denied=lambda subject: False)
    bus = types.SimpleNamespace(
        settings=NatsSettings(outage_tolerance_s=tolerance_s), _denials=denials
    )
    bus._next_reconnect = None  # no reconnect in these tests
    bus._unless_reconnected = lambda op: Bus._unless_reconnected(bus, op)
    return bus


def _failing(n: int, error: BaseException):
    calls = []

    async def op() -> str:
        calls.append(1)
        if len(calls) <= n:
            raise error
        return "done"

    return op, calls


@pytest.mark.parametrize(
    "error",
    [
        nats.js.errors.ServiceUnavailableError(),  # a JetStream API request: no responders
        nats.js.errors.ServiceUnavailableError(code=503, description="JetStream unavailable"),
        nats.errors.NoRespondersError(),
        nats.errors.TimeoutError(),
        nats.js.errors.NoStreamResponseError(),
        nats.errors.ConnectionReconnectingError(),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_an_outage_answer_is_retried_until_the_op_goes_through(error):
    op, calls = _failing(2, error)
    assert await Bus._through_outage(_bus(), op, "reading 'trainer'") == "done"
    assert len(calls) == 3


@pytest.mark.parametrize(
    "error",
    [
        nats.js.errors.BadRequestError(code=400, description="bad request"),
        nats.js.errors.NotFoundError(code=404, description="stream not found"),
        ValueError("a bug"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_an_answer_that_is_no_outage_is_raised_at_once(error):
    op, calls = _failing(1, error)
    with pytest.raises(type(error)):
        await Bus._through_outage(_bus(), op, "reading 'trainer'")
    assert len(calls) == 1


async def test_an_outage_longer_than_the_tolerance_is_bus_unavailable_naming_the_op():
    op, calls = _failing(10**6, nats.js.errors.ServiceUnavailableError())
    with pytest.raises(BusUnavailable, match=r"reading 'trainer'.*ServiceUnavailableError"):
        await Bus._through_outage(_bus(tolerance_s=0.5), op, "reading 'trainer'")
    assert len(calls) >= 2


async def test_a_jetstream_request_nobody_answers_is_an_outage_not_a_crash(nats_url):
    """With a real server: a JetStream API request that finds no responders (here under an API
    prefix no server serves, as a stream's requests find while its cluster elects a leader) is
    what nats-py raises as `ServiceUnavailableError`; ridden out, it ends as `BusUnavailable`."""
    import nats

    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream(prefix="$AREAL_NOBODY.API")
        with pytest.raises(nats.js.errors.ServiceUnavailableError):
            await js.stream_info("any")
        with pytest.raises(BusUnavailable, match="ServiceUnavailableError"):
            await Bus._through_outage(
                _bus(tolerance_s=0.5), lambda: js.stream_info("any"), "reading the stream"
            )
    finally:
        await nc.close()


def test_a_publish_waits_a_fifth_of_its_timeout_five_times_then_the_whole_timeout():
    """`ack_waits`: an election drops requests however long they wait, so the first tries are
    short (publish_timeout_s / 5, five of them); a server that is only slow then gets the whole
    timeout on every later try."""
    assert list(itertools.islice(ack_waits(10.0), 8)) == [2, 2, 2, 2, 2, 10, 10, 10]
    assert list(itertools.islice(ack_waits(1.0), 7)) == [0.2, 0.2, 0.2, 0.2, 0.2, 1.0, 1.0]
