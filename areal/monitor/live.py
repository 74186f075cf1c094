"""Attach a RunState to a running run: replay history, then follow live (for top, exporter).

What is replayed on attach: every step record (so curves are full), the heartbeats of the last
`LIVE_S + 5` seconds (so live workers and their rates show at once), the latest admission
record, every event and dead letter. Work-queue traffic (trajectories, rewards) is watched with
core subscriptions only, never a consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import asdict

from areal.bus.auth import NO_CREDENTIALS, Credentials
from areal.bus.codec import DecodeError
from areal.bus.tap import TapClient, TapMessage, discover_run
from areal.monitor.format import decode_for
from areal.monitor.state import LIVE_S, RunState
from schemas import subjects as S


def note(line: str) -> None:
    """One line on stderr for the person at the terminal (stdout stays data)."""
    print(line, file=sys.stderr, flush=True)


async def resolve_run(
    url: str, run_id: str | None, credentials: Credentials = NO_CREDENTIALS
) -> str:
    """`run_id` (`--run`, else `AREAL_RUN_ID` through `MonitorSettings`), else the only run on
    the server."""
    return run_id or await discover_run(url, note=note, credentials=credentials)


def check_server(client: TapClient, command: str) -> None:
    """Raise `ConnectionError` naming the server once the observer's server is gone for good."""
    if client.lost.is_set():
        raise ConnectionError(f"{client.lost.reason}; {command} stopped")


async def attach(
    client: TapClient, state: RunState, *, step_history: bool = True, traffic: bool = True
) -> None:
    state.run_id = client.names.run_id
    state.observing_since = time.time()

    async def on_msg(tm: TapMessage) -> None:
        with contextlib.suppress(DecodeError, KeyError):
            state.fold(decode_for(tm.subject, tm.data), tm.received_at)

    await client.follow("metrics.trainer.step", on_msg, history=-1 if step_history else 1)
    await client.follow("metrics.*.heartbeat", on_msg, since_s=LIVE_S + 5)
    await client.follow("metrics.controller.admission", on_msg, history=1)
    await client.follow(S.EVENTS, on_msg, history=-1)
    await client.follow(S.DLQ, on_msg, history=-1)
    if traffic:
        await client.follow(S.TRAJECTORIES, on_msg)
        await client.follow(S.REWARDS, on_msg)


async def refresh(client: TapClient, state: RunState) -> None:
    """Poll the snapshots that have no message stream: queue depths and the KV run state."""
    state.set_queues({k: asdict(v) for k, v in (await client.stream_stats()).items()})
    state.kv = await client.kv_state()


async def refresh_every(client: TapClient, state: RunState, interval_s: float) -> None:
    while True:
        with contextlib.suppress(Exception):
            await refresh(client, state)
        await asyncio.sleep(interval_s)
