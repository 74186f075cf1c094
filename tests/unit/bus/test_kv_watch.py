"""`KVWatch` outlives its server-side consumer: after a reconnect (or `reopen()`) it opens a new
one, retrying while the server cannot make one yet, and says True once (read the key again)."""

from __future__ import annotations

import asyncio

import nats.errors
from nats.js.kv import KeyValue

from areal.bus.kv import KVWatch


class Watcher:
    """A library watcher: the replay of the current value (one entry, then None), then
    `writes` entries, then timeouts."""

    def __init__(self, writes: int = 0) -> None:
        entry = KeyValue.Entry("b", "k", b"v", 1, 0, None, None)
        self.queue: list[KeyValue.Entry | None] = [entry, None] + [entry] * writes
        self.stopped = False

    async def updates(self, timeout: float):
        if self.queue:
            return self.queue.pop(0)
        await asyncio.sleep(min(timeout, 0.01))
        raise nats.errors.TimeoutError

    async def stop(self) -> None:
        self.stopped = True


def test_a_reconnect_reopens_the_watch_once_the_server_can_make_one():
    async def main() -> None:
        reconnects, opened, failures = [0], [], [2]

        async def open_watcher():
            if opened and failures[0] > 0:  # the server is not back yet
                failures[0] -= 1
                raise nats.errors.NoRespondersError
            opened.append(Watcher(writes=1 if opened else 0))
            return opened[-1]

        watch = await KVWatch.open(open_watcher, lambda: reconnects[0])
        assert await watch.wait(0.05) is False  # the replay of the start value is no change
        reconnects[0] = 1  # the connection came back (its consumer is gone)
        assert await watch.wait(30.0) is True  # reopened after two failed tries: read again
        assert watch.reopened == 1 and len(opened) == 2 and opened[0].stopped
        assert await watch.wait(30.0) is True  # a write through the new consumer
        assert await watch.wait(0.05) is False
        watch.reopen()  # a caller saw a write it was not told of
        assert await watch.wait(30.0) is True and watch.reopened == 2
        await watch.stop()
        assert await watch.wait(0.05) is False and opened[-1].stopped

    asyncio.run(main())


def test_a_watch_that_cannot_reopen_in_time_answers_false():
    async def main() -> None:
        reconnects = [0]

        async def open_watcher():
            if reconnects[0]:
                raise nats.errors.ConnectionReconnectingError
            return Watcher()

        watch = await KVWatch.open(open_watcher, lambda: reconnects[0])
        reconnects[0] = 1
        assert await watch.wait(0.2) is False  # a timeout is an answer, never an exception
        assert watch.reopened == 0

    asyncio.run(main())
