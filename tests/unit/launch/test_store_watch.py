"""The launcher's watch over the embedded nats-server's store (issue 42): nats-server stops
writing a stream after a disk error until it is restarted, so the launcher restarts it, but only
once the disk has room, with backoff while restarts do not heal it, and reports the pause once.

A stand-in server (what `StoreWatch` asks of `EmbeddedNats`: its store's write error, a
restart) and a fake clock; the real server on a real full disk is in the e2e test."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from areal.launch.store_watch import MIN_FREE_BYTES, StoreWatch

FULL = "JetStream stream 'A > S' write error: write /x/1.blk: no space left on device"


class Server:
    def __init__(self, store_dir: Path) -> None:
        self.store_dir = store_dir
        self.error: str | None = None  # what /healthz says
        self.heals = True  # whether a restart clears the error
        self.start_fails = 0  # restarts that fail to start
        self.restarts = 0
        self.clock = lambda: 0.0
        self.restarted_at: list[float] = []

    def store_write_error(self) -> str | None:
        return self.error

    def restart(self) -> None:
        self.restarts += 1
        self.restarted_at.append(self.clock())
        if self.start_fails:
            self.start_fails -= 1
            raise TimeoutError("nats-server did not become ready in 20s")
        if self.heals:
            self.error = None


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.t = 0.0
        self.free = 0
        self.server = Server(tmp_path)
        self.server.clock = lambda: self.t
        self.watch = StoreWatch(
            self.server, poll_s=2.0, free_bytes=lambda _p: self.free, clock=lambda: self.t
        )

    def run(self, until: float, step: float = 0.1) -> None:
        while self.t < until:
            self.watch.check()
            self.t = round(self.t + step, 3)


def events(logs: list[dict]) -> list[str]:
    return [r["event"] for r in logs]


def test_a_healthy_store_is_left_alone(tmp_path):
    w = World(tmp_path)
    w.free = 10 * MIN_FREE_BYTES
    w.run(60)
    assert w.server.restarts == 0 and w.watch.pauses == 0


def test_a_full_store_is_restarted_once_the_disk_has_room_and_reported_once(tmp_path):
    w = World(tmp_path)
    w.run(5)
    w.server.error = FULL  # the disk filled: a stream stopped writing
    with capture_logs() as logs:
        w.run(30)  # still full until t = 30: no restart, however long
        assert w.server.restarts == 0
        w.free = 10 * MIN_FREE_BYTES  # room again
        w.run(40)
    assert w.server.restarts == 1 and w.server.error is None
    said = events(logs)
    assert said.count("storage_full") == 1 and said.count("storage_recovered") == 1
    assert said.count("nats_store_waiting_for_space") == 1
    full = next(r for r in logs if r["event"] == "storage_full")
    assert full["path"] == str(tmp_path) and "no space left" in full["error"]
    recovered = next(r for r in logs if r["event"] == "storage_recovered")
    # seen at the first poll after the fill (t = 6), room at t = 30, healthy half a second
    # after the restart
    assert recovered["paused_s"] == 24.5 and recovered["restarts"] == 1
    assert w.watch.failed_since is None


def test_restarts_that_do_not_heal_back_off_to_30_s(tmp_path):
    w = World(tmp_path)
    w.free = 10 * MIN_FREE_BYTES
    w.server.error = "JetStream stream 'A > S' write error: input/output error"  # EIO, not full
    w.server.heals = False
    with capture_logs() as logs:
        w.run(200)
    assert events(logs).count("write_failed") == 1  # one report for the whole pause
    # 1 s doubling, capped at 30 s
    assert w.server.restarted_at == [0, 1, 3, 7, 15, 31, 61, 91, 121, 151, 181]
    w.server.heals = True
    with capture_logs() as logs:
        w.run(240)
    assert events(logs).count("storage_recovered") == 1


def test_a_restart_that_fails_to_start_is_tried_again(tmp_path):
    w = World(tmp_path)
    w.free = 10 * MIN_FREE_BYTES
    w.server.error = FULL
    w.server.start_fails = 2
    with capture_logs() as logs:
        w.run(20)
    assert w.server.restarts == 3 and w.server.error is None
    said = events(logs)
    assert said.count("nats_server_restart_failed") == 2 and said.count("storage_recovered") == 1
