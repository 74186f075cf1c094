"""`areal tap STREAM`: decode the messages on one stream of a run, live, one line each.

Invariant: a tap never consumes or delays pipeline messages (see `areal.bus.tap`). It shows each
message once: a publish retried after a lost ack reaches a core subscriber twice with the same
`Nats-Msg-Id` (JetStream stores it once), so the tap de-duplicates by that id. A group message
(`trajectories`, `rewards`: all G samples of a task) is shown as its samples, one line each, and
`count` counts those lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal.bus.auth import NO_CREDENTIALS, Credentials
from areal.bus.codec import DecodeError
from areal.bus.tap import TapMessage
from areal.monitor.format import Detokenizer, decode_for, expand, json_line, one_line, to_record
from schemas import Message

SEEN_IDS_MAX = 200_000


@dataclass
class TapItem:
    tm: TapMessage
    msg: Message | None
    record: dict[str, Any]


@dataclass
class Tap:
    """Decodes, de-duplicates, renders and counts tapped messages."""

    emit: Callable[[str], None] | None = print
    as_json: bool = False
    fields: list[str] | None = None
    tokenizer: Detokenizer | None = None
    count: int | None = None
    on_item: Callable[[TapItem], None] | None = None
    n: int = 0
    duplicates: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    _seen: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def _is_duplicate(self, msg_id: str | None) -> bool:
        if msg_id is None:
            return False
        if msg_id in self._seen:
            self.duplicates += 1
            return True
        self._seen[msg_id] = None
        if len(self._seen) > SEEN_IDS_MAX:
            self._seen.popitem(last=False)
        return False

    async def on_message(self, tm: TapMessage) -> None:
        if self.done.is_set() or self._is_duplicate(tm.msg_id):
            return
        items: list[tuple[Message | None, dict[str, Any]]]
        try:
            items = [
                (m, to_record(m, self.tokenizer)) for m in expand(decode_for(tm.subject, tm.data))
            ]
        except DecodeError as e:
            undecodable = {
                "kind": "undecodable",
                "subject": tm.subject,
                "bytes": len(tm.data),
                "error": str(e),
            }
            items = [(None, undecodable)]
        for msg, record in items:  # a group message: one item per sample
            if self.done.is_set():
                return
            self.n += 1
            if self.emit is not None:
                self.emit(self.render(tm, record))
            if self.on_item is not None:
                self.on_item(TapItem(tm, msg, record))
            if self.count is not None and self.n >= self.count:
                self.done.set()

    def render(self, tm: TapMessage, record: dict[str, Any]) -> str:
        if self.as_json:
            meta = {"subject": tm.subject, "received_at": round(tm.received_at, 6)}
            if tm.stream_seq is not None:
                meta["seq"] = tm.stream_seq
            return json_line({**meta, **record} if not self.fields else record, self.fields)
        if record["kind"] == "undecodable":
            return f"undecodable {tm.subject} {record['bytes']}B: {record['error']}"
        return one_line(record, self.fields)


def load_detokenizer(path: str) -> Detokenizer:
    """A tokenizer from a model dir, or from a run dir / config.json naming the model path."""
    p = Path(path)
    cfg = p if p.is_file() else p / "config.json"
    model_dir = p
    if cfg.is_file() and not (p.is_dir() and (p / "tokenizer_config.json").exists()):
        model = json.loads(cfg.read_text()).get("model")
        if isinstance(model, dict) and model.get("path"):
            model_dir = Path(model["path"])
    if not any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(
            f"no tokenizer in {model_dir}: pass a model dir, or a run dir / config.json whose "
            "model.path names one"
        )
    from areal.data.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


async def settle(tap: Tap, quiet_s: float, max_s: float) -> None:
    """Return once no message reached `tap` for `quiet_s` (the tail of a replay or of the
    run's last publishes), after at most `max_s`, or at once when its count is reached."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_s
    seen = -1
    while tap.n != seen and not tap.done.is_set() and loop.time() < deadline:
        seen = tap.n
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(tap.done.wait(), quiet_s)


async def run_tap(
    url: str,
    run_id: str,
    stream: str,
    *,
    tap: Tap,
    history: int,
    timeout_s: float | None,
    note: Callable[[str], None] | None = None,
    quiet_s: float = 1.0,
    credentials: Credentials | None = None,
) -> int:
    """Follow `stream` of the run until `tap.count` messages, `timeout_s`, the run's end or the
    server's loss, whichever comes first.

    Returns 0 when the count is reached or the run finished (with `count` unset), 1 when the
    timeout or the run's end came before the count; raises `ConnectionError` when the server
    is gone (`TapClient.lost`). Each way of stopping says so in one `note` line (default:
    stderr)."""
    from areal.bus.tap import TapClient
    from areal.monitor.live import note as stderr_note

    note = note or stderr_note

    client = await TapClient.connect(
        url, run_id, note=note, credentials=credentials or NO_CREDENTIALS
    )
    try:
        await client.check_run()
        finished = asyncio.Event()
        await client.on_run_finished(finished.set)  # before the check: no gap
        if await client.run_finished():
            finished.set()
        await client.follow(stream, tap.on_message, history=history)
        subject = client.subject(stream)
        note(f"tap: following {subject} on {url} (stops at the run's end; Ctrl-C to stop)")
        waits = {
            asyncio.ensure_future(tap.done.wait()): "count",
            asyncio.ensure_future(finished.wait()): "finished",
            asyncio.ensure_future(client.lost.event.wait()): "lost",
        }
        try:
            done, _ = await asyncio.wait(
                waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waits:
                w.cancel()
        why = {waits[w] for w in done}
        if "count" in why or tap.done.is_set():
            return 0
        if "lost" in why:
            raise ConnectionError(f"{client.lost.reason}; tap stopped after {tap.n} messages")
        if "finished" in why:
            await settle(tap, quiet_s, max_s=30.0)  # what was published before the end
            if tap.done.is_set():
                return 0
            counted = f"{tap.n}/{tap.count}" if tap.count is not None else str(tap.n)
            note(f"tap: run {run_id} has finished; nothing more will come ({counted} messages)")
            return 0 if tap.count is None else 1
        if tap.count is not None:
            note(f"tap: timed out after {timeout_s}s with {tap.n}/{tap.count} messages")
            return 1
        return 0
    finally:
        await client.close()
