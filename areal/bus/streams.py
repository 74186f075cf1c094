"""Declaring a run's streams, consumers, KV bucket and object store (idempotent, never
destructive to anything that is not this run's).

Work-queue streams (prompts, trajectories, rewards) keep each message until the one durable
consumer of the next stage acknowledges it; limits streams (weights, metrics, events, dlq) keep
history by count/age so anyone can replay it.

Storage: nats-server reserves a stream's `max_bytes` against its JetStream storage limit
(`max_file_store`, or `max_memory_store` for memory streams) when the stream is created, used or
not, and refuses a stream that does not fit (error 10047; 10028 for memory). So no stream of a
run sets `max_bytes` unless `nats.history_max_bytes` asks for it: the history streams (metrics,
events, dlq) discard their oldest messages by count per subject and by age instead, and a run
reserves nothing. Several runs then share a modest server (two on a 2 GB one, and more).

Invariants:
- a stream is created, or, when it exists with exactly this run's subjects (the same run, maybe
  with changed limits), updated to our limits; a stream with our name and other subjects belongs
  to something else and raises `RunConflictError` untouched (run names are injective,
  `schemas.subjects`, so this only happens with a stream made by hand or by an older naming);
- a stage's durable consumer is created, or updated when only its limits (ack wait, deliveries)
  differ; one with another shape (push delivery, a filter, another ack policy) raises
  `RunConflictError` untouched;
- a server out of JetStream storage raises `StorageLimitError` naming the setting and the fix.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, NotFoundError

from areal.bus.embedded import MAX_PAYLOAD_BYTES
from areal.bus.errors import RunConflictError
from areal.config import NatsSettings
from schemas import subjects as S
from schemas.subjects import RunNames

# Stream fields whose difference from ours is a change of limits (brought to ours by an update).
_STREAM_LIMITS = (
    "retention",
    "storage",
    "max_msg_size",
    "duplicate_window",
    "max_msgs",
    "max_age",
    "max_bytes",
    "max_msgs_per_subject",
    "discard",
    "num_replicas",
    "allow_direct",
)
_CONSUMER_LIMITS = ("ack_wait", "max_deliver", "max_ack_pending", "max_waiting", "num_replicas")
_FIX = "choose another run id, or delete the old run's streams (`nats stream rm NAME`)"
# JetStream error codes: no storage (file) / memory left to create or grow a stream.
_NO_STORAGE = {10047: "file", 10028: "memory"}
UNLIMITED = -1  # nats-server's "no limit" for max_msgs / max_bytes


class StorageLimitError(RuntimeError):
    """The NATS server refused one of the run's streams for lack of JetStream storage."""


def stream_config(names: RunNames, stream: str, nats: NatsSettings) -> StreamConfig:
    """The stream's config. Its limits are explicit values (a None one is the server's default
    and never compared), so redeclaring an unchanged run updates nothing; `max_bytes` is
    `UNLIMITED` (reserves nothing) unless `nats.history_max_bytes` sets it for the history
    streams."""
    storage = StorageType.MEMORY if nats.memory_storage else StorageType.FILE
    one_subject = stream in S.WORK_QUEUE_STREAMS or stream == S.WEIGHTS
    common = dict(
        name=names.stream(stream),
        subjects=[names.subject(stream)] if one_subject else [names.subject(stream, ">")],
        storage=storage,
        max_msg_size=MAX_PAYLOAD_BYTES,
        duplicate_window=nats.duplicate_window_s,
        num_replicas=nats.replicas,
        allow_direct=True,  # readers follow by direct gets (`areal.bus.follow`), no consumer
    )
    if stream in S.WORK_QUEUE_STREAMS:
        return StreamConfig(
            retention=RetentionPolicy.WORK_QUEUE,
            max_msgs=UNLIMITED,
            max_bytes=UNLIMITED,
            **common,
        )
    if stream == S.WEIGHTS:
        return StreamConfig(
            retention=RetentionPolicy.LIMITS,
            max_msgs=nats.weights_keep * 4,
            max_bytes=UNLIMITED,
            **common,
        )
    max_bytes = nats.history_max_bytes
    return StreamConfig(
        retention=RetentionPolicy.LIMITS,
        max_msgs=UNLIMITED,
        max_age=nats.history_max_age_s,
        max_bytes=UNLIMITED if max_bytes is None else max_bytes,
        max_msgs_per_subject=nats.history_max_msgs_per_subject,
        discard=DiscardPolicy.OLD,
        **common,
    )


def _limits_differ(current: StreamConfig, cfg: StreamConfig) -> bool:
    """Whether a limit we set differs on the server (a field we leave unset is the server's)."""
    return any(
        getattr(cfg, f) is not None and getattr(current, f) != getattr(cfg, f)
        for f in _STREAM_LIMITS
    )


def _storage_error(e: APIError, nats: NatsSettings) -> StorageLimitError:
    kind = _NO_STORAGE.get(e.err_code or 0, "file")
    limit = "max_memory_store" if kind == "memory" else "max_file_store"
    if nats.history_max_bytes is not None:
        cause = (
            f"nats.history_max_bytes={nats.history_max_bytes} reserves that much per history "
            "stream (3 per run) whether used or not; unset it (--set nats.history_max_bytes=null) "
            f"or lower it, or raise the server's jetstream {limit}"
        )
    else:
        cause = (
            f"its {kind} store is full or reserved by other streams: remove old runs' streams "
            f"(`nats stream ls`, `nats stream rm NAME`) or raise the server's jetstream {limit}"
        )
    return StorageLimitError(
        f"the NATS server has no JetStream {kind} storage left for this run "
        f"(error {e.err_code}: {e.description}): {cause}"
    )


