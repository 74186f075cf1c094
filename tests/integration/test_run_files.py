"""A run's shared files through a real server (`areal.bus.run_files`), and an embedded server
that listens on every interface (`nats.listen_host`)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
from pathlib import Path

import pytest

from areal.bus.embedded import EmbeddedNats
from areal.bus.run_files import (
    RunFilesCorrupt,
    RunFilesMissing,
    fetch_run_files,
    publish_run_files,
)
from areal.bus.weights import CHUNK_BYTES, WeightsChannel
from schemas.run_files import MANIFEST_NAME
from schemas.subjects import RunNames

pytestmark = pytest.mark.integration


def files_on_disk(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


async def test_shared_files_arrive_verified_and_are_downloaded_once(nats_url, run_id, tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(os.urandom(2 * CHUNK_BYTES + 7))  # three chunks
    files = {"config.json": b'{"run_id": "x"}', "model/model.safetensors": weights}
    manifest = await publish_run_files(nats_url, run_id, files)
    assert (
        manifest.get("model/model.safetensors").sha256
        == hashlib.sha256(weights.read_bytes()).hexdigest()
    )

    got, where = await fetch_run_files(nats_url, run_id, tmp_path / "remote")
    assert got == manifest
    assert where == tmp_path / "remote" / f"{run_id}-{manifest.digest[:16]}"
    assert files_on_disk(where) == {
        "config.json": b'{"run_id": "x"}',
        "model/model.safetensors": weights.read_bytes(),
    }
    # a second replica on this host reuses the complete copy; no temporary dir is left behind
    stamp = (where / "model" / "model.safetensors").stat().st_mtime_ns
    _, again = await fetch_run_files(nats_url, run_id, tmp_path / "remote")
    assert again == where and (where / "model" / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "remote").iterdir()] == [where.name]


async def test_replicas_joining_at_once_share_one_complete_copy(nats_url, run_id, tmp_path):
    await publish_run_files(nats_url, run_id, {"model/w.bin": os.urandom(CHUNK_BYTES + 1)})
    results = await asyncio.gather(
        *(fetch_run_files(nats_url, run_id, tmp_path / "remote") for _ in range(3))
    )
    assert len({where for _, where in results}) == 1
    assert [p.name for p in (tmp_path / "remote").iterdir()] == [results[0][1].name]


async def test_republishing_uploads_only_changes_and_drops_stale_files(nats_url, run_id, tmp_path):
    first = await publish_run_files(nats_url, run_id, {"a.txt": b"a", "b.txt": b"b"})
    second = await publish_run_files(nats_url, run_id, {"a.txt": b"a", "c.txt": b"c"})
    assert first.digest != second.digest
    _, where = await fetch_run_files(nats_url, run_id, tmp_path / "remote")
    assert files_on_disk(where) == {"a.txt": b"a", "c.txt": b"c"}
    channel = WeightsChannel(nats_url, "test-reader", RunNames(run_id).files_bucket)
    await channel.start()
    try:
        with pytest.raises(FileNotFoundError):
            await channel.get("b.txt")  # deleted once the new manifest was written
    finally:
        await channel.close()


async def test_a_file_that_does_not_match_its_manifest_is_rejected(nats_url, run_id, tmp_path):
    await publish_run_files(nats_url, run_id, {"model/w.bin": b"the real weights"})
    channel = WeightsChannel(nats_url, "test-tamper", RunNames(run_id).files_bucket)
    await channel.start()
    try:
        await channel.put("model/w.bin", b"something else")  # behind the manifest's back
    finally:
        await channel.close()
    with pytest.raises(RunFilesCorrupt, match=r"model/w\.bin .* does not match its manifest"):
        await fetch_run_files(nats_url, run_id, tmp_path / "remote")
    assert not (tmp_path / "remote").exists() or not list((tmp_path / "remote").iterdir())


async def test_a_run_that_shares_nothing_is_a_clear_error_at_once(nats_url, run_id, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RunFilesMissing, match=r"shares no files .*--config FILE instead of --join"):
        await fetch_run_files(nats_url, run_id, tmp_path / "remote")
    assert time.monotonic() - t0 < 30  # hang guard


def _an_address_of_this_host_other_than_loopback() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: picks the outgoing interface
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_the_embedded_server_listens_where_it_is_told(tmp_path):
    loopback = EmbeddedNats(store_dir=tmp_path / "lo")
    assert loopback.url.startswith("nats://127.0.0.1:") and loopback.public_url is None
    with EmbeddedNats(store_dir=tmp_path / "all", host="0.0.0.0") as server:
        assert server.url == f"nats://127.0.0.1:{server.port}"  # local clients use loopback
        assert server.public_url == f"nats://{socket.gethostname()}:{server.port}"
        assert (
            f'listen: "0.0.0.0:{server.port}"'
            in (tmp_path / "all" / "nats-server.conf").read_text()
        )
        addr = _an_address_of_this_host_other_than_loopback()
        if addr is not None:  # reachable on an interface other hosts see
            with socket.create_connection((addr, server.port), timeout=5) as c:
                assert c.recv(4).startswith(b"INFO")
