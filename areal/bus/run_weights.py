"""The run's policy weights: store, announce, fetch and verify (the weights half of the `Bus`).

Anyone who can publish on the bus can put bytes in the object store and announce them, so with
the run's keys (`areal.security.keys`) only the trainer's word counts:

Invariants:
- weights are stored before they are announced on `areal.<run>.weights`, so an announcement
  always names bytes that exist; only the newest `weights_keep` versions are kept;
- with keys, every announcement is signed by the trainer (`WeightAnnouncement.signed_payload`,
  which holds the blob's SHA-256, taken while the blob streamed out), and every reader
  (`subscribe`, `latest`, `get`, `fetch`) checks the signature before it fetches a byte:
  an unsigned or badly signed one is logged (`weights_rejected`, with the reason) and ignored,
  so a forged version, however high, never reaches a caller and never holds back a real one;
- a fetch reads at most the announced size: a `file://` URI only names a regular file under the
  weights dir (`file_root`, symlinks resolved, no `..`) whose size is the announced one, an
  object only one of that size; the digest is taken while reading and checked before returning;
- weights stream both ways (`WeightsBlob` out, `WeightsSink` in): neither side ever holds the
  whole blob in memory, let alone twice (`fetch` into a decoder holds only the tensors);
- `latest` is the trusted announcement of the highest version among those the stream holds;
  None only when it holds none (nothing announced yet, or nothing the trainer signed); any other
  failure raises (a restoring trainer must not take it for "no weights");
- without keys (`security.sign_weights: false`) nothing is signed or verified (logged once).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path, PurePosixPath
from typing import TypeVar

import nats.errors
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from areal.bus.auth import NO_CREDENTIALS, Credentials
from areal.bus.blobs import CHUNK_BYTES, BytesBlob, BytesSink, WeightsBlob, WeightsSink
from areal.bus.codec import DecodeError, decode
from areal.bus.errors import WeightsRejected
from areal.bus.follow import StoredMsg, StreamFollower, follow_stream, last_seq
from areal.bus.weights import WeightsChannel
from areal.security.keys import RunKeys
from schemas import WeightAnnouncement
from schemas import subjects as S
from schemas.subjects import RunNames

log = structlog.get_logger()

NO_MESSAGE_FOUND = 10037  # JetStream error code of a direct get with nothing to return
LATEST_SCAN = 256  # most announcements `latest` looks back over (the stream keeps fewer)
UNSIGNED = "no run keys (security.sign_weights=false): weights are neither signed nor verified"
Announce = Callable[[WeightAnnouncement], Awaitable[None]]
Sk = TypeVar("Sk", bound=WeightsSink)


def _write_atomic(path: Path, blob: WeightsBlob) -> str:
    """Write `blob` to `path` chunk by chunk through a temp file renamed into place (readers
    never see a partial file); returns its SHA-256 (hex), taken while writing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    digest, n = hashlib.sha256(), 0
    try:
        with tmp.open("wb") as f:
            for chunk in blob.chunks():
                f.write(chunk)
                digest.update(chunk)
                n += len(chunk)
        if n != blob.nbytes:
            raise RuntimeError(
                f"weights {path.name}: the blob produced {n} bytes, said {blob.nbytes}"
            )
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return digest.hexdigest()


def weights_file(uri: str, file_root: str | os.PathLike | None) -> Path:
    """The file a `file://` announcement names, resolved; `WeightsRejected` unless it lies
    under `file_root` (resolved too) after every symlink, with no `..` in the announced path."""
    raw = uri[len("file://") :]
    if file_root is None:
        raise WeightsRejected(
            f"file:// weights {raw!r}: this worker reads weights files only with "
            "weights.transport=file, from under weights.dir"
        )
    announced = PurePosixPath(raw)
    if not announced.is_absolute() or ".." in announced.parts:
        raise WeightsRejected(f"file:// weights {raw!r}: not an absolute path without '..'")
    root = Path(file_root).resolve()
    try:
        path = Path(raw).resolve(strict=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"weights file {raw} does not exist (any more)") from None
    except (OSError, RuntimeError) as e:  # a symlink loop, a path component not a dir
        raise WeightsRejected(f"file:// weights {raw!r}: {e}") from None
    if not path.is_relative_to(root):
        raise WeightsRejected(
            f"file:// weights {raw!r} resolve to {path}, outside the weights dir {root}"
        )
    return path


