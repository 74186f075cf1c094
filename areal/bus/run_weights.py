"""The run's policy weights: store, announce, fetch and verify (the weights half of the `Bus`).

Invariants:
- weights are stored before they are announced on `areal.<run>.weights`, so an announcement
  always names bytes that exist; only the newest `weights_keep` versions are kept;
- a fetch is verified against the announcement's sha256 and size before it is returned;
- `latest` is None only when the run has announced no weights yet; any other failure raises.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import APIError, NotFoundError

from areal.bus.codec import DecodeError, decode
from areal.bus.events import BusSubscription
from areal.bus.weights import WeightsChannel
from schemas import WeightAnnouncement
from schemas import subjects as S
from schemas.subjects import RunNames

log = structlog.get_logger()

NO_MESSAGE_FOUND = 10037  # JetStream error code of a direct get with nothing to return
Announce = Callable[[WeightAnnouncement], Awaitable[None]]


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class RunWeights:
    """Weights of one run for one worker; the object store travels on its own connection."""

    def __init__(
        self,
        js: JetStreamContext,
        names: RunNames,
        *,
        url: str,
        client_name: str,
        weights_keep: int,
        announce: Announce,
    ) -> None:
        self._js, self.names, self.url = js, names, url
        self.client_name, self.weights_keep = client_name, weights_keep
        self._announce = announce  # publishes an announcement (de-duplicated, retried)
        self._channel: WeightsChannel | None = None  # started on first use
        self._lock = asyncio.Lock()

    async def put(
        self, version: int, data: bytes, dtype: str, step: int, file_dir: str | None = None
    ) -> WeightAnnouncement:
        """Store weights, then announce them (in that order).

        By default in the run's object store; with `file_dir` (a filesystem every rollout worker
        sees, e.g. for very large models) as `<file_dir>/v<version>.safetensors`, written
        atomically. Only the newest `weights_keep` versions are kept either way.
        """
        name = f"v{version}"
        sha = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        if file_dir is None:
            await (await self._weights_channel()).put(name, data)
            uri = f"nats-obj://{self.names.weights_bucket}/{name}"
        else:
            path = Path(file_dir).resolve() / f"{name}.safetensors"
            await asyncio.to_thread(_write_atomic, path, data)
            uri = f"file://{path}"
        ann = WeightAnnouncement(
            version=version, uri=uri, sha256=sha, bytes=len(data), dtype=dtype, step=step
        )
        await self._announce(ann)
        old = version - self.weights_keep
        if old >= 0:
            await self._delete_old_weights(f"v{old}", file_dir)
        return ann

    async def _delete_old_weights(self, name: str, file_dir: str | None) -> None:
        """Best effort: the new version is stored and announced; an old one left behind costs
        only space (logged), and one already gone (a restarted trainer) is fine."""
        try:
            if file_dir is None:
                await (await self._weights_channel()).delete(name)
            else:
                (Path(file_dir) / f"{name}.safetensors").unlink(missing_ok=True)
        except NotFoundError:
            pass
        except (nats.errors.Error, APIError, OSError) as e:
            log.warning("old_weights_not_deleted", name=name, error=f"{type(e).__name__}: {e}")

    async def get(self, ann: WeightAnnouncement) -> bytes:
        """Fetch the announced weights and verify their digest."""
        if ann.uri.startswith("file://"):
            path = ann.uri[len("file://") :]
            data = await asyncio.to_thread(Path(path).read_bytes)
        elif ann.uri.startswith("nats-obj://"):
            bucket, name = ann.uri[len("nats-obj://") :].split("/", 1)
            if bucket == self.names.weights_bucket:
                data = await (await self._weights_channel()).get(name)
            else:  # another run's weights (e.g. to start from them): the library's reader
                data = (await (await self._js.object_store(bucket)).get(name)).data
        else:
            raise ValueError(f"unsupported weights uri {ann.uri!r}")
        sha = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        if sha != ann.sha256 or len(data) != ann.nbytes:
            raise ValueError(
                f"weights v{ann.version} failed verification: sha256 {sha[:12]} != "
                f"{ann.sha256[:12]} or {len(data)} != {ann.nbytes} bytes"
            )
        return data

    async def _weights_channel(self) -> WeightsChannel:
        """The run's object-store weights on their own connection and thread (`weights.py`)."""
        async with self._lock:
            if self._channel is None:
                channel = WeightsChannel(self.url, self.client_name, self.names.weights_bucket)
                await channel.start()
                self._channel = channel
        return self._channel

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def subscribe(
        self, cb: Callable[[WeightAnnouncement], Awaitable[None]]
    ) -> BusSubscription:
        """Deliver the latest announcement now and every later one (ordered consumer)."""

        async def on_msg(msg: Msg) -> None:
            try:
                ann = decode(msg.data, WeightAnnouncement)
            except DecodeError as e:
                log.warning("bad_weight_announcement", reason=str(e))
                return
            await cb(ann)

        subject = self.names.subject(S.WEIGHTS)
        sub = await self._js.subscribe(
            subject, cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.LAST
        )
        return BusSubscription(sub, subject)

    async def latest(self) -> WeightAnnouncement | None:
        """The newest announcement; None only when the run has announced no weights yet.

        Any other failure (no weights stream, a closed connection, a timeout, an announcement
        that does not decode) raises: a restoring trainer must not take it for "no weights"."""
        try:
            msg = await self._js.get_last_msg(
                self.names.stream(S.WEIGHTS), self.names.subject(S.WEIGHTS)
            )
        except NotFoundError as e:
            if e.err_code == NO_MESSAGE_FOUND:
                return None
            raise
        return decode(msg.data, WeightAnnouncement)
