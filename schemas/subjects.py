"""Subject, stream, consumer and bucket names for one run, in one place.

Invariant: every name is derived from the run id, and the map from run id to names is
injective, so several runs share one NATS server without ever touching each other's streams.

Names:
- subjects: `areal.<run>.<stream>[.<rest>...]`;
- streams: `AREAL_<RUN>_<STREAM>` (`<RUN>` = the run id upper-cased, `<STREAM>` one of
  `ALL_STREAMS` upper-cased); stream and bucket names cannot contain dots;
- buckets: `areal_<run>_state` (KV run state), `areal_<run>_weights` (object store),
  `areal_<run>_files` (object store: the config and model a joining worker fetches).

Why the names are injective: a run id is `^[a-z0-9][a-z0-9_-]{0,63}$`. On that alphabet
upper-casing is a bijection (each of `a-z` has one upper-case image, digits, `_` and `-` are
unchanged), so `<RUN>` determines the run id (`<RUN>.lower()`). No stream constant contains
`_`, so in `AREAL_<RUN>_<STREAM>` the stream is what follows the last `_` and `<RUN>` is what
lies between the prefix `AREAL_` and that `_`: a stream name is split back into exactly one
(run id, stream) pair. Bucket names end in the fixed `_state` / `_weights` / `_files`, so the
run id is what lies between `areal_` and that suffix. Hence two different run ids (`run-a`,
`run_a`) never share a name. Nothing is mapped to `_` (the old `-` -> `_` mapping made `run-a`
and `run_a` collide), and run ids are lower-case because stream and bucket names become
directories in the server's store, which some file systems compare case-insensitively
(`RUN_A` vs `run_a`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Work-queue stages: one durable pull consumer per stage, shared by all replicas of that stage.
PROMPTS = "prompts"
TRAJECTORIES = "trajectories"
REWARDS = "rewards"
# Limits-retention streams (history is replayable, many readers welcome).
WEIGHTS = "weights"
METRICS = "metrics"
EVENTS = "events"
DLQ = "dlq"

WORK_QUEUE_STREAMS = (PROMPTS, TRAJECTORIES, REWARDS)
LIMITS_STREAMS = (WEIGHTS, METRICS, EVENTS, DLQ)
ALL_STREAMS = WORK_QUEUE_STREAMS + LIMITS_STREAMS

# Which role consumes each work-queue stream (the durable consumer's name).
CONSUMER_OF = {PROMPTS: "rollout", TRAJECTORIES: "reward", REWARDS: "trainer"}

RUN_ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
_RUN_ID_RE = re.compile(RUN_ID_PATTERN)
_STREAM_PREFIX = "AREAL_"


def validate_run_id(run_id: str) -> str:
    """`run_id` unchanged, or a one-line ValueError naming the rule and an example."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise ValueError(
            f"run id {run_id!r} is invalid: it must match {RUN_ID_PATTERN} (1-64 lower-case "
            "letters, digits, '_' or '-', starting with a letter or digit), e.g. 'exp-1' or "
            "'arithmetic_2'"
        )
    return run_id


def run_of_stream(stream_name: str) -> tuple[str, str] | None:
    """(run id, stream) that `RunNames(run_id).stream(stream)` maps to `stream_name`, or None
    when the name is not an areal stream (the inverse of `RunNames.stream`)."""
    if not stream_name.startswith(_STREAM_PREFIX) or "_" not in stream_name[len(_STREAM_PREFIX) :]:
        return None
    token, _, stream = stream_name[len(_STREAM_PREFIX) :].rpartition("_")
    run_id, stream = token.lower(), stream.lower()
    if stream not in ALL_STREAMS or not _RUN_ID_RE.fullmatch(run_id) or token != run_id.upper():
        return None
    return run_id, stream


@dataclass(frozen=True)
class RunNames:
    """Every bus name of one run (see the module docstring for why they are injective)."""

    run_id: str

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)

    def subject(self, stream: str, *rest: str) -> str:
        """`areal.<run>.<stream>[.<rest>...]`."""
        return ".".join(("areal", self.run_id, stream, *rest))

    def stream(self, stream: str) -> str:
        """`AREAL_<RUN>_<STREAM>`, e.g. `run-a`, `prompts` -> `AREAL_RUN-A_PROMPTS`."""
        if stream not in ALL_STREAMS:
            raise ValueError(f"unknown stream {stream!r}: one of {', '.join(ALL_STREAMS)}")
        return f"{_STREAM_PREFIX}{self.run_id.upper()}_{stream.upper()}"

    def dlq_subject(self, stage: str) -> str:
        return self.subject(DLQ, stage)

    def metrics_subject(self, role: str) -> str:
        return self.subject(METRICS, role)

    def events_subject(self, kind: str) -> str:
        return self.subject(EVENTS, kind)

    @property
    def state_bucket(self) -> str:
        """KV bucket for run state (controller and trainer state)."""
        return f"areal_{self.run_id}_state"

    @property
    def weights_bucket(self) -> str:
        """Object store bucket for policy weights (safetensors)."""
        return f"areal_{self.run_id}_weights"

    @property
    def files_bucket(self) -> str:
        """Object store bucket for the files a worker on another host joins with (the run's
        config, model dir and data file; `areal.bus.run_files`)."""
        return f"areal_{self.run_id}_files"
