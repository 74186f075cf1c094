"""Admission (controller core): AReaL eq. 3 with returned slots and the total_steps cap; i counts
published steps, not versions (a restart can skip versions)."""

from __future__ import annotations

import pytest

from areal.core.admission import Admission, AdmissionPolicy
from schemas.state import ControllerState, TrainerState


def publish_all(adm: Admission, trainer: TrainerState) -> list[int]:
    seqs = list(adm.admissible(trainer))
    for seq in seqs:
        adm.published(seq)
    return seqs


def test_capacity_at_the_bound() -> None:
    adm = Admission(AdmissionPolicy(batch_size=2, max_staleness=1, total_steps=100))
    # version 0: (0 + 1 + 1) * 2 = 4 tasks may be outstanding
    assert publish_all(adm, TrainerState(version=0)) == [0, 1, 2, 3]
    assert list(adm.admissible(TrainerState(version=0))) == []  # at the bound: none more
    # version 1: (1 + 1 + 1) * 2 = 6 -> two more
    assert publish_all(adm, TrainerState(version=1)) == [4, 5]
    assert adm.state == ControllerState(admitted=6)


def test_returned_slots_are_admitted_again() -> None:
    adm = Admission(AdmissionPolicy(batch_size=2, max_staleness=0, total_steps=100))
    assert publish_all(adm, TrainerState()) == [0, 1]  # (0 + 0 + 1) * 2 = 2
    # one group dropped stale, one filtered: outstanding 2 - 2 = 0 -> two more at version 0
    trainer = TrainerState(dropped_stale=1, filtered=1)
    assert publish_all(adm, trainer) == [2, 3]
    v = adm.view(trainer)
    assert (v.admitted, v.outstanding, v.capacity, v.version) == (4, 2, 2, 0)


def test_total_steps_cap_with_returned_slots() -> None:
    adm = Admission(AdmissionPolicy(batch_size=2, max_staleness=4, total_steps=2))
    # capacity (0 + 4 + 1) * 2 = 10, but the run needs only 2 * 2 = 4 tasks
    assert publish_all(adm, TrainerState()) == [0, 1, 2, 3]
    assert list(adm.admissible(TrainerState(version=1))) == []
    # one dropped: 2 * 2 + 1 = 5 tasks in all, so one more
    assert publish_all(adm, TrainerState(version=1, dropped_stale=1)) == [4]


def test_restart_resumes_from_the_persisted_state() -> None:
    policy = AdmissionPolicy(batch_size=1, max_staleness=0, total_steps=10)
    adm = Admission(policy, ControllerState(admitted=3))
    # version 2: (2 + 0 + 1) * 1 = 3 outstanding, 3 admitted -> nothing; version 3 -> seq 3
    assert list(adm.admissible(TrainerState(version=2))) == []
    assert list(adm.admissible(TrainerState(version=3))) == [3]


def test_capacity_counts_steps_not_the_versions_a_restart_skipped() -> None:
    # a trainer restored its step-10 checkpoint after announcing v11: it rolled forward to v12,
    # skipping 2 versions (v11 was announced by a step it redoes, v12 is step 10's weights)
    B, eta = 4, 1
    adm = Admission(AdmissionPolicy(batch_size=B, max_staleness=eta, total_steps=100))
    kv = TrainerState(version=12, versions_skipped=2, step=10, trained=40)
    assert kv.published_steps == 10
    # (10 + 1 + 1) * 4 = 48 outstanding, of which 40 trained: (eta + 1) * B = 8 in flight, not
    # the (12 + 1 + 1) * 4 - 40 = 16 that counting versions would allow
    assert publish_all(adm, kv) == list(range(48))
    assert adm.state.admitted - kv.returned - kv.trained == (eta + 1) * B
    v = adm.view(kv)
    assert (v.outstanding, v.capacity, v.version) == (48, 48, 12)  # the version is reported
    # the next step's weights are announced as v13: one more step, B more tasks
    assert publish_all(adm, kv.model_copy(update={"version": 13, "step": 11})) == [48, 49, 50, 51]


def test_published_in_order_only() -> None:
    adm = Admission(AdmissionPolicy(batch_size=1, max_staleness=0, total_steps=10))
    with pytest.raises(ValueError, match="in order"):
        adm.published(1)


@pytest.mark.parametrize(("b", "eta", "steps"), [(0, 0, 1), (1, -1, 1), (1, 0, 0)])
def test_invalid_policy(b: int, eta: int, steps: int) -> None:
    with pytest.raises(ValueError, match="invalid admission policy"):
        AdmissionPolicy(b, eta, steps)
