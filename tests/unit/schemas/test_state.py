"""`TrainerState.versions_skipped`: what admission counts (`published_steps`), and records
written before the field existed."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from schemas.state import CheckpointState, TrainerState


def test_published_steps_are_the_version_less_the_versions_skipped() -> None:
    assert TrainerState(version=7, step=7).published_steps == 7  # never rolled forward
    # restored at step 10 after v11 was announced: v12, two versions skipped
    assert TrainerState(version=12, versions_skipped=2, step=10).published_steps == 10
    # the KV record while step 11's weights upload: version capped at v12, step one ahead
    assert TrainerState(version=12, versions_skipped=2, step=11).published_steps == 10


def test_a_record_written_before_the_field_decodes_with_nothing_skipped() -> None:
    old = {"schema_version": 1, "version": 3, "step": 3, "trained": 6, "done": False}
    assert TrainerState.model_validate_json(json.dumps(old)).versions_skipped == 0
    ckpt = CheckpointState.model_validate_json(json.dumps({"trainer": old, "done_tasks": []}))
    assert ckpt.trainer.published_steps == 3


def test_the_field_survives_a_round_trip() -> None:
    st = TrainerState(version=12, versions_skipped=2, step=10)
    assert TrainerState.model_validate_json(st.model_dump_json()) == st


def test_more_versions_skipped_than_versions_is_refused() -> None:
    # a record no trainer writes (i would be negative): refused on decode, so the controller
    # keeps its last good record (`StateDecodeError` from the KV)
    with pytest.raises(ValidationError, match="versions_skipped 3 exceeds version 2"):
        TrainerState.model_validate_json(json.dumps({"version": 2, "versions_skipped": 3}))
    with pytest.raises(ValidationError):
        TrainerState(versions_skipped=-1)
