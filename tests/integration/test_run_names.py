"""Bug 1 against a real nats-server: runs whose ids differ only in `-` vs `_` are separate runs,
and a declaration never modifies a stream or consumer that is not its run's.

The tests run on a server of their own, so the run ids can be the literal `run-a` / `run_a`.
"""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import ConsumerConfig, RetentionPolicy, StreamConfig
from pydantic import BaseModel

from areal.bus import RunConflictError
from areal.bus.client import Bus
from areal.bus.embedded import EmbeddedNats
from areal.bus.streams import stream_config
from areal.config import NatsSettings
from schemas import Task
from schemas import subjects as S
from schemas.subjects import RunNames
from tests.factories import make_sample, make_task
from tests.integration.test_bus import raw_client, wait_for

pytestmark = pytest.mark.integration


class _State(BaseModel):
    owner: str


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    with EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats-names")) as server:
        yield server.url


def task(task_id: str) -> Task:
    return make_task(task_id=task_id)


async def server_layout(url: str, names: RunNames) -> dict[str, dict]:
    """Every stream config of the run, its consumers' configs and its buckets' stream configs,
    as the server reports them."""
    out: dict[str, dict] = {}
    async with raw_client(url) as raw:
        js = raw.jetstream()
        for stream in S.ALL_STREAMS:
            name = names.stream(stream)
            out[name] = (await js.stream_info(name)).config.as_dict()
            if stream in S.CONSUMER_OF:
                ci = await js.consumer_info(name, S.CONSUMER_OF[stream])
                out[f"{name}/{S.CONSUMER_OF[stream]}"] = ci.config.as_dict()
        for bucket in (f"KV_{names.state_bucket}", f"OBJ_{names.weights_bucket}"):
            out[bucket] = (await js.stream_info(bucket)).config.as_dict()
    return out


async def consume_one(bus: Bus) -> list[str]:
    """Task ids the run's rollout consumer delivers until it has one (then a little more)."""
    seen: list[str] = []
    stop = asyncio.Event()

    async def handler(t: Task, lease) -> None:
        seen.append(t.task_id)
        await lease.ack()

    consumer = asyncio.create_task(bus.consume(S.PROMPTS, Task, handler, max_inflight=4, stop=stop))
    await wait_for(lambda: seen)
    stop.set()
    await consumer
    return seen


async def test_runs_differing_in_dash_and_underscore_are_separate(url):
    a_names, b_names = RunNames("run-a"), RunNames("run_a")
    a = await Bus.connect(url, "run-a", "rollout", "a-0")
    before = await server_layout(url, a_names)
    b = await Bus.connect(url, "run_a", "rollout", "b-0")
    after = await server_layout(url, a_names)
    assert after == before  # declaring run_a left every config of run-a as it was
    b_layout = await server_layout(url, b_names)
    assert not set(before) & set(b_layout)  # disjoint streams, consumers and buckets
    await a.publish(S.PROMPTS, task("task-of-run-a"))
    await b.publish(S.PROMPTS, task("task-of-run_a"))
    assert await consume_one(a) == ["task-of-run-a"]  # each consumer sees its own work only
    assert await consume_one(b) == ["task-of-run_a"]
    await a.kv_put("trainer", _State(owner="run-a"))
    await b.kv_put("trainer", _State(owner="run_a"))
    assert await a.kv_get("trainer", _State) == _State(owner="run-a")
    assert await b.kv_get("trainer", _State) == _State(owner="run_a")
    await a.publish(S.TRAJECTORIES, make_sample())  # run-a still publishes to its own streams
    assert (await a.stream_depth(S.TRAJECTORIES), await b.stream_depth(S.TRAJECTORIES)) == (1, 0)
    await a.close()
    await b.close()


async def test_a_stream_with_the_runs_name_and_other_subjects_is_a_conflict(url):
    names = RunNames("run-b")
    theirs = StreamConfig(  # e.g. a run of the old naming, where run-b and run_b collided
        name=names.stream(S.PROMPTS),
        subjects=["legacy.run-b.prompts"],
        retention=RetentionPolicy.WORK_QUEUE,
    )
    async with raw_client(url) as raw:
        js = raw.jetstream()
        await js.add_stream(theirs)
        before = (await js.stream_info(theirs.name)).config.as_dict()
        with pytest.raises(RunConflictError) as err:
            await Bus.connect(url, "run-b", "rollout", "b-0")
        msg = str(err.value)
        assert "\n" not in msg
        for part in (theirs.name, "legacy.run-b.prompts", "areal.run-b.prompts", "run id"):
            assert part in msg
        assert (await js.stream_info(theirs.name)).config.as_dict() == before  # untouched
        ours = {names.stream(s) for s in S.ALL_STREAMS} - {theirs.name}
        on_server = {info.config.name for info in await js.streams_info()}
        assert not ours & on_server  # the conflict was found before anything was created
        await js.delete_stream(theirs.name)


async def test_a_foreign_consumer_with_the_stages_name_is_a_conflict(url):
    names = RunNames("run-c")
    cfg = stream_config(names, S.PROMPTS, NatsSettings())
    push = ConsumerConfig(durable_name=S.CONSUMER_OF[S.PROMPTS], deliver_subject="elsewhere.c")
    async with raw_client(url) as raw:
        js = raw.jetstream()
        await js.add_stream(cfg)
        await js.add_consumer(cfg.name, push)
        before = (await js.consumer_info(cfg.name, push.durable_name)).config.as_dict()
        with pytest.raises(RunConflictError, match="consumer rollout on stream AREAL_RUN-C_"):
            await Bus.connect(url, "run-c", "rollout", "c-0")
        after = (await js.consumer_info(cfg.name, push.durable_name)).config.as_dict()
        assert after == before


async def test_the_same_run_redeclared_with_other_limits_is_updated(url):
    names = RunNames("run-d")
    first = await Bus.connect(url, "run-d", "rollout", "d-0", NatsSettings(ack_wait_s=30))
    again = await Bus.connect(
        url, "run-d", "rollout", "d-1", NatsSettings(ack_wait_s=20, weights_keep=2)
    )
    layout = await server_layout(url, names)
    consumer = layout[f"{names.stream(S.PROMPTS)}/rollout"]
    assert consumer["ack_wait"] == 20 * 10**9  # nanoseconds
    # the bus enforces nats.max_deliver itself: the server never stops delivering a message
    assert consumer["max_deliver"] == -1
    assert layout[names.stream(S.WEIGHTS)]["max_msgs"] == 8  # weights_keep 2 * 4 announcements
    await first.close()
    await again.close()
