"""Wire messages: one pydantic model per message family.

Invariants:
- every message carries `schema_version`; a reader rejects a version it does not support with a
  clear error, and ignores unknown fields (so writers may add fields without a version bump);
  writers write `SCHEMA_VERSION`, readers accept every version of `READABLE_SCHEMA_VERSIONS`
  (version 1, before episodes: a sample without `loss_mask` and the episode fields, which
  their defaults fill: every output token trained, one turn, no tool call);
- token ids, log-probs and versions are `PackedArray`s (dtype + little-endian bytes);
- ids are deterministic (task id from run + admission seq; sample id from task id + index; a
  group's id from its task id), so they double as JetStream `Nats-Msg-Id` for de-duplication and
  for idempotent handling;
- `trajectories` and `rewards` carry one message per task (`SampleGroup`, `ScoredGroup`): all G
  samples of it (in parts only when too big for one message), or a rejection marker alone.
"""

from __future__ import annotations

import json
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.arrays import PackedArray

SCHEMA_VERSION = 2  # 2: samples carry a loss mask and episode fields (multi-turn, tools)
READABLE_SCHEMA_VERSIONS = (1, 2)


class SchemaVersionError(ValueError):
    pass


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    kind: ClassVar[str] = "message"

    schema_version: int = SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _supported(cls, v: int) -> int:
        if v not in READABLE_SCHEMA_VERSIONS:
            readable = ", ".join(map(str, READABLE_SCHEMA_VERSIONS))
            raise SchemaVersionError(
                f"{cls.kind} message has schema_version {v}, this reader supports {readable}: "
                "run every worker of a run with the same areal-bus version"
            )
        return v

    def msg_id(self) -> str:
        """Id used as `Nats-Msg-Id` (JetStream de-duplication)."""
        raise NotImplementedError

    def check_lengths(self) -> None:
        """Cross-field checks run after decoding (raise ValueError); none by default."""


class Task(Message):
    """One prompt to be sampled `group_size` times (a GRPO group)."""

    kind: ClassVar[str] = "task"
    task_id: str
    seq: int = Field(ge=0, description="admission sequence number (0-based)")
    dataset_index: int = Field(ge=0)
    prompt: str
    prompt_ids: PackedArray
    answer: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    group_size: int = Field(ge=1)
    admitted_version: int = Field(ge=0, description="latest policy version at admission")
    admitted_at: float = Field(default_factory=time.time)

    def msg_id(self) -> str:
        return self.task_id


def sample_id(task_id: str, sample_idx: int) -> str:
    return f"{task_id}/{sample_idx}"


