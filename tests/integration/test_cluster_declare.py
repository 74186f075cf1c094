"""A run declared on a three-node JetStream cluster (`EmbeddedCluster`) with `nats.replicas=3`:
every stream, stage consumer and bucket holds three copies, and declaring the run again (another
worker of it, a resume) changes nothing."""

from __future__ import annotations

import pytest

from areal.bus.client import Bus
from areal.bus.embedded import EmbeddedCluster
from areal.config import NatsSettings
from schemas import subjects as S
from schemas.subjects import RunNames
from tests.integration.test_bus import raw_client

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(tmp_path):
    with EmbeddedCluster(tmp_path / "cluster") as c:
        yield c


async def test_a_run_on_a_cluster_keeps_three_copies_and_redeclares_idempotently(cluster):
    nats = NatsSettings(replicas=3)
    bus = await Bus.connect(cluster.url, "replicated", "controller", "c0", nats)
    names = RunNames("replicated")
    async with raw_client(cluster.urls[1]) as raw:
        js = raw.jetstream()
        streams = [names.stream(s) for s in S.ALL_STREAMS]
        streams += [f"KV_{names.state_bucket}", f"OBJ_{names.weights_bucket}"]
        for name in streams:
            info = await js.stream_info(name)
            assert info.config.num_replicas == 3, name
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2, name
        for stream in S.WORK_QUEUE_STREAMS:
            ci = await js.consumer_info(names.stream(stream), S.CONSUMER_OF[stream])
            assert ci.config.num_replicas == 3, stream

        calls: list[str] = []
        for method in ("add_stream", "update_stream", "add_consumer"):
            real = getattr(bus._js, method)

            async def spy(*a, _real=real, _name=method, **k):
                cfg = k.get("config") or (a[0] if a else None)
                calls.append(f"{_name} {getattr(cfg, 'name', cfg)}")
                return await _real(*a, **k)

            setattr(bus._js, method, spy)
        await bus.declare()  # the same run, the same replicas: no error, nothing to change
        # (nats-py creates a bucket by adding its stream: the server takes an identical one)
        buckets = {f"KV_{names.state_bucket}", f"OBJ_{names.weights_bucket}"}
        assert all(c.split()[0] == "add_stream" and c.split()[1] in buckets for c in calls), calls
    await bus.close()


@pytest.mark.slow  # ~8 s on 2 cores: a 3-node cluster forming
async def test_a_run_declared_before_the_cluster_has_formed_waits_for_it(tmp_path):
    """Two of three nodes up, the third never seen yet (a compose stack starting): the meta
    layer has no leader yet, or three copies have nowhere to go (JetStream's "no suitable peers
    for placement", what the compose cluster hit). The declare waits, as for an outage, and
    completes once the third node joins; neither is mistaken for a run id reused with other
    settings, nor fails the worker."""
    import asyncio

    from structlog.testing import capture_logs

    cluster = EmbeddedCluster(tmp_path / "forming")
    try:
        for node in cluster.nodes[:2]:
            node.start()
        nats = NatsSettings(replicas=3)
        with capture_logs() as logs:
            connect = asyncio.create_task(
                Bus.connect(",".join(cluster.urls[:2]), "late-peer", "controller", "c0", nats)
            )
            while not any(e["event"] == "declare_waiting" for e in logs):
                assert not connect.done(), connect.result()  # hang guard below; never early
                await asyncio.sleep(0.2)
            cluster.restart(2)  # its first start
            bus = await asyncio.wait_for(connect, 120)  # hang guard
        async with raw_client(cluster.urls[2]) as raw:
            info = await raw.jetstream().stream_info(RunNames("late-peer").stream(S.PROMPTS))
            assert info.config.num_replicas == 3
        await bus.close()
    finally:
        cluster.stop()
