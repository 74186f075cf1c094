"""Decode a bus message and render it for people: one readable line, or one JSON line.

Pure functions (no I/O). A group message (`trajectories`, `rewards`) is shown as its samples,
one record each (`expand`). Token arrays are summarised, never dumped: length, the first few ids,
and for log-probs the mean; versions as their min..max. Text is decoded with a tokenizer when
one is given (`output_text` already travels in samples).
"""

from __future__ import annotations

import json
import math
from typing import Any, Protocol

from pydantic import BaseModel

from areal.bus.codec import decode, unpack
from schemas import (
    DeadLetter,
    Event,
    Message,
    MetricRecord,
    PackedArray,
    Sample,
    SampleGroup,
    ScoredGroup,
    ScoredSample,
    Task,
    WeightAnnouncement,
)
from schemas import subjects as S

MESSAGE_OF_STREAM: dict[str, type[Message]] = {
    S.PROMPTS: Task,
    S.TRAJECTORIES: SampleGroup,
    S.REWARDS: ScoredGroup,
    S.WEIGHTS: WeightAnnouncement,
    S.METRICS: MetricRecord,
    S.EVENTS: Event,
    S.DLQ: DeadLetter,
}
HEAD_IDS = 6
# What a metric line shows when no --fields are given (the rest is in --json).
STEP_FIELDS = (
    "step",
    "version",
    "reward_mean",
    "samples",
    "staleness_max",
    "dropped_stale",
    "loss",
    "interrupted_frac",
    "wall_s",
)


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def stream_of_subject(subject: str) -> str:
    """`areal.<run>.metrics.trainer.step` -> `metrics`."""
    parts = subject.split(".")
    return parts[2] if len(parts) > 2 else ""


def decode_for(subject: str, data: bytes) -> Message:
    """Decode a payload by the stream its subject belongs to (raises `DecodeError`)."""
    return decode(data, MESSAGE_OF_STREAM[stream_of_subject(subject)])


def summarise_array(arr: PackedArray, head: int = HEAD_IDS) -> dict[str, Any]:
    values = unpack(arr)
    out: dict[str, Any] = {"len": int(len(values))}
    if arr.dtype.startswith("float"):
        out["mean"] = round(float(values.mean()), 4) if len(values) else None
    else:
        out["head"] = [int(v) for v in values[:head]]
    return out


def _versions(arr: PackedArray) -> dict[str, Any]:
    """Length and range of a sample's versions; environment tokens (-1) are no policy's."""
    v = unpack(arr)
    model = v[v >= 0]
    return {
        "len": int(len(v)),
        "min": int(model.min()) if len(model) else None,
        "max": int(model.max()) if len(model) else None,
    }


def expand(msg: Message) -> list[Message]:
    """A group message as its samples (what people read: one line each); any other as itself."""
    if isinstance(msg, SampleGroup):
        return list(msg.samples)
    if isinstance(msg, ScoredGroup):
        return list(msg.scored)
    return [msg]


def to_record(msg: Message, tokenizer: Detokenizer | None = None) -> dict[str, Any]:
    """A JSON-able dict of the message with arrays summarised (and texts, given a tokenizer)."""
    if isinstance(msg, ScoredSample):
        rec = {
            "kind": msg.kind,
            "reward": msg.reward,
            "verifier": msg.verifier,
            "reward_worker_id": msg.reward_worker_id,
            "sample": to_record(msg.sample, tokenizer),
        }
        rec["sample"].pop("kind", None)
        return rec
    rec: dict[str, Any] = {"kind": msg.kind}
    for name, value in msg:
        if name == "schema_version":
            continue
        if isinstance(value, PackedArray):
            value = _versions(value) if name == "versions" else summarise_array(value)
        elif isinstance(value, bytes):
            value = {"len": len(value), "head": value[:32].hex()}
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            value = [v.model_dump() for v in value]  # a sample's turns and tool calls
        rec[name] = value
    if isinstance(msg, WeightAnnouncement):
        rec["bytes"] = rec.pop("nbytes")
    if tokenizer is not None and isinstance(msg, Sample):
        rec["prompt_text"] = tokenizer.decode(
            unpack(msg.prompt_ids).tolist(), skip_special_tokens=False
        )
        rec["output_decoded"] = tokenizer.decode(
            unpack(msg.output_ids).tolist(), skip_special_tokens=False
        )
    if isinstance(msg, Sample):
        rec["sample_id"] = msg.sample_id
    return rec


def get_field(rec: dict[str, Any], path: str) -> Any:
    """Dotted lookup; for metric records a bare name also finds `values.<name>`."""
    cur: Any = rec
    for part in path.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            values = rec.get("values")
            if isinstance(values, dict) and path in values:
                return values[path]
            return None
    return cur


def select(rec: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    return {f: get_field(rec, f) for f in fields}


def fmt_value(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.4g}"
    if isinstance(v, dict) and "len" in v and ("head" in v or "mean" in v or "min" in v):
        return _fmt_array(v)
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(",", ":"), default=str)
    return str(v)


