"""TorchInferenceEngine against plain transformers forwards / generate on a tiny random Qwen2."""

from __future__ import annotations

import pytest
import torch

from areal.engines.base import GenRequest, SamplingParams, WeightUpdate
from areal.engines.config import InferenceEngineConfig
from areal.engines.torch_infer import TorchInferenceEngine, sample_tokens
from areal.engines.torch_train import export_state_dict
from tests.unit.engines.helpers import full_logp, infer_engine, random_prompts, tiny_model

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
LENGTHS = [3, 7, 1, 5, 9]


def reqs(prompts: list[list[int]]) -> list[GenRequest]:
    return [GenRequest(key=f"r{i}", prompt_ids=p) for i, p in enumerate(prompts)]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def engine(model_dir) -> TorchInferenceEngine:
    return infer_engine(model_dir, max_batch_size=64, seed=0)


def test_config_of_another_kind_is_refused(model_dir):
    with pytest.raises(ValueError, match="kind 'torch'"):
        TorchInferenceEngine(InferenceEngineConfig(kind="vllm", model_path=model_dir))


def test_shapes_and_length_reason(engine):
    outs = engine.generate(reqs(random_prompts(LENGTHS)), params=SamplingParams(max_new_tokens=6))
    assert [o.key for o in outs] == [f"r{i}" for i in range(len(LENGTHS))]
    for o in outs:
        assert len(o.output_ids) == len(o.behav_logp) == len(o.versions) == 6
        assert o.finish_reason == "length"
        assert o.versions == [0] * 6 and o.n_interrupts == 0
        assert all(lp <= 0.0 for lp in o.behav_logp)


def test_greedy_matches_hf_generate(engine, ref_model):
    prompts = random_prompts(LENGTHS)
    outs = engine.generate(reqs(prompts), params=GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.output_ids == hf_greedy(ref_model, p, 10)


def test_stop_token_is_kept_with_its_logp(engine, ref_model):
    prompt = random_prompts([4])[0]
    full = engine.generate(reqs([prompt]), params=GREEDY)[0].output_ids
    stop = full[2]
    first = full.index(stop)  # the stop token may already occur earlier
    out = engine.generate(reqs([prompt]), params=SamplingParams(10, 0.0, 1.0, (stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.output_ids == full[: first + 1]
    torch.testing.assert_close(
        torch.tensor(out.behav_logp),
        full_logp(ref_model, prompt, out.output_ids),
        atol=1e-4,
        rtol=0,
    )


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8), (0.0, 1.0)])
def test_recorded_logp_matches_full_forward(engine, ref_model, temperature, top_p):
    prompts = random_prompts(LENGTHS, seed=2)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p)
    for p, o in zip(prompts, engine.generate(reqs(prompts), params=params), strict=True):
        expected = full_logp(ref_model, p, o.output_ids, temperature or 1.0)
        torch.testing.assert_close(torch.tensor(o.behav_logp), expected, atol=1e-4, rtol=0)


def test_continuous_batching_same_greedy_outputs(model_dir, engine):
    prompts = random_prompts([3, 7, 1, 5, 9, 2, 6], seed=3)
    finished = []
    small = infer_engine(model_dir, max_batch_size=2)
    outs = small.generate(reqs(prompts), params=GREEDY, on_finished=finished.append)
    ref = engine.generate(reqs(prompts), params=GREEDY)
    assert [o.output_ids for o in outs] == [o.output_ids for o in ref]
    for a, b in zip(outs, ref, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.behav_logp), torch.tensor(b.behav_logp), atol=1e-5, rtol=0
        )
    assert sorted(o.key for o in finished) == sorted(o.key for o in outs)


def test_continuous_batching_with_stops_and_admission(model_dir, engine, ref_model):
    # Rows stop at different steps, so rows are evicted and others admitted mid-run.
    prompts = random_prompts([2, 8, 4, 6, 3, 5], seed=4)
    free = engine.generate(reqs(prompts), params=GREEDY)
    stops = (free[0].output_ids[0], free[2].output_ids[0])
    assert free[1].output_ids[0] not in stops  # row 1 keeps running while 0 and 2 leave
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=stops)
    outs = infer_engine(model_dir, max_batch_size=3).generate(reqs(prompts), params=params)
    ref = engine.generate(reqs(prompts), params=params)
    assert [o.output_ids for o in outs] == [o.output_ids for o in ref]
    assert outs[0].finish_reason == outs[2].finish_reason == "stop"
    for p, o in zip(prompts, outs, strict=True):
        torch.testing.assert_close(
            torch.tensor(o.behav_logp), full_logp(ref_model, p, o.output_ids), atol=1e-4, rtol=0
        )


def test_sampling_with_stops_logp(model_dir, ref_model):
    prompts = random_prompts([2, 8, 4, 6, 3, 5, 7, 1], seed=8)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=(3, 9, 17))
    outs = infer_engine(model_dir, max_batch_size=3, seed=1).generate(reqs(prompts), params=params)
    assert "stop" in {o.finish_reason for o in outs}
    for p, o in zip(prompts, outs, strict=True):
        if o.finish_reason == "stop":
            assert o.output_ids[-1] in params.stop_token_ids
            assert not set(o.output_ids[:-1]) & set(params.stop_token_ids)
        torch.testing.assert_close(
            torch.tensor(o.behav_logp), full_logp(ref_model, p, o.output_ids), atol=1e-4, rtol=0
        )


def test_same_seed_same_samples(model_dir):
    prompts = random_prompts(LENGTHS)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    a = infer_engine(model_dir, seed=7).generate(reqs(prompts), params=params)
    b = infer_engine(model_dir, seed=7).generate(reqs(prompts), params=params)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]


