"""Weights as a stream (`areal.engines.weights_stream`): the blob made tensor by tensor is
standard safetensors, the sink decodes any chunking of it (ours or safetensors' own), refuses
every malformed header before allocating, and a fetched state dict is scanned for NaN/inf once."""

from __future__ import annotations

import json
import pickle
import random
import struct

import pytest
import torch
from safetensors.torch import load, save

from areal.engines import weights_check, weights_stream
from areal.engines.weights_check import (
    FrozenStateDict,
    TensorSpec,
    all_finite,
    check_state_dict,
    spec_of,
)
from areal.engines.weights_stream import (
    MalformedWeights,
    SafetensorsBlob,
    SafetensorsSink,
    blob_of_safetensors,
    export_blob,
    wire_dtype_of,
)


def mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=g),
        "half": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 2, generator=g).to(torch.float16),
        "ids": torch.arange(5, dtype=torch.int64),
        "flag": torch.tensor(True),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
    }


def blob_bytes(blob) -> bytes:
    return b"".join(bytes(c) for c in blob.chunks())


def decode(data: bytes, seed: int = 0, max_piece: int = 17) -> dict[str, torch.Tensor]:
    """Feed `data` to a sink in random pieces of 1..max_piece bytes."""
    rng, sink, i = random.Random(seed), SafetensorsSink(len(data)), 0
    while i < len(data):
        n = rng.randint(1, max_piece)
        sink.write(memoryview(data)[i : i + n])
        i += n
    return sink.state_dict()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("wire", [None, "float32", "bfloat16"])
def test_the_blob_is_safetensors_with_floats_cast_to_the_wire_dtype(wire):
    state = mixed()
    blob = SafetensorsBlob(state, wire)
    data = blob_bytes(blob)
    assert len(data) == blob.nbytes
    cast = getattr(torch, wire) if wire else None
    want = {k: v.to(cast) if cast and v.is_floating_point() else v for k, v in state.items()}
    assert_same(load(data), want)  # the safetensors library reads it
    assert load(data)["ids"].dtype == torch.int64  # integers never cast
    assert blob_bytes(blob) == data  # chunks() again (a retried upload): the same bytes


def test_a_cast_goes_block_by_block_and_gives_the_same_bytes(monkeypatch):
    state = {"w": torch.randn(3, 5), "b": torch.randn(7), "s": torch.tensor(3.5)}  # fp32: cast
    whole = blob_bytes(SafetensorsBlob(state, "bfloat16"))
    monkeypatch.setattr(weights_stream, "CAST_ELEMENTS", 2)  # every tensor in several blocks
    pieces = [bytes(c) for c in SafetensorsBlob(state, "bfloat16").chunks()]  # copied at once
    assert b"".join(pieces) == whole
    assert max(len(c) for c in pieces[1:]) == 2 * 2  # no piece past one block of bf16


def test_the_sink_decodes_any_chunking_of_ours_and_of_safetensors_own():
    for data in (blob_bytes(SafetensorsBlob(mixed(), "bfloat16")), save(mixed())):
        want = load(data)
        for seed in range(3):
            assert_same(decode(data, seed), want)
        assert_same(decode(data, max_piece=len(data)), want)  # one piece


def test_bytes_that_need_no_cast_travel_untouched_and_others_are_cast():
    fp32 = {k: v for k, v in mixed().items() if v.dtype in (torch.float32, torch.int64)}
    raw = save(fp32)
    assert blob_bytes(blob_of_safetensors(raw, "float32")) == raw
    got = load(blob_bytes(blob_of_safetensors(raw, "bfloat16")))
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], fp32["w"].to(torch.bfloat16))
    assert torch.equal(got["ids"], fp32["ids"])


