"""Boundary checks of multi-turn samples: model tokens are held to the single-turn rules, the
environment tokens between them carry log-prob 0 and version -1, the mask holds only 0/1 and
is as long as the output, and an episode stays within its model-token and episode budgets.
Single-turn samples get the verdicts they got before, under the bounds a run now builds."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal.bus.codec import DecodeError, decode, encode, pack
from areal.config import RolloutSettings
from areal.core.validate import check_sample, check_scored
from schemas import PackedArray, ScoredSample
from tests.factories import make_sample
from tests.unit.core.test_validate import SAMPLE_LIES, B

# 4 tokens a turn, 3 turns (12 model tokens), 20 tokens an episode after its prompt
EP = replace(B, max_new_tokens=4, max_turns=3, max_episode_tokens=20)

M, E = "model", "env"


def episode(*segments: tuple, **fields):
    """A sample of segments `(M, n, version)` (n model tokens of that version) and `(E, n)`
    (n environment tokens); `fields` replace any field after the segments built them."""
    ids, logp, versions, mask = [], [], [], []
    for seg in segments:
        n = seg[1]
        ids += [(7 * len(ids) + k) % 100 for k in range(n)]
        if seg[0] == M:
            logp += list(np.linspace(-2.0, -0.1, n))
            versions += [seg[2]] * n
            mask += [1] * n
        else:
            logp += [0.0] * n
            versions += [-1] * n
            mask += [0] * n
    return make_sample(
        **{
            "output_ids": pack(ids, "int32"),
            "behav_logp": pack(np.array(logp, dtype=np.float32), "float32"),
            "versions": pack(versions, "int32"),
            "loss_mask": pack(mask, "uint8"),
            "n_turns": sum(1 for seg in segments if seg[0] == M),
            **fields,
        }
    )


GOOD = ((M, 4, 1), (E, 3), (M, 4, 2), (E, 5), (M, 2, 2))  # 10 model + 8 env = 18 tokens


def poke(what: str, index: int, value) -> dict:
    """Fields of GOOD with one element of `what` replaced."""
    s = episode(*GOOD)
    dtype = {"behav_logp": "float32", "versions": "int32", "loss_mask": "uint8"}[what]
    vals = np.frombuffer(getattr(s, what).data, dtype=np.dtype(dtype).newbyteorder("<")).copy()
    vals[index] = value
    return {what: pack(vals, dtype)}


ENV_AT, MODEL_AT, LAST = 5, 8, 17  # an environment token, a model token, the last one


@pytest.mark.parametrize(
    ("segments", "fields"),
    [
        (GOOD, {}),
        (((M, 4, 2),), {}),  # one model turn, with a mask
        (((M, 4, 0), (E, 4), (M, 4, 1), (E, 4), (M, 4, 2)), {}),  # every budget exactly full
        (((E, 2), (M, 3, 2)), {}),  # the environment speaks first
        (GOOD, {"finish_reason": "max_turns"}),
        (GOOD, {"finish_reason": "tool_error", "n_tool_calls": 2, "n_tool_errors": 1}),
        (GOOD, {"tool_s": 12.5}),
    ],
)
def test_a_good_episode_passes(segments, fields):
    assert check_sample(episode(*segments, **fields), EP, latest_version=2) is None


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        (poke("versions", ENV_AT, 2), "environment token (loss mask 0) has version 2, not -1"),
        (poke("versions", ENV_AT, 0), "has version 0, not -1"),
        (poke("versions", MODEL_AT, -1), "negative policy version -1"),
        (poke("versions", MODEL_AT, 0), "decrease"),  # model tokens: 1, 1, ..., 2, 0
        (poke("versions", LAST, 3), "newest published version is 2"),
        (poke("behav_logp", ENV_AT, -0.5), "has behav_logp -0.5, not 0"),
        (poke("behav_logp", ENV_AT, math.nan), "has behav_logp nan, not 0"),
        (poke("behav_logp", MODEL_AT, math.nan), "non-finite"),
        (poke("behav_logp", MODEL_AT, 0.5), "outside"),
        (poke("loss_mask", ENV_AT, 2), "loss_mask holds 2, not only 0 and 1"),
        (poke("loss_mask", MODEL_AT, 255), "loss_mask holds 255"),
        ({"loss_mask": pack([1] * 17, "uint8")}, "loss_mask has 17 entries for 18 output"),
        ({"loss_mask": pack([1] * 18, "int32")}, "loss_mask has dtype int32, not uint8"),
        ({"loss_mask": PackedArray(dtype="float32", data=b"\0" * 72)}, "not uint8"),
        ({"finish_reason": "tool_exploded"}, "finish_reason"),
        ({"n_tool_calls": 1, "n_tool_errors": 2}, "2 tool errors in 1 tool calls"),
        ({"tool_s": math.inf}, "tool_s is not finite"),
    ],
)
def test_a_lying_episode_is_refused_with_the_reason(fields, fragment):
    v = check_sample(episode(*GOOD, **fields), EP, latest_version=2)
    assert v is not None and fragment in v.reason, v
    assert v.stale_view == ("newest published" in fragment)


@pytest.mark.parametrize(
    ("segments", "fragment"),
    [
        # 13 model tokens > max_new_tokens 4 * max_turns 3
        (((M, 4, 1), (E, 1), (M, 4, 1), (E, 1), (M, 5, 2)), "13 model tokens, more than "),
        (((M, 4, 1), (E, 1), (M, 4, 1), (E, 1), (M, 4, 2), (E, 1), (M, 1, 2)), "13 model"),
        # 21 tokens > max_episode_tokens 20 (the model's part within its budget)
        (((M, 4, 1), (E, 8), (M, 4, 2), (E, 5)), "21 output tokens, more than max_episode"),
        (
            (
                (M, 1, 1),
                (E, 63),
            ),
            "more than max_episode_tokens 20",
        ),
    ],
)
def test_an_episode_over_its_budget_is_refused(segments, fragment):
    v = check_sample(episode(*segments), EP, latest_version=2)
    assert v is not None and fragment in v.reason, v
    assert "max_new_tokens * max_turns = 12" in v.reason or "max_episode" in v.reason


def test_the_model_context_bounds_the_whole_episode():
    ctx = replace(EP, max_episode_tokens=None, max_seq_len=16)  # prompt 3 + 18 > 16
    v = check_sample(episode(*GOOD), ctx, latest_version=2)
    assert v is not None and "exceed the model's context 16" in v.reason


def test_a_mask_of_the_wrong_length_does_not_even_decode():
    s = episode(*GOOD, loss_mask=pack([1] * 17, "uint8"))
    with pytest.raises(DecodeError, match="loss_mask has 17"):
        decode(encode(s), type(s))


# ------------------------------------------------------- single-turn, as before
RUN = RolloutSettings(max_new_tokens=8)  # B's max_new_tokens, as a run's config gives it
B_RUN = replace(B, **RUN.sample_limits())


def test_a_run_builds_single_turn_bounds_from_its_config():
    assert RUN.sample_limits() == {"max_new_tokens": 8, "max_turns": 1, "max_episode_tokens": 16}
    assert B_RUN.max_model_tokens == 8


@pytest.mark.parametrize(("fields", "fragment"), SAMPLE_LIES)
def test_single_turn_lies_get_the_same_verdict_as_before(fields, fragment):
    sample = make_sample(**{"task_id": "run-t3", **fields})
    v = check_sample(sample, B_RUN, latest_version=2)
    assert v == check_sample(sample, B, latest_version=2)
    assert v is not None and fragment in v.reason


@pytest.mark.parametrize("n", [0, 1, 8, 9, 17])
def test_single_turn_length_verdicts_are_unchanged(n):
    s = make_sample(n=n)
    v = check_sample(s, B_RUN, latest_version=2)
    assert v == check_sample(s, B, latest_version=2)
    if n > 8:
        assert v is not None and f"{n} output tokens, more than max_new_tokens 8" in v.reason
    else:
        assert v is None
    # the same tokens with a mask of all ones: model tokens, the same limit
    masked = make_sample(n=n, loss_mask=pack([1] * n, "uint8"))
    vm = check_sample(masked, B_RUN, latest_version=2)
    assert (vm is None) == (v is None)


@given(
    st.lists(
        st.tuples(
            st.integers(0, 2), st.integers(-3, 3), st.sampled_from([0.0, -1.0, 1.0, math.nan])
        ),
        max_size=20,
    ),
)
def test_whatever_episode_passes_is_safe_to_train_on(tokens):
    """Property: an episode the checks let through has a 0/1 mask, model tokens with finite
    log-probs <= 0 and versions in [0, latest] never decreasing, environment tokens with
    log-prob 0 and version -1, and its budgets kept."""
    mask = [m for m, _, _ in tokens]
    versions = [v for _, v, _ in tokens]
    logp = [x for _, _, x in tokens]
    n = len(tokens)
    s = make_sample(
        n=n,
        loss_mask=pack(mask, "uint8"),
        versions=pack(versions, "int32"),
        behav_logp=pack(np.array(logp, dtype=np.float32), "float32"),
    )
    if check_scored(ScoredSample(sample=s, reward=0.0), EP, latest_version=2) is not None:
        return
    assert set(mask) <= {0, 1} and n <= 20
    model = [(v, x) for m, v, x in tokens if m == 1]
    env = [(v, x) for m, v, x in tokens if m == 0]
    assert len(model) <= 12
    assert all(0 <= v <= 2 and math.isfinite(x) and x <= 0 for v, x in model)
    assert all(a[0] <= b[0] for a, b in zip(model, model[1:], strict=False))
    assert all(v == -1 and x == 0.0 for v, x in env)
