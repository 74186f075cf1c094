import json

import msgpack
import numpy as np
import pytest

from areal.bus.codec import DecodeError, decode, encode, pack, unpack
from schemas import (
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    DeadLetter,
    PackedArray,
    RunNames,
    Sample,
    ScoredSample,
    Task,
    WeightAnnouncement,
)
from tests.factories import make_sample


def test_packed_array_roundtrip_stdlib_and_numpy():
    a = PackedArray.from_list([1, -2, 3], "int32")
    assert a.to_list() == [1, -2, 3]
    assert unpack(a).tolist() == [1, -2, 3]
    f = pack([0.5, -1.25], "float32")
    assert f.data == np.array([0.5, -1.25], "<f4").tobytes()  # little-endian on the wire
    assert PackedArray.from_list([0.5, -1.25], "float32").to_list() == [0.5, -1.25]
    with pytest.raises(ValueError, match="not a multiple"):
        PackedArray(dtype="int32", data=b"\x00\x01\x02")


@pytest.mark.parametrize(
    "msg",
    [
        Task(
            task_id="r-t0",
            seq=0,
            dataset_index=0,
            prompt="1+1=",
            prompt_ids=pack([1, 2], "int32"),
            answer="2",
            group_size=4,
            admitted_version=0,
            metadata={"k": 1},
        ),
        make_sample(),
        ScoredSample(sample=make_sample(), reward=1.0, verifier={"fn": "arithmetic"}),
        WeightAnnouncement(
            version=3, uri="nats-obj://b/v3", sha256="ab", bytes=10, dtype="float32"
        ),
        DeadLetter(stage="rewards", reason="bad", subject="x", payload=b"\x00\xff"),
    ],
)
def test_roundtrip(msg):
    back = decode(encode(msg), type(msg))
    assert back == msg
    assert back.schema_version == SCHEMA_VERSION


def test_arrays_travel_as_bytes_not_lists():
    raw = msgpack.unpackb(encode(make_sample(1000)), raw=False)
    assert isinstance(raw["behav_logp"]["data"], bytes)
    assert len(raw["behav_logp"]["data"]) == 4000


def test_weight_announcement_wire_field_is_bytes():
    raw = msgpack.unpackb(encode(WeightAnnouncement(version=1, uri="u", sha256="s", bytes=7)))
    assert raw["bytes"] == 7 and "nbytes" not in raw


def test_unknown_fields_are_ignored():
    raw = msgpack.unpackb(encode(make_sample()), raw=False)
    raw["field_from_the_future"] = {"x": 1}
    assert decode(msgpack.packb(raw, use_bin_type=True), Sample) == make_sample()


def test_wrong_schema_version_is_rejected_with_a_clear_error():
    raw = msgpack.unpackb(encode(make_sample()), raw=False)
    raw["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(DecodeError, match="schema_version 3, this reader supports 1, 2"):
        decode(msgpack.packb(raw, use_bin_type=True), Sample)


def test_a_version_1_sample_without_the_episode_fields_still_decodes():
    """What a worker of the previous release publishes: schema_version 1, no loss mask and no
    episode fields. It decodes to a single-turn sample: every output token trained."""
    raw = msgpack.unpackb(encode(make_sample()), raw=False)
    for k in ("loss_mask", "n_turns", "n_tool_calls", "n_tool_errors", "tool_s"):
        del raw[k]
    raw["schema_version"] = 1
    back = decode(msgpack.packb(raw, use_bin_type=True), Sample)
    assert back.schema_version == 1 and back.loss_mask is None
    assert (back.n_turns, back.n_tool_calls, back.n_tool_errors, back.tool_s) == (1, 0, 0, 0.0)
    assert back.model_copy(update={"schema_version": SCHEMA_VERSION}) == make_sample()
    assert SCHEMA_VERSION == 2 and READABLE_SCHEMA_VERSIONS == (1, 2)


def test_an_episode_sample_round_trips_with_its_mask():
    s = make_sample(
        6,
        loss_mask=pack([1, 1, 0, 0, 1, 1], "uint8"),
        versions=pack([2, 2, -1, -1, 3, 3], "int32"),
        n_turns=2,
        n_tool_calls=1,
        n_tool_errors=1,
        tool_s=0.25,
        finish_reason="tool_error",
    )
    back = decode(encode(s), Sample)
    assert back == s
    assert unpack(back.loss_mask).tolist() == [1, 1, 0, 0, 1, 1]
    assert back.loss_mask.to_list() == [1, 1, 0, 0, 1, 1]
    raw = msgpack.unpackb(encode(s), raw=False)
    assert raw["loss_mask"] == {"dtype": "uint8", "data": bytes([1, 1, 0, 0, 1, 1])}


def test_a_mask_of_the_wrong_length_is_a_decode_error():
    raw = msgpack.unpackb(encode(make_sample(5)), raw=False)
    raw["loss_mask"] = {"dtype": "uint8", "data": b"\x01" * 4}
    with pytest.raises(DecodeError, match="loss_mask has 4"):
        decode(msgpack.packb(raw, use_bin_type=True), Sample)


def test_the_json_schema_export_carries_the_episode_fields(capsys):
    from areal.cli import cmd_schema

    assert cmd_schema(None) == 0  # type: ignore[arg-type]
    sample = json.loads(capsys.readouterr().out)["sample"]
    props = sample["properties"]
    for k in ("loss_mask", "n_turns", "n_tool_calls", "n_tool_errors", "tool_s"):
        assert k in props and props[k].get("description"), k
    assert "loss_mask" not in sample["required"] and "n_turns" not in sample["required"]
    assert props["schema_version"]["default"] == 2
    assert "uint8" in json.dumps(sample["$defs"]["PackedArray"])


@pytest.mark.parametrize(
    "payload,match",
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb([1, 2]), "expected a map"),
        (msgpack.packb({"task_id": "x"}), "invalid sample message"),
    ],
)
def test_malformed_payloads(payload, match):
    with pytest.raises(DecodeError, match=match):
        decode(payload, Sample)


def test_length_mismatch_is_a_decode_error():
    s = make_sample()
    raw = msgpack.unpackb(encode(s), raw=False)
    raw["versions"] = {"dtype": "int32", "data": b"\x00" * 8}
    with pytest.raises(DecodeError, match="versions 2"):
        decode(msgpack.packb(raw, use_bin_type=True), Sample)


def test_names_are_namespaced_by_run():
    n = RunNames("my-run_1")
    assert n.subject("prompts") == "areal.my-run_1.prompts"
    assert n.stream("prompts") == "AREAL_MY-RUN_1_PROMPTS"
    assert n.dlq_subject("rewards") == "areal.my-run_1.dlq.rewards"
    assert RunNames("a").stream("prompts") != RunNames("b").stream("prompts")
    with pytest.raises(ValueError, match="run id"):
        RunNames("bad.id")