def read_weights_file_into(path: Path, nbytes: int, sink: WeightsSink) -> None:
    """Stream the regular file `path`, which must hold exactly `nbytes` bytes, into `sink` in
    `CHUNK_BYTES` pieces; reads at most `nbytes + 1` bytes (none when its size already
    differs). A fifo, a device or a symlink (`path` is resolved) is refused without a read."""
    # O_NONBLOCK: opening a fifo must not wait for a writer (it is refused right after)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WeightsRejected(f"weights file {path} is not a regular file")
        if st.st_size != nbytes:
            raise WeightsRejected(
                f"weights file {path} holds {st.st_size} bytes, {nbytes} were announced"
            )
        buf = memoryview(bytearray(min(CHUNK_BYTES, nbytes) + 1))
        n = 0
        while n < nbytes:
            got = f.readinto(buf[: min(CHUNK_BYTES, nbytes - n)])
            if not got:
                break
            sink.write(buf[:got])
            n += got
        grew = f.readinto(buf[:1]) if n == nbytes else 0  # one byte more: a file that grew
    if n != nbytes or grew:
        raise WeightsRejected(f"weights file {path} changed size while read ({nbytes} announced)")


class _Verifying:
    """Passes bytes on to `sink`, hashing and counting them; refuses a byte past the announced
    size; `verify` raises unless exactly the announced bytes (size and SHA-256) went through."""

    def __init__(self, sink: WeightsSink, ann: WeightAnnouncement) -> None:
        self.sink, self.ann = sink, ann
        self._digest, self.n = hashlib.sha256(), 0

    def write(self, chunk: memoryview) -> None:
        if self.n + len(chunk) > self.ann.nbytes:
            raise WeightsRejected(
                f"weights v{self.ann.version} hold more than the {self.ann.nbytes} bytes announced"
            )
        self._digest.update(chunk)
        self.n += len(chunk)
        self.sink.write(chunk)

    def verify(self) -> None:
        sha = self._digest.hexdigest()
        if sha != self.ann.sha256 or self.n != self.ann.nbytes:
            raise WeightsRejected(
                f"weights v{self.ann.version} failed verification: sha256 {sha[:12]} != "
                f"{self.ann.sha256[:12]} or {self.n} != {self.ann.nbytes} bytes"
            )