def test_export_blob_prefers_a_state_dict_to_bytes():
    state = mixed()

    class Bytes:
        def export_safetensors(self) -> bytes:
            return save(state)

    class StateDict(Bytes):
        def export_state_dict(self):
            return state

        def export_safetensors(self) -> bytes:
            raise AssertionError("no blob may be built when a state dict is offered")

    for engine in (Bytes(), StateDict()):
        got = load(blob_bytes(export_blob(engine, "bfloat16")))
        assert got["w"].dtype == torch.bfloat16 and got["ids"].dtype == torch.int64


def test_wire_dtype_auto_is_the_held_dtype_and_a_bad_name_says_the_choices():
    assert wire_dtype_of("auto", "float32") == "float32"
    assert wire_dtype_of("bfloat16", "float32") == "bfloat16"
    with pytest.raises(ValueError, match="choose one of auto, bfloat16, float16, float32"):
        wire_dtype_of("bf16", "float32")


def blob_with(header: object, data: bytes = b"", size: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if size is None else size) + raw + data


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (struct.pack("<Q", 1 << 40) + b"{}      ", "does not fit"),
        (blob_with([1, 2]), "not a JSON object"),
        (struct.pack("<Q", 8) + b"\xff" * 8, "not JSON"),
        (
            blob_with({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"x" * 8),
            "dtype",
        ),
        (
            blob_with({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"x" * 8),
            "offsets",
        ),
        (
            blob_with({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"x" * 8),
            "shape",
        ),
        (
            blob_with(
                {
                    "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                    "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
                },
                b"x" * 6,
            ),
            "hole or overlap",
        ),
        (
            blob_with({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"x" * 6),
            "hold 4",
        ),
    ],
)
def test_a_malformed_blob_is_refused(data, reason):
    with pytest.raises(MalformedWeights, match=reason):
        decode(data, max_piece=len(data))


def test_a_blob_cut_short_is_refused():
    data = save(mixed())
    with pytest.raises(MalformedWeights, match="ended early"):
        sink = SafetensorsSink(len(data))
        sink.write(memoryview(data)[:-3])
        sink.state_dict()
    with pytest.raises(MalformedWeights, match="inside its header"):
        sink = SafetensorsSink(len(data))
        sink.write(memoryview(data)[:20])
        sink.state_dict()


# ------------------------------------------------------------------ checked once
def test_a_frozen_state_dict_is_scanned_for_nan_once(monkeypatch):
    scanned: list[int] = []
    real = weights_check.all_finite
    monkeypatch.setattr(weights_check, "all_finite", lambda t: scanned.append(1) or real(t))
    state = {"w": torch.randn(4, 4), "b": torch.randn(4), "ids": torch.arange(3)}
    spec = spec_of(state)
    frozen = FrozenStateDict(state)
    check_state_dict(spec, frozen)  # the fetch path's check
    check_state_dict(spec, frozen)  # the engine's load_weights
    assert len(scanned) == 2  # two floating tensors, scanned once
    check_state_dict(spec, state)
    check_state_dict(spec, state)
    assert len(scanned) == 6  # a plain dict: every check scans
    with pytest.raises(TypeError, match="read-only"):
        frozen["w"] = torch.zeros(4, 4)
    copied = pickle.loads(pickle.dumps(frozen))  # e.g. sent to another process
    assert type(copied) is dict and copied.keys() == frozen.keys()


def test_a_frozen_state_dict_that_failed_is_scanned_again():
    spec = {"w": TensorSpec((2,), "float32", True)}
    bad = FrozenStateDict({"w": torch.tensor([1.0, float("nan")])})
    for _ in range(2):
        with pytest.raises(weights_check.WeightsMismatch, match="NaN or inf in w"):
            check_state_dict(spec, bad)


def test_all_finite_finds_nan_and_inf_in_any_block_and_survives_an_overflowing_sum(monkeypatch):
    monkeypatch.setattr(weights_check, "FINITE_BLOCK", 4)
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.zeros(10)
        t[9] = bad  # in the last, partial block
        assert not all_finite(t)
    big = torch.full((8,), 65504.0, dtype=torch.float16)  # finite; its sum overflows fp16
    assert all_finite(big)
    assert all_finite(torch.zeros(0))
