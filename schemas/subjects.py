"""Subject, stream, consumer and bucket names for one run, in one place.

Invariant: every name is derived from the run id, so several runs share one NATS server safely.
Subjects are `areal.<run>.<stream>`; stream/bucket names cannot contain dots, so they are
`AREAL_<RUN>_<STREAM>` with non-alphanumerics mapped to `_`.
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

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def validate_run_id(run_id: str) -> str:
    if not _RUN_ID_RE.match(run_id):
        raise ValueError(
            f"run id {run_id!r} is invalid: use 1-64 letters, digits, '_' or '-' "
            "(it becomes part of NATS subject and stream names)"
        )
    return run_id


@dataclass(frozen=True)
class RunNames:
    run_id: str

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)

    @property
    def _token(self) -> str:
        return re.sub(r"[^A-Za-z0-9]", "_", self.run_id).upper()

    def subject(self, stream: str, *rest: str) -> str:
        """`areal.<run>.<stream>[.<rest>...]`."""
        return ".".join(("areal", self.run_id, stream, *rest))

    def stream(self, stream: str) -> str:
        return f"AREAL_{self._token}_{stream.upper()}"

    def dlq_subject(self, stage: str) -> str:
        return self.subject(DLQ, stage)

    def metrics_subject(self, role: str) -> str:
        return self.subject(METRICS, role)

    def events_subject(self, kind: str) -> str:
        return self.subject(EVENTS, kind)

    @property
    def state_bucket(self) -> str:
        """KV bucket for run state (controller cursor/admitted, trainer version/returned)."""
        return f"areal_{self._token.lower()}_state"

    @property
    def weights_bucket(self) -> str:
        """Object store bucket for policy weights (safetensors)."""
        return f"areal_{self._token.lower()}_weights"