class RunWeights:
    """Weights of one run for one worker; the object store travels on its own connection."""

    def __init__(
        self,
        js: JetStreamContext,
        names: RunNames,
        *,
        nc: Client,
        url: str,
        client_name: str,
        weights_keep: int,
        announce: Announce,
        keys: RunKeys | None = None,
        file_root: str | os.PathLike | None = None,
        credentials: Credentials = NO_CREDENTIALS,
    ) -> None:
        self._js, self._nc, self.names, self.url = js, nc, names, url
        self.client_name, self.weights_keep = client_name, weights_keep
        self._announce = announce  # publishes an announcement (de-duplicated, retried)
        self.keys = keys  # None: unsigned weights (security.sign_weights: false)
        self.file_root = file_root  # file:// weights only under it; None: none at all
        self.credentials = credentials  # of the object store's own connection
        self._channel: WeightsChannel | None = None  # started on first use
        self._lock = asyncio.Lock()
        self._logged: set[str] = set()  # rejections already logged (one line per forgery)
        # announcement stream seq -> its trusted announcement (None: missing, bad or forged)
        self._scanned: dict[int, WeightAnnouncement | None] = {}

    # ------------------------------------------------------------ trust
    def rejection(self, ann: WeightAnnouncement) -> str | None:
        """Why `ann` is not the trainer's (logged once per announcement), or None to trust it."""
        if self.keys is None:
            self._log_once("unsigned", "weights_unverified", reason=UNSIGNED)
            return None
        if not ann.signature:
            reason = "unsigned"
        elif not self.keys.verify(ann.signed_payload(self.names.run_id), ann.signature):
            reason = "bad signature"
        else:
            return None
        self._log_once(
            f"{ann.version}/{ann.signature}/{ann.uri}",
            "weights_rejected",
            version=ann.version,
            uri=ann.uri[:200],
            reason=reason,
            verify_key=self.keys.fingerprint,
        )
        return reason

    def _check(self, ann: WeightAnnouncement) -> None:
        reason = self.rejection(ann)
        if reason is not None:
            raise WeightsRejected(f"weights v{ann.version} not announced by the trainer: {reason}")

    def _log_once(self, once: str, event: str, **fields) -> None:
        if once in self._logged:
            return
        if len(self._logged) > 10_000:  # a flood of forgeries must not grow memory forever
            self._logged.clear()
        self._logged.add(once)
        log.warning(event, **fields)

    def _signed(self, ann: WeightAnnouncement) -> WeightAnnouncement:
        if self.keys is None:
            self._log_once("unsigned", "weights_unverified", reason=UNSIGNED)
            return ann
        return ann.model_copy(
            update={"signature": self.keys.sign(ann.signed_payload(self.names.run_id))}
        )

    async def put(
        self,
        version: int,
        data: bytes | WeightsBlob,
        dtype: str,
        step: int,
        file_dir: str | None = None,
    ) -> WeightAnnouncement:
        """Store weights, then announce them (in that order).

        By default in the run's object store; with `file_dir` (a filesystem every rollout worker
        sees, e.g. for very large models) as `<file_dir>/v<version>.safetensors`, written
        atomically. Only the newest `weights_keep` versions are kept either way. `data` is
        streamed (a `WeightsBlob` is never whole in memory here); its SHA-256 is taken on the
        way, and the signature covers it (`WeightAnnouncement.signed_payload`).
        """
        if self.keys is not None and self.keys.signing_key is None:
            raise RuntimeError(
                "this worker's run keys have no signing key: only the trainer publishes weights "
                "(it loads weights_signing.key from security.keys_dir)"
            )
        blob = BytesBlob(data) if isinstance(data, bytes | bytearray | memoryview) else data
        name = f"v{version}"
        if file_dir is None:
            sha = await (await self._weights_channel()).put(name, blob)
            uri = f"nats-obj://{self.names.weights_bucket}/{name}"
        else:
            path = Path(file_dir).resolve() / f"{name}.safetensors"
            sha = await asyncio.to_thread(_write_atomic, path, blob)
            uri = f"file://{path}"
        ann = self._signed(
            WeightAnnouncement(
                version=version, uri=uri, sha256=sha, bytes=blob.nbytes, dtype=dtype, step=step
            )
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
        """The announced weights as bytes (`fetch` into memory; small blobs, tests)."""
        return (await self.fetch(ann, lambda _nbytes: BytesSink())).value()

    async def fetch(self, ann: WeightAnnouncement, open_sink: Callable[[int], Sk]) -> Sk:
        """Stream the announced weights into `open_sink(ann.nbytes)` and return that sink.

        The signature is checked before the sink is opened or any byte is read, the sink never
        receives more than the announced size, and the size and digest are checked before
        returning (`WeightsRejected` for an announcement or a blob not to trust: the sink's
        content is then to be dropped)."""
        self._check(ann)
        sink = open_sink(ann.nbytes)
        verifying = _Verifying(sink, ann)
        if ann.uri.startswith("file://"):
            path = weights_file(ann.uri, self.file_root)
            await asyncio.to_thread(read_weights_file_into, path, ann.nbytes, verifying)
        elif ann.uri.startswith("nats-obj://"):
            bucket, _, name = ann.uri[len("nats-obj://") :].partition("/")
            if bucket == self.names.weights_bucket:
                await (await self._weights_channel()).read_into(name, ann.nbytes, verifying)
            else:  # another run's weights (e.g. to start from them): the library's reader
                obs = await self._js.object_store(bucket)
                size = (await obs.get_info(name)).size or 0
                if size != ann.nbytes:
                    raise WeightsRejected(
                        f"object {name} in bucket {bucket} holds {size} bytes, "
                        f"{ann.nbytes} were announced"
                    )
                verifying.write(memoryview((await obs.get(name)).data or b""))
        else:
            raise WeightsRejected(f"unsupported weights uri {ann.uri[:200]!r}")
        verifying.verify()
        return sink

    async def _weights_channel(self) -> WeightsChannel:
        """The run's object-store weights on their own connection and thread (`weights.py`)."""
        async with self._lock:
            if self._channel is None:
                channel = WeightsChannel(
                    self.url, self.client_name, self.names.weights_bucket, self.credentials
                )
                await channel.start()
                self._channel = channel
        return self._channel

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def subscribe(
        self, cb: Callable[[WeightAnnouncement], Awaitable[None]]
    ) -> StreamFollower:
        """Deliver the latest trusted announcement now and every later trusted one, each once
        and in order (a `StreamFollower` from the stream's last message: direct gets, no
        consumer); an untrusted one is logged and skipped. When the stream's last message is
        not to be trusted, the first delivery is `latest()` instead (the newest that is)."""
        first = True

        async def on_msg(msg: StoredMsg) -> None:
            nonlocal first
            was_first, first = first, False
            try:
                ann: WeightAnnouncement | None = decode(msg.data, WeightAnnouncement)
            except DecodeError as e:
                log.warning("bad_weight_announcement", reason=str(e))
                ann = None
            if ann is not None and self.rejection(ann) is None:
                await cb(ann)
            elif was_first:
                try:
                    ann = await self.latest()
                except Exception as e:  # noqa: BLE001 - the rollout also polls `latest` itself
                    log.warning("latest_weights_failed", error=f"{type(e).__name__}: {e}")
                    return
                if ann is not None:
                    await cb(ann)

        subject, stream = self.names.subject(S.WEIGHTS), self.names.stream(S.WEIGHTS)
        start = await last_seq(self._nc, stream, subject)
        return await follow_stream(self._nc, stream, subject, on_msg, start_seq=start or 1)

    async def latest(self) -> WeightAnnouncement | None:
        """The trusted announcement of the highest version among the (at most `LATEST_SCAN`)
        the weights stream holds; None only when it holds none (nothing announced yet, or
        nothing the trainer signed). Messages that do not decode or verify are skipped.

        A message of a stream never changes at its sequence number, so each one is fetched,
        decoded and verified once per worker (`_scanned`): a call costs one round trip (the
        last message) plus the messages that arrived since the previous call, not a re-read
        and re-verification of the whole history (which made every call O(versions)).

        Any other failure (no weights stream, a closed connection, a timeout) raises: a
        restoring trainer must not take it for "no weights"."""
        stream, subject = self.names.stream(S.WEIGHTS), self.names.subject(S.WEIGHTS)
        try:
            last = await self._js.get_last_msg(stream, subject)
        except NotFoundError as e:
            if e.err_code == NO_MESSAGE_FOUND:
                return None
            raise
        if self._scanned and last.seq < max(self._scanned):
            self._scanned.clear()  # the stream was recreated: its sequence numbers restarted
        lo = max(1, last.seq - LATEST_SCAN + 1)
        for seq in [s for s in self._scanned if s < lo]:
            del self._scanned[seq]
        if last.seq not in self._scanned:
            self._scanned[last.seq] = self._trusted(last.seq, last)
        missing = [seq for seq in range(lo, last.seq) if seq not in self._scanned]
        if missing:  # only what arrived since the last call (all of it on the first call)
            first_seq = (await self._js.stream_info(stream)).state.first_seq or 1
            for seq in [s for s in self._scanned if s < first_seq]:
                del self._scanned[seq]  # discarded by the stream's limits since
            for seq in missing:
                msg = await self._message(stream, seq) if seq >= first_seq else None
                self._scanned[seq] = self._trusted(seq, msg)
        trusted = [a for a in self._scanned.values() if a is not None]
        return max(trusted, key=lambda a: a.version, default=None)

    def _trusted(self, seq: int, msg) -> WeightAnnouncement | None:
        """The announcement message `seq` holds if it decodes and the trainer signed it."""
        if msg is None:
            return None
        try:
            ann = decode(msg.data, WeightAnnouncement)
        except DecodeError as e:
            self._log_once(f"decode/{seq}", "bad_weight_announcement", reason=str(e))
            return None
        return ann if self.rejection(ann) is None else None

    async def _message(self, stream: str, seq: int):
        """Message `seq` of `stream`, None when it is gone (discarded by the stream's limits)."""
        try:
            return await self._js.get_msg(stream, seq)
        except NotFoundError as e:
            if e.err_code == NO_MESSAGE_FOUND:
                return None
            raise
