"""Connecting to NATS with options that survive server restarts and long runs.

Workers reconnect forever (the default gives up after ~2 minutes) and ping every 15 s, so a dead
TCP connection is noticed quickly.
"""

from __future__ import annotations

import nats
import structlog
from nats.aio.client import Client

log = structlog.get_logger()


async def connect(url: str, name: str, *, connect_timeout_s: float = 5.0) -> Client:
    async def on_error(e: Exception) -> None:
        log.warning("nats_error", error=f"{type(e).__name__}: {e}", client=name)

    async def on_disconnect() -> None:
        log.warning("nats_disconnected", client=name)

    async def on_reconnect() -> None:
        log.info("nats_reconnected", client=name)

    try:
        return await nats.connect(
            url,
            name=name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=1.0,
            ping_interval=15,
            max_outstanding_pings=3,
            connect_timeout=connect_timeout_s,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
    except Exception as e:
        raise ConnectionError(
            f"cannot connect to NATS at {url}: {type(e).__name__}: {e} "
            "(start a server with JetStream enabled, e.g. `nats-server -js`, or omit the URL to "
            "use the embedded one)"
        ) from e