def consumer_config(stream: str, nats: NatsSettings) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=S.CONSUMER_OF[stream],
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=nats.ack_wait_s,
        # never given up on by the server: a message it stopped delivering would stay in the
        # work queue unseen and its task never end. `nats.max_deliver` is enforced by the bus
        # (`Bus.consume`), which dead-letters it and tells the trainer
        max_deliver=UNLIMITED,
        max_ack_pending=-1,
        max_waiting=512,
        num_replicas=nats.replicas,
    )


async def _stream_config_of(js: JetStreamContext, name: str) -> StreamConfig | None:
    try:
        return (await js.stream_info(name)).config
    except NotFoundError:
        return None


def _check_owner(current: StreamConfig, cfg: StreamConfig) -> None:
    if sorted(current.subjects or []) != sorted(cfg.subjects or []):
        raise RunConflictError(
            f"stream {cfg.name} exists with subjects {current.subjects}, not this run's "
            f"{cfg.subjects}: it belongs to another run or tool; {_FIX}"
        )


async def declare_stream(js: JetStreamContext, cfg: StreamConfig) -> None:
    """Create `cfg`'s stream, or bring this run's existing one to `cfg`'s limits."""
    current = await _stream_config_of(js, cfg.name)
    if current is None:
        try:
            await js.add_stream(cfg)
            return
        except BadRequestError:  # created meanwhile (another worker of the run): check it
            current = await _stream_config_of(js, cfg.name)
            if current is None:
                raise
    _check_owner(current, cfg)
    if _limits_differ(current, cfg):
        await js.update_stream(cfg)  # the same run with changed limits


async def _consumer_config_of(
    js: JetStreamContext, stream_name: str, durable: str
) -> ConsumerConfig | None:
    try:
        return (await js.consumer_info(stream_name, durable)).config
    except NotFoundError:
        return None


def _check_consumer(current: ConsumerConfig, stream_name: str, cfg: ConsumerConfig) -> None:
    foreign = (
        current.deliver_subject
        or current.filter_subject
        or current.filter_subjects
        or current.ack_policy != cfg.ack_policy
    )
    if foreign:
        raise RunConflictError(
            f"consumer {cfg.durable_name} on stream {stream_name} exists with another shape "
            f"(deliver_subject={current.deliver_subject!r}, filter={current.filter_subject!r}, "
            f"filters={current.filter_subjects}, ack_policy={current.ack_policy}): not this "
            f"run's pull consumer; {_FIX}"
        )


async def declare_consumer(js: JetStreamContext, stream_name: str, cfg: ConsumerConfig) -> None:
    """Create the stage's durable pull consumer, or bring this run's existing one to `cfg`."""
    current = await _consumer_config_of(js, stream_name, cfg.durable_name)
    if current is None:
        await js.add_consumer(stream_name, cfg)
        return
    _check_consumer(current, stream_name, cfg)
    if any(getattr(current, f) != getattr(cfg, f) for f in _CONSUMER_LIMITS):
        await js.add_consumer(stream_name, cfg)  # an existing durable: updates its limits


async def declare_run(js: JetStreamContext, names: RunNames, nats: NatsSettings) -> None:
    """Declare every stream, stage consumer and bucket of the run (see the module invariants).

    Every conflict is looked for before anything is created or updated, so a declaration that
    raises `RunConflictError` changes nothing on the server."""
    streams = {stream: stream_config(names, stream, nats) for stream in S.ALL_STREAMS}
    consumers = {stream: consumer_config(stream, nats) for stream in S.WORK_QUEUE_STREAMS}
    for stream, cfg in streams.items():
        current = await _stream_config_of(js, cfg.name)
        if current is None:
            continue
        _check_owner(current, cfg)
        if stream in consumers:
            durable = consumers[stream].durable_name
            existing = await _consumer_config_of(js, cfg.name, durable)
            if existing is not None:
                _check_consumer(existing, cfg.name, consumers[stream])
    try:
        for cfg in streams.values():
            await declare_stream(js, cfg)
        for stream, ccfg in consumers.items():
            await declare_consumer(js, streams[stream].name, ccfg)
        if await _stream_config_of(js, f"KV_{names.state_bucket}") is None:
            await js.create_key_value(
                KeyValueConfig(
                    bucket=names.state_bucket, history=1, replicas=nats.replicas, direct=True
                )
            )
        await _allow_direct(js, f"KV_{names.state_bucket}")  # a bucket of an older version
        # last: its existence means the whole run is declared (`run_declared`)
        await js.create_object_store(
            names.weights_bucket, ObjectStoreConfig(replicas=nats.replicas)
        )
    except APIError as e:
        if e.err_code in _NO_STORAGE:
            raise _storage_error(e, nats) from None
        raise


async def _allow_direct(js: JetStreamContext, name: str) -> None:
    """Turn on direct gets of an existing stream (watches read the run state by them)."""
    cfg = await _stream_config_of(js, name)
    if cfg is not None and not cfg.allow_direct:
        cfg.allow_direct = True
        await js.update_stream(cfg)


async def run_declared(js: JetStreamContext, names: RunNames) -> bool:
    """Whether `declare_run` has completed for the run: its weights object store, which it
    creates last, exists (a look-up only: roles that may not create streams call this)."""
    return await _stream_config_of(js, f"OBJ_{names.weights_bucket}") is not None
