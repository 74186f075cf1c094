"""The simulator's model of a JetStream work queue: msg-id de-duplication within a window,
deliveries held by leases, ack / nak that may be lost on the way, redelivery after ack-wait.

Invariant: a message leaves the queue only when some lease of it is acked (and the ack is not
lost); until then it is delivered again whenever it is not out (never delivered, nak'ed, or its
ack-wait expired), so nothing published is ever lost by the queue itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Clock", "Msg", "SimLease", "Stream", "expire"]


class Clock(Protocol):
    """What a stream needs from the simulator: its event count and its lost-message dice."""

    n_events: int

    def lost(self) -> bool: ...


@dataclass
class Msg:
    seq: int
    msg_id: str
    body: Any
    out: bool = False  # delivered and not yet settled or expired
    delivered_at: int = 0
    holder: str = ""  # the incarnation that took the last delivery


class SimLease:
    """A delivery's handle (the bus `Lease` in production): `ack()` / `nak()`, maybe lost."""

    __slots__ = ("msg", "stream")

    def __init__(self, stream: Stream, msg: Msg) -> None:
        self.stream, self.msg = stream, msg

    def ack(self) -> None:
        self.stream.settle(self.msg, ack=True)

    def nak(self) -> None:
        self.stream.settle(self.msg, ack=False)


class Stream:
    """A work queue: msg-id de-duplication, any lease's ack removes the message."""

    def __init__(self, sim: Clock, dedup: bool, window: int | None) -> None:
        self.sim, self.dedup, self.window = sim, dedup, window
        self.msgs: dict[int, Msg] = {}  # unacked
        self.seen: dict[str, int] = {}  # msg-id -> publish time
        self.n_published = 0

    def publish(self, msg_id: str, body: Any) -> bool:
        now, t = self.sim.n_events, self.seen.get(msg_id)
        if self.dedup and t is not None and (self.window is None or now - t < self.window):
            return False
        self.seen[msg_id] = now
        self.msgs[self.n_published] = Msg(self.n_published, msg_id, body)
        self.n_published += 1
        return True

    def available(self) -> list[Msg]:
        return [m for m in self.msgs.values() if not m.out]

    def deliver(self, msg: Msg, holder: str) -> SimLease:
        msg.out, msg.delivered_at, msg.holder = True, self.sim.n_events, holder
        return SimLease(self, msg)

    def settle(self, msg: Msg, *, ack: bool) -> None:
        if self.sim.lost():
            return  # never reaches the server: the message comes back after ack-wait
        if ack:
            self.msgs.pop(msg.seq, None)
        elif msg.seq in self.msgs:
            msg.out = False


def expire(msg: Msg) -> None:
    msg.out = False  # ack-wait passed: delivered again (the old lease still settles it)
