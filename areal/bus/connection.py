"""Connecting to NATS with options that survive server restarts and long runs.

Workers reconnect forever (the default gives up after ~2 minutes) and ping every 15 s, so a dead
TCP connection is noticed quickly. Observers (`areal tap | top | metrics-exporter`) pass a
`Patience` instead: they give up on a server that does not answer, with an error naming the URL,
rather than waiting in silence.

Invariants:
- a deliberate close (`close()` / `drain()` by the owner) logs no warning: `nats_disconnected`
  is a warning only when the server went away while the client still wanted it (the client is
  then reconnecting, not closed);
- with `Patience.first_connect_s` set, `connect` returns or raises `ConnectionError` within
  that many seconds (plus at most one `connect_timeout_s` of the attempt under way);
- with `Patience.reconnect_s` set, a connection that stays disconnected that long is closed and
  `on_lost(reason)` is called exactly once; a reconnect in time cancels the countdown.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from nats.aio.client import Client

log = structlog.get_logger()

_SERVER_HINT = (
    "start a server with JetStream enabled, e.g. `nats-server -js`, or omit the URL to use the "
    "embedded one"
)


@dataclass(frozen=True)
class Patience:
    """How long a connection waits for its server (None: forever, as workers do)."""

    first_connect_s: float | None = None  # the first connection, from the call to `connect`
    reconnect_s: float | None = None  # after the server went away, before giving up


FOREVER = Patience()


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 5.0,
    patience: Patience = FOREVER,
    on_lost: Callable[[str], None] | None = None,
    hint: str = _SERVER_HINT,
) -> Client:
    """A connected client, or `ConnectionError` naming `url`, the last error and `hint`.

    `on_lost(reason)` is called once when `patience.reconnect_s` runs out (the client is then
    closed); it is never called for a deliberate close."""
    nc = Client()
    give_up: asyncio.Task[None] | None = None

    async def on_error(e: Exception) -> None:
        log.warning("nats_error", error=f"{type(e).__name__}: {e}", client=name)

    async def on_disconnect() -> None:
        nonlocal give_up
        if nc.is_closed:  # our own close()/drain(): nothing went wrong
            log.debug("nats_closed", client=name)
            return
        log.warning("nats_disconnected", client=name)
        if patience.reconnect_s is not None and (give_up is None or give_up.done()):
            give_up = asyncio.ensure_future(_give_up_after(patience.reconnect_s))

    async def on_reconnect() -> None:
        if give_up is not None:
            give_up.cancel()
        log.info("nats_reconnected", client=name)

    async def _give_up_after(delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if nc.is_connected or nc.is_closed:
            return
        reason = (
            f"lost the NATS server at {url}: no reconnect within {delay_s:g} s "
            f"(last error: {_describe(nc.last_error)})"
        )
        log.warning("nats_gave_up", client=name, reason=reason)
        with contextlib.suppress(Exception):
            await nc.close()
        if on_lost is not None:
            on_lost(reason)

    attempt = nc.connect(
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
    try:
        await asyncio.wait_for(attempt, patience.first_connect_s)
    except asyncio.TimeoutError:
        last = _describe(nc.last_error)
        with contextlib.suppress(Exception):
            await nc.close()
        raise ConnectionError(
            f"cannot connect to NATS at {url}: no answer within {patience.first_connect_s:g} s "
            f"(last error: {last}); {hint}"
        ) from None
    except Exception as e:
        with contextlib.suppress(Exception):
            await nc.close()
        raise ConnectionError(
            f"cannot connect to NATS at {url}: {type(e).__name__}: {e} ({hint})"
        ) from e
    return nc


def _describe(e: BaseException | None) -> str:
    if e is None:
        return "none"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