class TurnText(BaseModel):
    """One segment of an episode as text: the model's turn or the environment's (tool output,
    a user turn), with its token count (the segments' counts add up to the output's length)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["model", "env"]
    text: str
    n_tokens: int = Field(ge=0)


class ToolCallInfo(BaseModel):
    """One tool call of an episode, as rewards and taps see it."""

    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = ""
    output: str = ""
    error: str | None = Field(default=None, description="None: the tool answered; else why not")
    latency_s: float = Field(default=0.0, ge=0)
    turn: int = Field(default=0, ge=0, description="the model turn that made the call")


class Sample(Message):
    """One finished episode: the prompt, then `output_ids`, the whole token stream after it
    (a single-turn sample: one generation; a multi-turn one: model and environment tokens
    interleaved, as the model saw them), with per-token behaviour log-probs and policy
    versions. `loss_mask` tells which output tokens the model generated (1: trained) and which
    the environment added (0: tool output, user turns; log-prob 0.0, version -1, never
    trained); None: every output token is the model's (single-turn, and version 1 messages)."""

    kind: ClassVar[str] = "sample"
    task_id: str
    task_seq: int = Field(ge=0)
    sample_idx: int = Field(ge=0)
    group_size: int = Field(ge=1)
    prompt_ids: PackedArray
    output_ids: PackedArray
    behav_logp: PackedArray
    versions: PackedArray
    loss_mask: PackedArray | None = Field(
        None,
        description="uint8 per output token: 1 = a model token (trained), 0 = an environment "
        "token (log-prob 0, version -1, never trained); None = every output token trained",
    )
    output_text: str = ""
    answer: str = ""
    metadata: dict[str, Any] = Field(default_factory=dict)
    finish_reason: str = "stop"
    worker_id: str = ""
    n_turns: int = Field(default=1, ge=1, description="model generations in the episode")
    n_tool_calls: int = Field(default=0, ge=0, description="tool calls the episode made")
    n_tool_errors: int = Field(
        default=0, ge=0, description="tool calls that failed (raised, timed out, malformed)"
    )
    tool_s: float = Field(default=0.0, ge=0, description="tool latency summed over calls (s)")
    prompt: str = Field(default="", description="the task's prompt text (for rewards and taps)")
    turns: list[TurnText] = Field(
        default_factory=list,
        description="the episode segment by segment (empty: one model turn, `output_text`)",
    )
    tool_calls: list[ToolCallInfo] = Field(default_factory=list)
    n_interrupts: int = Field(default=0, ge=0)
    n_reprefill_tokens: int = Field(default=0, ge=0)
    timings: dict[str, float] = Field(default_factory=dict)
    rejected: str = Field(
        "",
        description="set on a rejection marker (no tokens): why a stage refused this task; the "
        "trainer retires the task as `rejected` so the run's accounting stays exact",
    )

    @property
    def sample_id(self) -> str:
        return sample_id(self.task_id, self.sample_idx)

    def msg_id(self) -> str:
        # a rejection marker must never take the id of the sample it stands in for
        return f"{self.task_id}/rejected" if self.rejected else self.sample_id

    def check_lengths(self) -> None:
        n = len(self.output_ids)
        if len(self.behav_logp) != n or len(self.versions) != n:
            raise ValueError(
                f"sample {self.sample_id}: output_ids has {n} tokens but behav_logp has "
                f"{len(self.behav_logp)} and versions {len(self.versions)}"
            )
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise ValueError(
                f"sample {self.sample_id}: output_ids has {n} tokens but loss_mask has "
                f"{len(self.loss_mask)}"
            )
        if self.turns and sum(t.n_tokens for t in self.turns) != n:
            raise ValueError(
                f"sample {self.sample_id}: output_ids has {n} tokens but its turns count "
                f"{sum(t.n_tokens for t in self.turns)}"
            )
        if self.sample_idx >= self.group_size:
            raise ValueError(
                f"sample {self.sample_id}: sample_idx {self.sample_idx} >= group_size "
                f"{self.group_size}"
            )


class ScoredSample(Message):
    kind: ClassVar[str] = "scored_sample"
    sample: Sample
    reward: float
    verifier: dict[str, Any] = Field(default_factory=dict, description="scorer detail")
    reward_worker_id: str = ""

    def msg_id(self) -> str:
        return self.sample.msg_id()

    def check_lengths(self) -> None:
        self.sample.check_lengths()


def group_msg_id(samples: list[Sample]) -> str:
    """`<task>/group` for a whole group, `<task>/<i>+<j>+...` for a part of one; a rejection
    marker's is `<task>/rejected` (never the id of what it stands in for)."""
    first = samples[0]
    if first.rejected:
        return f"{first.task_id}/rejected"
    if len(samples) == first.group_size:
        return f"{first.task_id}/group"
    return f"{first.task_id}/" + "+".join(str(i) for i in sorted(s.sample_idx for s in samples))


class SampleGroup(Message):
    """What `trajectories` carries: the G samples of one task in one message, published by the
    rollout once the last of them has finished, or a rejection marker alone. The trainer needs a
    whole group before it can use any of it, and the bus pays per message (a store, a delivery,
    an ack and a delete), so one message per task, not per sample. A group too big for one
    message (`nats.max_payload`) goes out in parts of several samples each; the trainer merges
    them (`areal.core.intake`). `areal.core.validate.check_group` holds a decoded group to its
    shape: one task, each index once."""

    kind: ClassVar[str] = "sample_group"
    samples: list[Sample] = Field(min_length=1)

    @property
    def first(self) -> Sample:
        return self.samples[0]

    def msg_id(self) -> str:
        return group_msg_id(self.samples)

    def check_lengths(self) -> None:
        for s in self.samples:
            s.check_lengths()


