"""Admission: which tasks the controller may publish now (AReaL eq. 3).

Inputs: the controller's own `ControllerState` (tasks admitted so far) and the trainer's
`TrainerState` as last read from KV (latest published version, versions skipped, returned
slots).

Invariants:
- `admitted - returned <= (i + η + 1) * B` after every admission, where i =
  `TrainerState.published_steps` is the number of training steps whose weights are *published*
  (never ahead of them) and `returned` = groups dropped stale or filtered (they give their slot
  back). i is the latest published version until a trainer restart rolls the version forward
  past weights its checkpoint did not cover (`versions_skipped`): counting versions then would
  let those skipped versions' tasks be in flight on top of (η + 1) * B for the rest of the run.
  A restart lowers i to its checkpoint's step: admission waits while the steps since are redone;
- task k is dataset item k of the seeded order, and its message id is derived from k, so a
  restart that re-publishes tasks admitted but not yet persisted is de-duplicated by the server:
  nothing is admitted twice or skipped;
- admission stops at `total_steps * B + returned` tasks: a finished run has nothing in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal.algo.staleness import admissible_count, admission_capacity
from schemas.state import ControllerState, TrainerState

__all__ = ["Admission", "AdmissionPolicy", "AdmissionView"]


@dataclass(frozen=True)
class AdmissionPolicy:
    batch_size: int  # B: tasks per training step
    max_staleness: int  # η
    total_steps: int

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_staleness < 0 or self.total_steps < 1:
            raise ValueError(f"invalid admission policy {self}")


@dataclass(frozen=True)
class AdmissionView:
    """What admission looks like now (for the controller's metrics and heartbeat)."""

    admitted: int
    outstanding: int  # admitted - returned
    capacity: int  # (i + η + 1) * B, i = TrainerState.published_steps
    version: int  # the trainer's latest published policy version


class Admission:
    """The controller's decision: which task seqs to publish now.

    Usage: `for seq in adm.admissible(trainer): publish(task seq); adm.published(seq)`, then
    persist `adm.state` (publishing before persisting is what makes a crash safe).
    """

    def __init__(self, policy: AdmissionPolicy, state: ControllerState | None = None) -> None:
        self.policy = policy
        self.state = state or ControllerState()

    def admissible(self, trainer: TrainerState) -> range:
        """Seqs of the tasks that may be published now, in order (empty when none may)."""
        p = self.policy
        outstanding = self.state.admitted - trainer.returned
        n = admissible_count(outstanding, trainer.published_steps, p.max_staleness, p.batch_size)
        n = min(n, p.total_steps * p.batch_size + trainer.returned - self.state.admitted)
        return range(self.state.admitted, self.state.admitted + max(0, n))

    def published(self, seq: int) -> None:
        """Task `seq` is on the stream (its publish was acknowledged)."""
        if seq != self.state.admitted:
            raise ValueError(f"tasks are admitted in order: expected seq {self.state.admitted}")
        self.state = self.state.model_copy(update={"admitted": seq + 1})

    def view(self, trainer: TrainerState) -> AdmissionView:
        p = self.policy
        return AdmissionView(
            admitted=self.state.admitted,
            outstanding=self.state.admitted - trainer.returned,
            capacity=admission_capacity(trainer.published_steps, p.max_staleness, p.batch_size),
            version=trainer.version,
        )
