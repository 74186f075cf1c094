"""A run's shared files on the bus: what a worker on another host needs to join the run.

`areal run` publishes the run's portable config, its model dir and its data file to the run's
object store `areal_<run>_files` (`publish_run_files`); `areal worker ROLE --join RUN_ID`
downloads them into its own cache (`fetch_run_files`). Transfers reuse the weights' channel
(`WeightsChannel`: 1 MiB chunks, a fast chunk reader, a deadline that grows with the size).

Invariants:
- the manifest (`schemas.run_files`) is written after every file it names, so a reader that
  sees a manifest sees its files; an identical file already stored (a resumed run) is not
  uploaded again, and objects the new manifest no longer names are deleted after it is written;
- every downloaded file is checked against the manifest's size and sha256 before it is kept;
  a mismatch raises `RunFilesCorrupt` and keeps nothing;
- a download directory `<dest_root>/<run>-<manifest digest[:16]>` is complete or absent: it is
  filled as a temporary sibling and renamed into place, so replicas joining at once on one host
  never see half a model, and a changed model never reuses a stale copy.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import structlog
from nats.js.api import ObjectStoreConfig
from nats.js.errors import NotFoundError

from areal.bus.auth import NO_CREDENTIALS, Credentials
from areal.bus.connection import Patience, connect
from areal.bus.weights import WeightsChannel
from schemas.run_files import MANIFEST_NAME, RunFilesManifest, SharedFile
from schemas.subjects import RunNames

log = structlog.get_logger()

MANIFEST_POLL_S = 0.5
FIRST_CONNECT_S = 15.0  # a joining worker facing a dead address says so instead of waiting


class RunFilesMissing(LookupError):
    """The run shares no files on this server (not started by `areal run`, or still starting)."""


class RunFilesCorrupt(ValueError):
    """A downloaded file does not match the manifest's size or sha256."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def _channel(
    url: str, names: RunNames, *, create: bool, credentials: Credentials, replicas: int = 1
) -> WeightsChannel:
    """A started channel on the run's files bucket; without `create`, `RunFilesMissing` when
    the bucket does not exist."""
    nc = await connect(
        url,
        f"areal-{names.run_id}-files-check",
        patience=Patience(first_connect_s=FIRST_CONNECT_S),
        hint="pass the URL the run's launcher printed, of a server that is up",
        credentials=credentials,
        auth_hint="pass this role's credentials file with --credentials FILE (a copy of the "
        "launcher's <out>/keys/nats/<role>.json, or one `areal nats-config` made)",
    )
    try:
        js = nc.jetstream()
        if create:
            await js.create_object_store(names.files_bucket, ObjectStoreConfig(replicas=replicas))
        else:
            try:
                await js.object_store(names.files_bucket)
            except NotFoundError:
                raise RunFilesMissing(
                    f"run {names.run_id!r} shares no files on {url} (no bucket "
                    f"{names.files_bucket}): join a run started by `areal run` with this run id "
                    "on this server, or start the worker with --config FILE instead of --join"
                ) from None
    finally:
        await nc.close()
    channel = WeightsChannel(url, f"areal-{names.run_id}-files", names.files_bucket, credentials)
    await channel.start()
    return channel


async def _manifest(channel: WeightsChannel) -> RunFilesManifest | None:
    try:
        raw = await channel.get(MANIFEST_NAME)
    except FileNotFoundError:
        return None
    return RunFilesManifest.model_validate_json(raw)


async def publish_run_files(
    url: str,
    run_id: str,
    files: Mapping[str, bytes | Path],
    *,
    credentials: Credentials = NO_CREDENTIALS,
    replicas: int = 1,
) -> RunFilesManifest:
    """Store `files` (object name -> content or a file to read) and then their manifest (in a
    bucket of `replicas` copies, `nats.replicas`, when it is created)."""
    names = RunNames(run_id)
    t0 = time.monotonic()
    channel = await _channel(url, names, create=True, credentials=credentials, replicas=replicas)
    try:
        old = await _manifest(channel)
        entries: list[SharedFile] = []
        uploaded = 0
        for name, src in sorted(files.items()):
            data = src if isinstance(src, bytes) else await asyncio.to_thread(src.read_bytes)
            entry = SharedFile(
                name=name, bytes=len(data), sha256=await asyncio.to_thread(_sha256, data)
            )
            if old is None or old.get(name) != entry:
                await channel.put(name, data)
                uploaded += len(data)
            entries.append(entry)
        manifest = RunFilesManifest(run_id=run_id, files=tuple(entries))
        await channel.put(MANIFEST_NAME, manifest.model_dump_json().encode())
        for stale in old.files if old is not None else ():
            if manifest.get(stale.name) is None:
                await channel.delete(stale.name)
    finally:
        await channel.close()
    log.debug(
        "run_files_published",
        bucket=names.files_bucket,
        files=len(entries),
        bytes=manifest.total_bytes,
        uploaded_bytes=uploaded,
        publish_s=round(time.monotonic() - t0, 2),
    )
    return manifest


async def fetch_run_files(
    url: str,
    run_id: str,
    dest_root: Path,
    *,
    wait_s: float = 60.0,
    credentials: Credentials = NO_CREDENTIALS,
) -> tuple[RunFilesManifest, Path]:
    """(manifest, local dir holding every shared file), downloading what is not cached yet.

    Waits up to `wait_s` for a manifest (the launcher may still be uploading), then raises
    `RunFilesMissing`."""
    names = RunNames(run_id)
    channel = await _channel(url, names, create=False, credentials=credentials)
    try:
        deadline = time.monotonic() + wait_s
        manifest = await _manifest(channel)
        while manifest is None:
            if time.monotonic() > deadline:
                raise RunFilesMissing(
                    f"run {run_id!r} on {url} has a files bucket but no manifest after "
                    f"{wait_s:g} s: its launcher failed while sharing; restart the run"
                )
            log.info("run_files_waiting", run_id=run_id, bucket=names.files_bucket)
            await asyncio.sleep(MANIFEST_POLL_S)
            manifest = await _manifest(channel)
        dest = dest_root / f"{run_id}-{manifest.digest[:16]}"
        if (dest / MANIFEST_NAME).is_file():
            log.info("run_files_cached", path=str(dest))
            return manifest, dest
        t0 = time.monotonic()
        dest_root.mkdir(parents=True, exist_ok=True)
        tmp = dest_root / f".tmp-{dest.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            for f in manifest.files:
                data = await channel.get(f.name)
                if len(data) != f.bytes or _sha256(data) != f.sha256:
                    raise RunFilesCorrupt(
                        f"{f.name} from bucket {names.files_bucket} does not match its manifest "
                        f"({len(data)} bytes, expected {f.bytes} with sha256 {f.sha256[:12]}...): "
                        "the run re-shared its files meanwhile; start the worker again"
                    )
                path = tmp / f.name
                path.parent.mkdir(parents=True, exist_ok=True)
                await asyncio.to_thread(path.write_bytes, data)
            (tmp / MANIFEST_NAME).write_text(manifest.model_dump_json())
            try:
                os.rename(tmp, dest)
            except OSError:  # another replica on this host renamed its copy first
                if not (dest / MANIFEST_NAME).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        await channel.close()
    log.info(
        "run_files_fetched",
        path=str(dest),
        files=len(manifest.files),
        bytes=manifest.total_bytes,
        fetch_s=round(time.monotonic() - t0, 2),
    )
    return manifest, dest
