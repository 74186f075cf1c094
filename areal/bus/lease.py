"""A consumed message until it is settled: ack (its effect is durable), nak (hand it back, maybe
after a delay) or dead-letter (to `areal.<run>.dlq.<stage>` with the reason, then ack).

Invariant: a lease is settled at most once; settling it removes it from the bus's heartbeats and
gives its consume loop room for another message.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from areal.bus.jetstream import PullInbox

if TYPE_CHECKING:
    from areal.bus.client import Bus


class Lease:
    """A consumed message until it is settled (ack / nak / term)."""

    def __init__(self, bus: Bus, msg: Msg, stage: str, owner: PullInbox | None = None) -> None:
        self.bus, self.msg, self.stage = bus, msg, stage
        self.owner = owner  # the consume loop that holds this lease (room for more when settled)
        self.settled = False
        self.received_at = time.monotonic()

    @property
    def num_delivered(self) -> int:
        return self.msg.metadata.num_delivered

    def _settle(self) -> None:
        self.settled = True
        self.bus._leases.discard(self)
        if self.owner is not None:
            self.owner.release(self)

    async def ack(self) -> None:
        if not self.settled:
            self._settle()
            await self.msg.ack()

    async def nak(self, delay_s: float | None = None) -> None:
        if not self.settled:
            self._settle()
            await self.msg.nak(delay=delay_s)

    async def dead_letter(self, reason: str) -> None:
        if not self.settled:
            await self.bus.dead_letter(self.stage, self.msg, reason)
            await self.ack()
