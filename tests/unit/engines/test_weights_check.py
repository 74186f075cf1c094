"""A weights blob is checked whole against the model before the first tensor is copied: a blob
with one wrong-shaped tensor, one NaN, a wrong dtype kind or a missing / extra name changes no
parameter of the inference engine, and one that fits is loaded."""

from __future__ import annotations

import pytest
import torch

from areal.engines.base import WeightUpdate
from areal.engines.torch_train import export_state_dict
from areal.engines.weights_check import (
    TensorSpec,
    WeightsMismatch,
    check_state_dict,
    spec_of,
    spec_of_hf_dir,
)
from tests.unit.engines.helpers import infer_engine, tiny_model


def params(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def assert_unchanged(engine, before: dict[str, torch.Tensor]) -> None:
    after = engine.model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} was overwritten"


@pytest.fixture
def engine(model_dir):
    return infer_engine(model_dir, seed=0)


@pytest.fixture
def other() -> dict[str, torch.Tensor]:
    """Weights of the same architecture that differ from the engine's in every tensor."""
    return export_state_dict(tiny_model(7))


def last_name(state: dict[str, torch.Tensor]) -> str:
    return sorted(state)[-1]  # checked after all the others: a copy-as-you-go loader gets far


def test_one_wrong_shaped_tensor_changes_no_parameter(engine, other):
    before = params(engine)
    name = last_name(other)
    other[name] = torch.zeros(*other[name].shape[:-1], other[name].shape[-1] + 1)
    with pytest.raises(WeightsMismatch, match=f"shape {name}"):
        engine.load_weights(WeightUpdate(version=1, state_dict=other))
    assert_unchanged(engine, before)
    assert engine.version == 0


def test_one_nan_changes_no_parameter(engine, other):
    before = params(engine)
    name = last_name(other)
    other[name].view(-1)[3] = float("nan")
    with pytest.raises(WeightsMismatch, match="NaN or inf"):
        engine.load_weights(WeightUpdate(version=1, state_dict=other))
    assert_unchanged(engine, before)


def test_an_integer_tensor_for_a_float_parameter_is_refused(engine, other):
    before = params(engine)
    name = last_name(other)
    other[name] = other[name].to(torch.int32)
    with pytest.raises(WeightsMismatch, match="dtype"):
        engine.load_weights(WeightUpdate(version=1, state_dict=other))
    assert_unchanged(engine, before)


def test_missing_and_unexpected_names_are_refused(engine, other):
    before = params(engine)
    name = last_name(other)
    other["extra.weight"] = other.pop(name)
    with pytest.raises(WeightsMismatch, match=f"missing {name}.*unexpected extra.weight"):
        engine.load_weights(WeightUpdate(version=1, state_dict=other))
    assert_unchanged(engine, before)


def test_weights_that_fit_are_loaded_cast_to_the_model_dtype(engine, other):
    half = {k: v.to(torch.bfloat16) for k, v in other.items()}  # floating -> floating: cast
    engine.load_weights(WeightUpdate(version=4, state_dict=half))
    assert engine.version == 4
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, half[k].to(v.dtype))


def test_the_spec_of_an_hf_dir_is_read_from_its_headers(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    from_dir = spec_of_hf_dir(model_dir)
    from_model = spec_of(model.state_dict())
    assert from_dir.items() <= from_model.items()
    assert set(from_model) - set(from_dir) <= {"lm_head.weight"}  # tied: not stored in the dir


def test_optional_names_may_be_absent_but_nothing_else():
    spec = {"a": TensorSpec((2,), "float32", True), "b": TensorSpec((2,), "float32", True)}
    check_state_dict(spec, {"a": torch.zeros(2)}, optional=frozenset({"b"}))
    with pytest.raises(WeightsMismatch, match="missing a"):
        check_state_dict(spec, {"b": torch.zeros(2)}, optional=frozenset({"b"}))
    with pytest.raises(WeightsMismatch, match="NaN or inf in a"):
        check_state_dict(spec, {"a": torch.tensor([1.0, float("inf")]), "b": torch.zeros(2)})
