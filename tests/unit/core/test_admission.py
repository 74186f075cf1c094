"""Admission (controller core): AReaL eq. 3 with returned slots and the total_steps cap."""

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


def test_published_in_order_only() -> None:
    adm = Admission(AdmissionPolicy(batch_size=1, max_staleness=0, total_steps=10))
    with pytest.raises(ValueError, match="in order"):
        adm.published(1)


@pytest.mark.parametrize(("b", "eta", "steps"), [(0, 0, 1), (1, -1, 1), (1, 0, 0)])
def test_invalid_policy(b: int, eta: int, steps: int) -> None:
    with pytest.raises(ValueError, match="invalid admission policy"):
        AdmissionPolicy(b, eta, steps)
