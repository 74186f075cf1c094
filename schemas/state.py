"""Run state that crosses a process boundary: the KV run state, the trainer checkpoint's
bookkeeping and the per-step record. Typed, versioned models instead of string-keyed dicts.

Invariants:
- every model carries `schema_version`; a reader rejects a version it does not support with a
  clear error and ignores unknown fields (like the wire messages);
- `TrainerState.returned` (dropped + filtered groups) is what admission gives back: the
  controller admits while `admitted - returned + 1 <= (i + η + 1) * B`, where
  i = `TrainerState.published_steps` (`version - versions_skipped`: equal to `version` until a
  restart rolls the version forward past weights its checkpoint did not cover);
- accounting: `admitted = trained + dropped_stale + filtered + rejected + in_flight`
  (`Accounting`).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.messages import Message

# KV keys of the run-state bucket
CONTROLLER_KEY = "controller"
TRAINER_KEY = "trainer"
ROLE_LOCK_PREFIX = "lock."  # + role: the one live controller / trainer of the run (RoleLock)


class _State(Message):
    """Versioned like the wire messages (`schemas.messages.Message`); never published itself."""

    kind: ClassVar[str] = "state"


class ControllerState(_State):
    """The controller's KV record: tasks admitted so far (= the next task's seq and the dataset
    cursor: task k is dataset item k of the seeded order)."""

    kind: ClassVar[str] = "controller state"
    admitted: int = Field(0, ge=0, description="tasks published onto `prompts` so far")
    admitting: int = Field(
        0,
        ge=0,
        description="tasks whose publishing has begun: written before they are published, so "
        "a stage that sees a task's message can check that the controller meant to admit it",
    )


class TrainerState(_State):
    """The trainer's KV record and the core of its checkpoint."""

    kind: ClassVar[str] = "trainer state"
    version: int = Field(0, ge=0, description="latest published policy version")
    step: int = Field(0, ge=0, description="training steps done")
    trained: int = Field(0, ge=0, description="groups trained on")
    dropped_stale: int = Field(0, ge=0, description="groups dropped by the intake check")
    filtered: int = Field(0, ge=0, description="groups filtered (e.g. zero advantage)")
    rejected: int = Field(
        0, ge=0, description="tasks retired because a message of theirs failed validation"
    )
    skipped_steps: int = Field(
        0, ge=0, description="steps whose loss or gradient was not finite (nothing applied)"
    )
    samples: int = Field(0, ge=0, description="samples trained on")
    tokens: int = Field(0, ge=0, description="generated tokens trained on")
    wall_s: float = Field(0.0, ge=0, description="trainer wall time so far (s)")
    done: bool = Field(False, description="the run reached total_steps")
    versions_skipped: int = Field(
        0,
        ge=0,
        description="policy versions that restarts rolled forward over: weights announced by "
        "steps no checkpoint covered (`TrainerService.restore`); those steps are redone under "
        "new versions, so `version - versions_skipped` counts steps, not versions",
    )

    @model_validator(mode="after")
    def _skipped_within_version(self) -> TrainerState:
        if self.versions_skipped > self.version:
            raise ValueError(
                f"versions_skipped {self.versions_skipped} exceeds version {self.version}"
            )
        return self

    @property
    def returned(self) -> int:
        """Groups that gave their admission slot back (dropped, filtered or rejected)."""
        return self.dropped_stale + self.filtered + self.rejected

    @property
    def published_steps(self) -> int:
        """AReaL's i, what admission counts: the training steps whose weights are announced.
        `version` alone overcounts after a version rollforward. In the trainer's memory this is
        `step`; in the KV record, whose `version` is capped at the last announced one, it is
        `step - 1` while the latest step's weights are still uploading."""
        return self.version - self.versions_skipped


class CheckpointState(_State):
    """`checkpoint/trainer_state.json`: the trainer state plus the tasks whose effect the
    checkpoint covers (trained, dropped or filtered), so redeliveries are de-duplicated."""

    kind: ClassVar[str] = "checkpoint state"
    trainer: TrainerState
    done_tasks: list[str] = Field(default_factory=list)
    engine_dir: str = Field(
        "engine",
        description="the engine checkpoint (under checkpoint/) this state goes with: written "
        "under a new name before this file, the old one removed after, so a crash between the "
        "two writes leaves the previous pair whole",
    )


class RoleLockState(_State):
    """`lock.<role>`: who runs the run's one controller or trainer (`areal.bus.role_lock`).
    Renewed (a compare-and-set write) every `nats.role_lock_ttl_s / 5`."""

    kind: ClassVar[str] = "role lock"
    worker_id: str = Field(description="the holder's worker id")
    host: str = Field(description="the holder's host name")
    pid: int = Field(ge=0, description="the holder's process id")
    token: str = Field(description="random per process: tells the holder's own writes apart")
    renewals: int = Field(0, ge=0, description="renewals so far")


class Accounting(BaseModel):
    """Where every admitted task is:
    `admitted = trained + dropped_stale + filtered + rejected + in_flight`."""

    admitted: int
    trained: int
    dropped_stale: int
    filtered: int
    rejected: int = 0

    @property
    def in_flight(self) -> int:
        return self.admitted - self.trained - self.dropped_stale - self.filtered - self.rejected