class ScoredGroup(Message):
    """What `rewards` carries: a `SampleGroup`'s samples, each with its reward, in one message."""

    kind: ClassVar[str] = "scored_group"
    scored: list[ScoredSample] = Field(min_length=1)

    @property
    def first(self) -> Sample:
        return self.scored[0].sample

    def msg_id(self) -> str:
        return group_msg_id([sc.sample for sc in self.scored])

    def check_lengths(self) -> None:
        for sc in self.scored:
            sc.check_lengths()


class WeightAnnouncement(Message):
    kind: ClassVar[str] = "weights"
    version: int = Field(ge=0)
    uri: str = Field(description="nats-obj://<bucket>/<name> or file:///path")
    sha256: str
    nbytes: int = Field(alias="bytes", ge=0)
    dtype: str = "float32"
    step: int = Field(default=0, ge=0)
    published_at: float = Field(default_factory=time.time)
    signature: str | None = Field(
        None,
        description="the trainer's Ed25519 signature (hex) of `signed_payload(run_id)`; readers "
        "of a run with keys refuse an announcement without a valid one (areal.bus.run_weights)",
    )

    def signed_payload(self, run_id: str) -> bytes:
        """The bytes the trainer signs: every field a reader acts on, bound to the run (an
        announcement of one run never verifies in another). `published_at` is not signed."""
        fields = {
            "run_id": run_id,
            "version": self.version,
            "uri": self.uri,
            "sha256": self.sha256,
            "bytes": self.nbytes,
            "dtype": self.dtype,
            "step": self.step,
        }
        return b"areal-weights/1\n" + json.dumps(fields, sort_keys=True).encode()

    def msg_id(self) -> str:
        # with the signature in it, the id cannot be predicted by anyone without the trainer's
        # key, so a forged publish cannot take a version's id first and get the real one
        # de-duplicated away; retries of one announcement sign the same bytes (same id)
        sig = f"-{self.signature[:16]}" if self.signature else ""
        return f"weights-v{self.version}{sig}"


class MetricRecord(Message):
    """A heartbeat or a metrics record from any role (also the trainer's per-step record)."""

    kind: ClassVar[str] = "metric"
    role: str
    worker_id: str
    type: str = Field(description="heartbeat | step | rollout | reward | controller")
    time: float = Field(default_factory=time.time)
    values: dict[str, Any] = Field(default_factory=dict)

    def msg_id(self) -> str:
        return f"{self.worker_id}-{self.type}-{self.time:.6f}"


SIGNED_EVENTS = frozenset({"run_finished"})  # events that stop workers: signed by the trainer


class Event(Message):
    kind: ClassVar[str] = "event"
    type: str = Field(description="snake_case event name, e.g. run_finished, task_dropped")
    role: str
    worker_id: str = ""
    time: float = Field(default_factory=time.time)
    detail: dict[str, Any] = Field(default_factory=dict)
    signature: str | None = Field(
        default=None,
        description="hex Ed25519 signature of `signed_bytes(run_id)` by the run's trainer key "
        "(events in SIGNED_EVENTS); None for the others",
    )

    def msg_id(self) -> str:
        return f"{self.worker_id}-{self.type}-{self.time:.6f}"

    def signed_bytes(self, run_id: str) -> bytes:
        """What the signature covers: the run, the event and its detail (canonical JSON)."""
        detail = json.dumps(self.detail, sort_keys=True, separators=(",", ":"), default=str)
        head = f"areal-event\n{run_id}\n{self.type}\n{self.role}\n{self.worker_id}\n"
        return (head + f"{self.time!r}\n{detail}").encode()


class DeadLetter(Message):
    """A message a stage could not handle, with the error that rejected it."""

    kind: ClassVar[str] = "dead_letter"
    stage: str
    reason: str
    subject: str
    payload: bytes = Field(description="the message as received, cut to a bounded size")
    payload_bytes: int = Field(0, ge=0, description="the message's full size (bytes)")
    headers: dict[str, str] = Field(default_factory=dict)
    worker_id: str = ""
    time: float = Field(default_factory=time.time)

    def msg_id(self) -> str:
        return f"dlq-{self.stage}-{self.time:.6f}-{hash(self.payload) & 0xFFFFFFFF:x}"


MESSAGE_TYPES: dict[str, type[Message]] = {
    m.kind: m
    for m in (
        Task,
        Sample,
        ScoredSample,
        SampleGroup,
        ScoredGroup,
        WeightAnnouncement,
        MetricRecord,
        Event,
        DeadLetter,
    )
}
