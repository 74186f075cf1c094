"""A nats-server whose store's disk fills up (issue 42), for real: a tmpfs store, filled.

nats-server stops writing a stream after the write error and does not try again by itself,
even once the disk has room (publishes then wait unanswered); `EmbeddedNats.store_write_error`
sees it on the monitor's `/healthz`, and the launcher's `StoreWatch` restarts the server once
there is room, after which the same stream takes publishes again. Mounting needs root: skipped
otherwise."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
from pathlib import Path

import nats
import nats.errors
import pytest
from structlog.testing import capture_logs

from areal.bus.embedded import EmbeddedNats, free_port
from areal.launch.store_watch import StoreWatch

pytestmark = pytest.mark.integration


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (mount -t tmpfs)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> None:
    with open(path, "wb", buffering=0) as f:
        for size in (2**20, 2**12, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC


async def test_a_store_on_a_full_disk_is_seen_and_healed_by_a_restart_once_there_is_room(
    small_disk,
):
    server = EmbeddedNats(store_dir=small_disk / "nats", monitor_port=free_port()).start()
    nc = None
    try:
        assert server.store_write_error() is None
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        js = nc.jetstream()
        await js.add_stream(name="S", subjects=["s.>"])
        await js.publish("s.a", b"x" * 1000)
        fill(small_disk / "filler")
        with pytest.raises(nats.errors.TimeoutError):  # the server does not even answer
            await js.publish("s.a", b"y" * 100_000, timeout=2)
        error = server.store_write_error()
        assert error is not None and "no space left on device" in error
        watch = StoreWatch(server, poll_s=0.2)
        with capture_logs() as logs:
            watch.check()  # the disk is still full: reported, not restarted
            assert watch.failed_since is not None and watch.restarts == 0
            (small_disk / "filler").unlink()
            await asyncio.sleep(0)
            # the stream still refuses, though the disk has room: only a restart heals it
            with pytest.raises(nats.errors.TimeoutError):
                await js.publish("s.a", b"z", timeout=1)
            async with asyncio.timeout(60):  # hang guard
                while watch.failed_since is not None:
                    watch.check()
                    await asyncio.sleep(0.1)
        said = [r["event"] for r in logs]
        assert said.count("storage_full") == 1 and said.count("storage_recovered") == 1
        assert watch.restarts == 1 and server.store_write_error() is None
        async with asyncio.timeout(60):  # hang guard: the client reconnects to the restart
            ack = await js.publish("s.a", b"after", timeout=10)
        assert ack.stream == "S" and ack.seq >= 2
    finally:
        if nc is not None:
            await nc.close()
        server.stop()