def _fmt_array(a: dict[str, Any]) -> str:
    if "mean" in a:
        return f"{a['len']}tok mean {fmt_value(a['mean'])}"
    if "min" in a:
        return f"{a['len']}tok v{a['min']}..{a['max']}"
    more = ",…" if a["len"] > len(a["head"]) else ""
    return f"{a['len']}tok[{','.join(map(str, a['head']))}{more}]"


def _q(text: str, limit: int = 60) -> str:
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return json.dumps(text, ensure_ascii=False)


def _kv(pairs: dict[str, Any]) -> str:
    return " ".join(f"{k}={fmt_value(v)}" for k, v in pairs.items() if v is not None)


def one_line(rec: dict[str, Any], fields: list[str] | None = None) -> str:
    """A readable one-line summary of a record made by `to_record`."""
    kind = rec.get("kind", "?")
    if fields:
        return f"{kind} {_kv(select(rec, fields))}"
    if kind == "task":
        return (
            f"task {rec['task_id']} seq={rec['seq']} v{rec['admitted_version']} "
            f"G={rec['group_size']} prompt={_q(rec['prompt'])} "
            f"ids={_fmt_array(rec['prompt_ids'])} answer={_q(rec['answer'])}"
        )
    if kind == "sample":
        return _sample_line(rec)
    if kind == "scored_sample":
        err = rec["verifier"].get("error")
        return (
            f"scored {rec['sample']['sample_id']} reward={fmt_value(rec['reward'])} "
            f"by {rec['reward_worker_id'] or '?'}{' error=' + _q(err) if err else ''} | "
            + _sample_line(rec["sample"], prefix=False)
        )
    if kind == "weights":
        return (
            f"weights v{rec['version']} step={rec['step']} {rec['bytes'] / 1e6:.2f} MB "
            f"{rec['dtype']} sha256={rec['sha256'][:12]} {rec['uri']}"
        )
    if kind == "metric":
        values = rec["values"]
        shown = {k: values.get(k) for k in STEP_FIELDS} if rec["type"] == "step" else values
        return f"metric {rec['role']}/{rec['worker_id']} {rec['type']} {_kv(shown)}"
    if kind == "event":
        return f"event {rec['type']} {rec['role']}/{rec['worker_id'] or '?'} {_kv(rec['detail'])}"
    if kind == "dead_letter":
        return (
            f"dlq {rec['stage']} from {rec['worker_id'] or '?'} on {rec['subject']} "
            f"payload={rec['payload']['len']}B reason={_q(rec['reason'], 200)}"
        )
    return f"{kind} {_kv(rec)}"


def _sample_line(s: dict[str, Any], prefix: bool = True) -> str:
    text = s.get("output_decoded") or s.get("output_text", "")
    parts = [
        f"sample {s['sample_id']}" if prefix else "",
        f"by {s['worker_id'] or '?'}",
        f"v{s['versions']['min']}..{s['versions']['max']}" if s["versions"]["len"] else "v-",
        f"out={_fmt_array(s['output_ids'])}",
        f"logp_mean={fmt_value(s['behav_logp'].get('mean'))}",
        f"text={_q(text)}",
        f"answer={_q(s['answer'])}",
        f"finish={s['finish_reason']}",
    ]
    if s.get("n_interrupts"):
        parts.append(f"interrupts={s['n_interrupts']} reprefill={s['n_reprefill_tokens']}")
    if s.get("prompt_text"):
        parts.insert(1, f"prompt={_q(s['prompt_text'])}")
    line = " ".join(p for p in parts if p)
    if not s.get("turns"):
        return line
    calls = s.get("tool_calls") or []
    errors = sum(1 for c in calls if c.get("error"))
    line += f" turns={s.get('n_turns', 1)} tool_calls={len(calls)} tool_errors={errors}"
    return "\n".join([line, *episode_lines(s["turns"], calls)])


def episode_lines(turns: list[dict[str, Any]], calls: list[dict[str, Any]]) -> list[str]:
    """An episode turn by turn: the model's text apart from the environment's (tool output),
    each environment turn with the call it answers."""
    out, pending = [], iter(calls)
    for t in turns:
        if t["role"] == "model":
            out.append(f"    model {t['n_tokens']:>4} tok  {_q(t['text'], 160)}")
            continue
        call = next(pending, None)
        how = ""
        if call is not None:
            how = f" {call['name']}({_q(call['arguments'], 40)}) {call['latency_s']:.2f}s"
            how += f" error={_q(call['error'], 60)}" if call.get("error") else ""
        out.append(f"    tool  {t['n_tokens']:>4} tok {_q(t['text'], 160)}{how}")
    return out


def json_line(rec: dict[str, Any], fields: list[str] | None = None) -> str:
    return json.dumps(select(rec, fields) if fields else rec, default=str, ensure_ascii=False)
