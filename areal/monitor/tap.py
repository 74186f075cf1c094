"""`areal tap STREAM`: decode the messages on one stream of a run, live, one line each.

Invariant: a tap never consumes or delays pipeline messages (see `areal.bus.tap`). It shows each
message once: a publish retried after a lost ack reaches a core subscriber twice with the same
`Nats-Msg-Id` (JetStream stores it once), so the tap de-duplicates by that id.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal.bus.codec import DecodeError
from areal.bus.tap import TapMessage
from areal.monitor.format import Detokenizer, decode_for, json_line, one_line, to_record
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
        try:
            msg: Message | None = decode_for(tm.subject, tm.data)
            record = to_record(msg, self.tokenizer)
        except DecodeError as e:
            msg, record = (
                None,
                {
                    "kind": "undecodable",
                    "subject": tm.subject,
                    "bytes": len(tm.data),
                    "error": str(e),
                },
            )
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


async def run_tap(
    url: str, run_id: str, stream: str, *, tap: Tap, history: int, timeout_s: float | None
) -> int:
    from areal.bus.tap import TapClient

    client = await TapClient.connect(url, run_id)
    try:
        await client.check_run()
        await client.follow(stream, tap.on_message, history=history)
        try:
            await asyncio.wait_for(tap.done.wait(), timeout_s)
        except asyncio.TimeoutError:
            if tap.count is not None:
                print(
                    f"tap: timed out after {timeout_s}s with {tap.n}/{tap.count} messages",
                    file=sys.stderr,
                )
                return 1
    finally:
        await client.close()
    return 0