@pytest.mark.parametrize("max_batch_size", [8, 2])
def test_interrupt_switches_version_at_k(model_dir, max_batch_size):
    k = 4
    new_model = tiny_model(seed=123)
    old_model = tiny_model(seed=0)  # same weights as model_dir
    update = WeightUpdate(version=1, state_dict=export_state_dict(new_model))
    calls = []

    def poll():
        calls.append(1)
        return update if len(calls) == k + 1 else None  # call k (0-based) precedes token k

    prompts = random_prompts([3, 6, 2], seed=5)
    eng = infer_engine(model_dir, max_batch_size=max_batch_size)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    outs = eng.generate(reqs(prompts), params=params, poll_weights=poll)
    assert eng.version == 1
    if max_batch_size < len(prompts):  # the third row only starts after the switch
        late = outs.pop()
        assert late.versions == [1] * 10 and late.n_interrupts == 0 and late.n_reprefill_tokens == 0
        torch.testing.assert_close(
            torch.tensor(late.behav_logp),
            full_logp(new_model, prompts[2], late.output_ids),
            atol=1e-4,
            rtol=0,
        )
        prompts = prompts[:2]
    for p, o in zip(prompts, outs, strict=True):
        assert o.versions == [0] * k + [1] * (10 - k)
        assert o.n_interrupts == 1
        assert o.n_reprefill_tokens == len(p) + k
        behav = torch.tensor(o.behav_logp)
        torch.testing.assert_close(
            behav[:k], full_logp(old_model, p, o.output_ids)[:k], atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            behav[k:], full_logp(new_model, p, o.output_ids)[k:], atol=1e-4, rtol=0
        )


def test_prompt_at_context_limit_finishes_at_once(engine):
    # the tiny model has max_position_embeddings 128: a 128-token prompt leaves no room
    out = engine.generate([GenRequest("full", [1] * 128)], params=GREEDY)[0]
    assert out.finish_reason == "length" and out.output_ids == [] and out.behav_logp == []


def test_finished_row_is_reported_at_once(engine):
    rs = reqs(random_prompts([3, 4, 5], seed=7))
    rs[1].max_new_tokens = 3  # r1 leaves the batch after 3 tokens, the others run to 8
    finished = []
    outs = engine.generate(rs, params=SamplingParams(max_new_tokens=8), on_finished=finished.append)
    assert [len(o.output_ids) for o in outs] == [8, 3, 8]
    assert finished[0].key == "r1"  # reported at once, before the others finish
    assert finished[0] is outs[1]


def test_generate_takes_keyword_arguments_only(engine):
    with pytest.raises(TypeError):
        engine.generate(reqs([[1, 2]]), GREEDY)  # type: ignore[misc]


def test_load_weights_rejects_other_architecture(engine):
    bad = {k: v for k, v in export_state_dict(tiny_model(0)).items() if "lm_head" not in k}
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights(WeightUpdate(version=5, state_dict=bad))
    assert engine.version == 0


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    toks = [int(sample_tokens(logits, 1.0, 0.7, g)[0][0]) for _ in range(200)]
    assert set(toks) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    tok, logp = sample_tokens(logits, 1.0, 0.7, g)
    assert abs(float(logp[0]) - float(torch.log(torch.tensor([0.5, 0.3]))[tok[0]])) < 1e-5


def test_poll_requests_joins_the_running_batch(model_dir, engine):
    """Requests handed in at token boundaries (continuous batching across calls) produce the
    same greedy outputs as a plain call, and are returned after the initial requests."""
    prompts = random_prompts([3, 7, 1, 5, 9, 2], seed=11)
    late = reqs(prompts)[3:]
    calls = []

    def poll():
        calls.append(1)
        if len(calls) == 4 and late:  # arrive mid-generation (after 3 token boundaries)
            out, late[:] = list(late), []
            return out
        return []

    outs = infer_engine(model_dir, max_batch_size=8).generate(
        reqs(prompts)[:3], params=GREEDY, poll_requests=poll
    )
    ref = engine.generate(reqs(prompts), params=GREEDY)
    assert [o.key for o in outs] == [r.key for r in reqs(prompts)]
    assert [o.output_ids for o in outs] == [o.output_ids for o in ref]


def test_per_request_max_new_tokens(model_dir):
    prompts = random_prompts([3, 4, 5], seed=12)
    rs = reqs(prompts)
    rs[0].max_new_tokens, rs[2].max_new_tokens = 2, 5
    params = SamplingParams(max_new_tokens=9, temperature=1.0)
    outs = infer_engine(model_dir).generate(rs, params=params)
    assert [len(o.output_ids) for o in outs] == [2, 9, 5]
    assert {o.finish_reason for o in outs} == {"length"}


def test_a_group_of_one_prompt_is_prefilled_once(engine, ref_model, monkeypatch):
    """G requests of one prompt (a GRPO group) share one prefill row, then sample apart: each
    sample's recorded log-probs are still those of its own full forward."""
    prompts = random_prompts([4, 6], seed=9)
    group = [prompts[0]] * 5 + [prompts[1]] * 3 + [prompts[0]]
    widths = []
    forward = engine.model.forward

    def spy(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", spy)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    outs = engine.generate(reqs(group), params=params)
    assert widths[0][0] == 2  # the prefill: two distinct prompts
    assert all(w[0] == len(group) for w in widths[1:2])  # the first decode: every row
    assert len({tuple(o.output_ids) for o in outs}) > 2  # rows sampled independently
    for p, o in zip(group, outs, strict=True):
        expected = full_logp(ref_model, p, o.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(o.behav_logp), expected, atol=1e-4, rtol=0)
