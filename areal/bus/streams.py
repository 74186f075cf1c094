"""Declaring a run's streams, consumers, KV bucket and object store (idempotent).

Work-queue streams (prompts, trajectories, rewards) keep each message until the one durable
consumer of the next stage acknowledges it; limits streams (weights, metrics, events, dlq) keep
history by count/age so anyone can replay it.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError

from areal.bus.embedded import MAX_PAYLOAD_BYTES
from schemas import subjects as S
from schemas.subjects import RunNames


@dataclass
class BusOptions:
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    duplicate_window_s: float = 600.0
    history_max_age_s: float = 7 * 24 * 3600.0
    history_max_bytes: int = 512 * 1024 * 1024
    weights_keep: int = 4
    publish_timeout_s: float = 10.0
    memory_storage: bool = False


def stream_config(names: RunNames, stream: str, opts: BusOptions) -> StreamConfig:
    storage = StorageType.MEMORY if opts.memory_storage else StorageType.FILE
    common = dict(
        name=names.stream(stream),
        subjects=[names.subject(stream)]
        if stream in S.WORK_QUEUE_STREAMS or stream == S.WEIGHTS
        else [names.subject(stream, ">")],
        storage=storage,
        max_msg_size=MAX_PAYLOAD_BYTES,
        duplicate_window=opts.duplicate_window_s,
    )
    if stream in S.WORK_QUEUE_STREAMS:
        return StreamConfig(retention=RetentionPolicy.WORK_QUEUE, **common)
    if stream == S.WEIGHTS:
        return StreamConfig(
            retention=RetentionPolicy.LIMITS, max_msgs=opts.weights_keep * 4, **common
        )
    return StreamConfig(
        retention=RetentionPolicy.LIMITS,
        max_age=opts.history_max_age_s,
        max_bytes=opts.history_max_bytes,
        discard=DiscardPolicy.OLD,
        **common,
    )


def consumer_config(stream: str, opts: BusOptions) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=S.CONSUMER_OF[stream],
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=opts.ack_wait_s,
        max_deliver=opts.max_deliver,
        max_ack_pending=-1,
        max_waiting=512,
    )


async def declare_run(js: JetStreamContext, names: RunNames, opts: BusOptions) -> None:
    for stream in S.ALL_STREAMS:
        cfg = stream_config(names, stream, opts)
        try:
            await js.add_stream(cfg)
        except BadRequestError:
            await js.update_stream(cfg)  # exists with other limits: bring it to ours
    for stream in S.WORK_QUEUE_STREAMS:
        await js.add_consumer(names.stream(stream), consumer_config(stream, opts))
    await js.create_key_value(bucket=names.state_bucket, history=1)
    await js.create_object_store(bucket=names.weights_bucket)
