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
  `on_lost(reason)` is called exactly once; a reconnect in time cancels the countdown;
- `url` may name several servers of one cluster, comma-separated (`server_urls`): the client
  connects to one of them and, when it dies, reconnects to another (nats-py also learns the
  cluster's other servers from the one it reaches);
- credentials and TLS come in one place, `credentials` (`areal.bus.auth`); a server that refuses
  them on the first connection raises `AuthenticationFailed` at once (naming the account and
  `auth_hint`), never a silent retry; permission violations are logged with the subject and
  reported to `denials`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from nats.aio.client import Client

from areal.bus.auth import (
    NO_CREDENTIALS,
    Credentials,
    Denials,
    is_authorization_violation,
    permission_violation,
)
from areal.bus.errors import AuthenticationFailed

log = structlog.get_logger()

_SERVER_HINT = (
    "start a server with JetStream enabled, e.g. `nats-server -js`, or omit the URL to use the "
    "embedded one"
)
AUTH_HINT = (
    "pass this role's credentials file (nats.credentials_file, or nats.credentials_dir holding "
    "<role>.json): `areal run` writes one per role in <out>/keys/nats/, `areal nats-config` "
    "for a server of your own"
)


@dataclass(frozen=True)
class Patience:
    """How long a connection waits for its server (None: forever, as workers do)."""

    first_connect_s: float | None = None  # the first connection, from the call to `connect`
    reconnect_s: float | None = None  # after the server went away, before giving up


FOREVER = Patience()


def server_urls(url: str) -> list[str]:
    """The server URLs of `url`: one, or several of one cluster comma-separated
    (`nats.url`); the client connects to one and fails over to the others."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"no NATS server URL in {url!r}")
    return urls


class Reconnects:
    """Listeners called on every reconnect of one connection (after the client has renewed its
    subscriptions and sent what it buffered while disconnected)."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[], None]] = []

    def listen(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def fire(self) -> None:
        for fn in list(self._listeners):
            fn()


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 5.0,
    patience: Patience = FOREVER,
    on_lost: Callable[[str], None] | None = None,
    hint: str = _SERVER_HINT,
    credentials: Credentials = NO_CREDENTIALS,
    denials: Denials | None = None,
    reconnects: Reconnects | None = None,
    auth_hint: str = AUTH_HINT,
    quiet_until_connected: bool = False,
) -> Client:
    """A connected client, or `ConnectionError` naming `url`, the last error and `hint`
    (`AuthenticationFailed` naming the account and `auth_hint` when the server refuses the
    credentials).

    `on_lost(reason)` is called once when `patience.reconnect_s` runs out (the client is then
    closed); it is never called for a deliberate close. With `quiet_until_connected` a failed
    attempt of the first connection logs at debug, not warning (the caller reports the outcome
    in one line: `ConnectionError`)."""
    nc = Client()
    give_up: asyncio.Task[None] | None = None
    refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
    if denials is not None:
        denials.credentials = credentials

    async def on_error(e: Exception) -> None:
        violation = permission_violation(e)
        if violation is not None:
            op, subject = violation
            log.error(
                "nats_permission_denied",
                op=op,
                subject=subject,
                client=name,
                account=credentials.describe(),
            )
            if denials is not None:
                denials.report(op, subject)
            return
        if is_authorization_violation(e):
            if not refused.done() and not nc.is_connected:
                refused.set_result(e)  # the first connection: fail at once, below
            log.error("nats_authorization_violation", client=name, account=credentials.describe())
            return
        quiet = quiet_until_connected and not task.done()
        (log.debug if quiet else log.warning)(
            "nats_error", error=f"{type(e).__name__}: {e}", client=name
        )

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
        if reconnects is not None:
            reconnects.fire()

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
        servers=server_urls(url),
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
        **credentials.connect_options(),
    )
    task = asyncio.ensure_future(attempt)
    try:
        await asyncio.wait(
            {task, refused}, timeout=patience.first_connect_s, return_when=asyncio.FIRST_COMPLETED
        )
    except BaseException:  # cancelled: take the attempt down with us
        task.cancel()
        with contextlib.suppress(BaseException):
            await nc.close()
        raise
    if task.done() and not task.cancelled() and task.exception() is None:
        refused.cancel()
        return nc
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    last = _describe(nc.last_error)
    error = task.exception() if task.done() and not task.cancelled() else None
    with contextlib.suppress(Exception):
        await nc.close()
    if (refused.done() and not refused.cancelled()) or is_authorization_violation(error):
        given = (
            f"{credentials.describe()} was refused (a wrong or stale password?)"
            if credentials.given
            else "no credentials were given, and the server requires them"
        )
        raise AuthenticationFailed(
            f"cannot connect to NATS at {url}: authorization violation: {given}; {auth_hint}"
        ) from None
    if error is not None:
        raise ConnectionError(
            f"cannot connect to NATS at {url}: {type(error).__name__}: {error} ({hint})"
        ) from error
    raise ConnectionError(
        f"cannot connect to NATS at {url}: no answer within {patience.first_connect_s:g} s "
        f"(last error: {last}); {hint}"
    ) from None


def _describe(e: BaseException | None) -> str:
    if e is None:
        return "none"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