class BatchInfo(BaseModel):
    """What the trainer's intake knows about the batch of one step (before training)."""

    reward_mean: float
    reward_std: float
    samples: int
    tokens: int
    gen_len_mean: float
    staleness_max: int = Field(description="largest sample lag (from its oldest model token)")
    staleness_hist: dict[str, int] = Field(description="sample lag -> samples")
    staleness_hist_tokens: dict[str, int] = Field(description="model token lag -> tokens")
    token_version_min: int
    token_version_max: int
    interrupted_frac: float = Field(description="samples whose generation switched weights")
    reprefill_tokens: int
    truncated_frac: float = Field(0.0, description="samples that hit max_new_tokens")
    masked_token_frac: float = Field(
        0.0,
        description="environment tokens (tool output, user turns: loss mask 0) / output tokens",
    )
    turns_mean: float = Field(1.0, description="model turns per episode, mean over samples")
    tool_calls_mean: float = Field(0.0, description="tool calls per episode, mean over samples")
    tool_call_frac: float = Field(0.0, description="samples whose episode called a tool")
    tool_ok_frac: float = Field(
        0.0, description="samples that called a tool and whose every call ran without error"
    )
    tool_error_frac: float = Field(
        0.0, description="tool calls that failed (raised, timed out, malformed) / tool calls"
    )
    tool_s_mean: float = Field(0.0, description="tool latency per episode, mean over samples (s)")
    task_seqs: list[int] = Field(
        default_factory=list,
        description="admission seq of each task trained in this step (audits: none twice)",
    )
    # Where the batch's time went, from the timestamps its samples carry (`Sample.timings`:
    # admitted, received by a rollout, finished). Wall clocks: across hosts they include the
    # hosts' clock skew. None when no sample of the batch carries them.
    queue_s: float | None = Field(
        None, description="median over tasks of admission -> a rollout received it (s)"
    )
    gen_span_s: float | None = Field(
        None, description="first task received -> last sample finished, over the batch (s)"
    )
    tail_s: float | None = Field(
        None,
        description="the median task's last sample finished -> the batch's last sample "
        "finished: how long its slowest answers held the batch (s)",
    )
    ready_age_s: float | None = Field(
        None,
        description="the batch's last sample finished -> the trainer took the batch: ~0 "
        "when the trainer waited for the rollout, larger when the batch waited for the trainer",
    )


class StepRecord(BatchInfo):
    """One line of `metrics.jsonl` and the `metrics.trainer.step` record.

    Engine statistics (`loss`, `clipfrac`, `approx_kl`, `entropy`, `grad_norm`, ...) are
    typed below where every engine reports them; any further engine stat is kept as an extra
    field, so a new engine can report more without a schema change.
    """

    model_config = ConfigDict(extra="allow")

    step: int
    version: int = Field(description="policy version after this step")
    trained_on_version: int = Field(description="policy version the batch was trained against")
    versions_skipped: int = Field(
        0, description="`TrainerState.versions_skipped`: `version - versions_skipped` = `step`"
    )
    wall_s: float
    dropped_stale: int
    filtered: int
    rejected: int = 0
    admitted: int
    outstanding: int = Field(description="admitted - returned: what admission counts")
    train_s: float
    wait_s: float = Field(description="time the trainer waited for a full batch (s)")
    weights_publish_s: float
    checkpoint_s: float
    trainer_idle_frac: float
    loss: float = 0.0
    clipfrac: float = 0.0
    approx_kl: float = Field(0.0, description="k3 estimator, per kept token")
    entropy: float | None = Field(None, description="policy entropy per loss token (nats)")
    grad_norm: float = 0.0
    behav_kl: float | None = Field(
        None, description="k1 KL(behaviour || proximal) per loss token (nats): staleness cost"
    )
    behav_kl_k3: float | None = Field(
        None, description="k3 KL(behaviour || proximal) per loss token (nats), >= 0"
    )
    behav_ess: float | None = Field(
        None, description="normalised effective sample size of the behaviour weights, (0, 1]"
    )


class RunSummary(BaseModel):
    """`summary.json` and the `run_finished` event: the accounting and the outcome of a run."""

    admitted: int
    trained: int
    dropped_stale: int
    filtered: int
    rejected: int = Field(0, description="tasks retired because a message failed validation")
    in_flight: int = Field(description="admitted - trained - dropped_stale - filtered - rejected")
    skipped_steps: int = Field(0, description="steps refused for a non-finite loss or gradient")
    dlq: int = Field(description="messages in the run's dead-letter stream")
    steps: int
    final_version: int
    samples: int
    tokens: int
    reward_first5: float
    reward_last5: float
    final_reward: float | None
    wall_s: float


def eval_claim_key(rnd: int) -> str:
    """KV key of evaluation round `rnd` (created once, by the replica that runs the round).
    Dotted (`eval.r<N>`): the KV subject `$KV.<bucket>.eval.r<N>` is then one that a server
    permission can grant the rollout role alone (`$KV.<bucket>.eval.>`)."""
    return f"eval.r{rnd}"


class EvalClaim(_State):
    """Marks an evaluation round as taken (`areal/services/evaluation.py`)."""

    kind: ClassVar[str] = "eval_claim"
    round: int = Field(ge=0)
    worker_id: str
    claimed_at: float
