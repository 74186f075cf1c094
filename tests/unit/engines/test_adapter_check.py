"""An adapter's metadata is checked as strictly as its tensors (issue 51): `train.lora` refuses
an alpha that is not finite or past `MAX_LORA_ALPHA` and an r below 1, naming the field, and
`check_adapter` refuses a received blob whose alpha, r or scaling would make the merged
weights non-finite or the merge divide by zero, before anything is loaded."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from areal.config import MAX_LORA_ALPHA, LoraSettings, TrainSettings
from areal.engines.config import LoraSpec
from areal.engines.lora import ADAPTER_KEY, AdapterMeta, check_adapter, merge_adapter
from areal.engines.weights_check import TensorSpec, WeightsMismatch

OUT_F, IN_F = 6, 5  # the one adapted linear layer of the base, [out, in]
BASE = {"m.weight": TensorSpec((OUT_F, IN_F), "float32", True)}
FINGERPRINT = "f" * 64


def blob(*, r: int = 2, meta: dict | None = None, a_rank: int | None = None) -> dict:
    """An adapter for BASE: A [r, in], B [out, r] of ones, and the metadata JSON `meta`
    (default: a valid one) written raw, so that any value can travel."""
    meta = meta if meta is not None else {"r": r, "alpha": 4.0}
    raw = {"base": FINGERPRINT, "target_modules": ["m"], **meta}
    k = a_rank if a_rank is not None else r
    return {
        "m.lora_A.weight": torch.ones(k, IN_F),
        "m.lora_B.weight": torch.ones(OUT_F, k),
        ADAPTER_KEY: torch.tensor(list(json.dumps(raw).encode()), dtype=torch.uint8),
    }


def test_a_valid_adapter_passes_and_merges():
    sd = blob()
    meta = check_adapter(BASE, FINGERPRINT, sd)
    assert meta == AdapterMeta(base=FINGERPRINT, r=2, alpha=4.0, target_modules=("m",))
    live = {"m.weight": torch.zeros(OUT_F, IN_F)}
    merge_adapter(live, {}, sd)
    # (alpha / r) B A = 2 * [out, r] ones @ [r, in] ones = 2 * 2 = 4 everywhere
    assert torch.equal(live["m.weight"], torch.full((OUT_F, IN_F), 4.0))


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        ({"r": 2, "alpha": float("nan")}, "alpha NaN is not a finite number"),
        ({"r": 2, "alpha": float("inf")}, "alpha inf is not a finite number"),
        ({"r": 2, "alpha": -float("inf")}, "alpha -inf is not a finite number"),
        ({"r": 2, "alpha": 1e38}, f"alpha 1e+38 is not in (0, {MAX_LORA_ALPHA:g}]"),
        ({"r": 2, "alpha": 0.0}, f"alpha 0 is not in (0, {MAX_LORA_ALPHA:g}]"),
        ({"r": 2, "alpha": -1.0}, f"alpha -1 is not in (0, {MAX_LORA_ALPHA:g}]"),
        ({"r": 2, "alpha": "4"}, "alpha '4' is not a number"),
        ({"r": 2, "alpha": True}, "alpha True is not a number"),
        ({"r": 2.5, "alpha": 4.0}, "r 2.5 is not an integer"),
        ({"r": "2", "alpha": 4.0}, "r '2' is not an integer"),
        ({"r": True, "alpha": 4.0}, "r True is not an integer"),
    ],
)
def test_bad_metadata_is_refused(meta, why):
    with pytest.raises(WeightsMismatch, match="adapter") as e:
        check_adapter(BASE, FINGERPRINT, blob(meta=meta))
    assert why in str(e.value)


def test_r_zero_is_refused_before_the_merge_divides_by_it():
    sd = blob(r=0)  # A [0, in], B [out, 0]: shapes agree with r, and r = 0
    with pytest.raises(WeightsMismatch, match="r 0 is below 1"):
        check_adapter(BASE, FINGERPRINT, sd)


def test_r_must_match_the_tensors():
    with pytest.raises(WeightsMismatch, match=r"A \[3, 5\], B \[6, 3\] for r=2"):
        check_adapter(BASE, FINGERPRINT, blob(r=2, a_rank=3))


def test_an_update_that_overflows_float32_is_refused():
    sd = blob(meta={"r": 2, "alpha": MAX_LORA_ALPHA})  # a legal alpha ...
    sd["m.lora_B.weight"] = torch.full((OUT_F, 2), 1e36)  # ... and finite, huge B
    with pytest.raises(WeightsMismatch, match="overflow"):
        check_adapter(BASE, FINGERPRINT, sd)


@pytest.mark.parametrize("alpha", [float("inf"), float("nan"), 1e38, 0.0, -2.0])
def test_train_lora_alpha_out_of_range_fails_at_config_time(alpha):
    with pytest.raises(ValidationError, match="alpha"):
        TrainSettings(lora={"alpha": alpha})
    with pytest.raises(ValueError, match="alpha"):
        LoraSpec(alpha=alpha)


def test_train_lora_r_zero_fails_at_config_time():
    with pytest.raises(ValidationError, match=r"lora\.r"):
        TrainSettings(lora={"r": 0})
    with pytest.raises(ValueError, match="r >= 1"):
        LoraSpec(r=0)


def test_the_bound_is_documented_in_the_field():
    assert f"{MAX_LORA_ALPHA:g}" in LoraSettings.model_fields["alpha"].description
    assert LoraSettings(alpha=MAX_LORA_ALPHA).alpha == MAX_LORA_ALPHA
