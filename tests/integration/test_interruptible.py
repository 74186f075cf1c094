"""Interruptible generation through the real rollout service, bus and object store.

A weight update is published while a sample is being generated. The sample that lands on
`trajectories` must show: versions switching exactly at one token boundary; tokens before it
keep the old weights' log-probs; tokens after it carry the new weights' log-probs (recomputed
here independently with a plain forward pass).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal.bus.client import Bus
from areal.bus.codec import decode, pack, unpack
from areal.bus.connection import connect
from areal.core.scheduling import SchedulerPolicy
from areal.data.tiny_model import build_tiny_model
from areal.data.tokenizer import load_tokenizer
from areal.engines.base import SamplingParams
from areal.engines.config import InferenceEngineConfig
from areal.engines.torch_infer import TorchInferenceEngine, weights_from_safetensors
from areal.engines.torch_train import export_state_dict
from areal.services.rollout import RolloutService
from schemas import Sample, SampleGroup, Task
from schemas import subjects as S

pytestmark = pytest.mark.integration
N_TOKENS = 120


class SlowEngine(TorchInferenceEngine):
    """The real engine, slowed per decode step so a weight update lands mid-sample."""

    def _decode(self, batch, tokens):
        time.sleep(0.01)
        return super()._decode(batch, tokens)


def token_logps(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def rollout_service(bus, engine, tok, policy: SchedulerPolicy, max_tasks: int) -> RolloutService:
    params = SamplingParams(max_new_tokens=N_TOKENS, temperature=1.0, stop_token_ids=())
    return RolloutService(
        bus,
        engine,
        lambda ids: tok.decode(ids),
        params,
        policy=policy,
        max_concurrent_tasks=max_tasks,
        weights_from_bytes=weights_from_safetensors,
    )


async def run_one_sample(nats_url, run_id, model_dir, interruptible: bool):
    torch.manual_seed(0)
    old = AutoModelForCausalLM.from_pretrained(model_dir)
    new = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tok = load_tokenizer(model_dir)
    bus = await Bus.connect(nats_url, run_id, "rollout", "rollout-0")
    engine = SlowEngine(InferenceEngineConfig(kind="torch", model_path=str(model_dir), seed=0))
    svc = rollout_service(bus, engine, tok, SchedulerPolicy(interruptible=interruptible), 1)
    samples: list[Sample] = []

    async def on_sample(msg):
        samples.extend(decode(msg.data, SampleGroup).samples)

    raw = await connect(nats_url, "test-raw")  # the bus hands out no nats object
    await raw.subscribe(bus.names.subject(S.TRAJECTORIES), cb=on_sample)
    stop = asyncio.Event()
    runner = asyncio.create_task(svc.run(stop))
    prompt = tok.encode("12+34=", add_special_tokens=False)
    await bus.publish(
        S.PROMPTS,
        Task(
            task_id=f"{run_id}-t0",
            seq=0,
            dataset_index=0,
            prompt="12+34=",
            prompt_ids=pack(prompt, "int32"),
            answer="46",
            group_size=1,
            admitted_version=0,
        ),
    )
    while svc.meter._since is None:  # generation started
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.3)  # ~30 tokens in
    from safetensors.torch import save

    await bus.put_weights(1, save(export_state_dict(new)), "float32", step=1)
    while not samples:
        await asyncio.sleep(0.02)
    stop.set()
    await runner
    await bus.close()
    await raw.close()
    s = samples[0]
    return s, prompt, old, new


async def test_weight_update_mid_sample_switches_at_a_token_boundary(nats_url, run_id, model_dir):
    s, prompt, old, new = await run_one_sample(nats_url, run_id, model_dir, interruptible=True)
    out = unpack(s.output_ids).tolist()
    versions = unpack(s.versions).tolist()
    behav = torch.from_numpy(unpack(s.behav_logp).copy())
    assert len(out) == N_TOKENS
    k = versions.index(1)
    assert 0 < k < N_TOKENS  # the switch happened mid-sample
    assert versions == [0] * k + [1] * (N_TOKENS - k)  # exactly one switch, at k
    assert s.n_interrupts == 1
    assert s.n_reprefill_tokens == len(prompt) + k  # prompt + partial output re-prefilled
    lp_old = token_logps(old, prompt, out)
    lp_new = token_logps(new, prompt, out)
    torch.testing.assert_close(behav[:k], lp_old[:k], atol=1e-4, rtol=0)
    torch.testing.assert_close(behav[k:], lp_new[k:], atol=1e-4, rtol=0)
    assert not torch.allclose(lp_old[k:], lp_new[k:], atol=1e-3)  # the weights really differ


async def test_non_interruptible_finishes_on_the_old_weights(nats_url, run_id, model_dir):
    s, prompt, old, _ = await run_one_sample(nats_url, run_id, model_dir, interruptible=False)
    out = unpack(s.output_ids).tolist()
    assert unpack(s.versions).tolist() == [0] * N_TOKENS
    assert s.n_interrupts == 0
    behav = torch.from_numpy(unpack(s.behav_logp).copy())
    torch.testing.assert_close(behav, token_logps(old, prompt, out), atol=1e-4, rtol=0)


class RecordingEngine(TorchInferenceEngine):
    """Records which requests each decode step ran together; holds at step 5 until released."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.steps: list[set[str]] = []
        self.release = threading.Event()

    def _decode(self, batch, tokens):
        # a row's key is its episode's turn: `<task>/<index>#<turn>`; record the sample
        self.steps.append({r.req.key.split("#")[0] for r in batch.rows})
        if len(self.steps) == 5:
            assert self.release.wait(60), "the test never released the engine"
        return super()._decode(batch, tokens)


async def test_needed_first_decodes_the_next_batch_before_a_later_one(nats_url, run_id, model_dir):
    # η = 1: once v1 exists the trainer's next batch is t0 (admitted at v0); t1 (admitted at
    # v1) must not decode beside it, and starts once t0's sample is generated
    tok = load_tokenizer(model_dir)
    bus = await Bus.connect(nats_url, run_id, "rollout", "rollout-0")
    engine = RecordingEngine(InferenceEngineConfig(kind="torch", model_path=str(model_dir), seed=0))
    policy = SchedulerPolicy(interruptible=True, needed_first=True, max_staleness=1)
    svc = rollout_service(bus, engine, tok, policy, 2)
    samples: list[Sample] = []

    async def on_sample(msg):
        samples.extend(decode(msg.data, SampleGroup).samples)

    raw = await connect(nats_url, "test-raw")
    await raw.subscribe(bus.names.subject(S.TRAJECTORIES), cb=on_sample)
    stop = asyncio.Event()
    runner = asyncio.create_task(svc.run(stop))
    prompt = tok.encode("12+34=", add_special_tokens=False)

    def task(i: int, version: int) -> Task:
        return Task(
            task_id=f"{run_id}-t{i}",
            seq=i,
            dataset_index=i,
            prompt="12+34=",
            prompt_ids=pack(prompt, "int32"),
            answer="46",
            group_size=1,
            admitted_version=version,
        )

    await bus.publish(S.PROMPTS, task(0, 0))
    while len(engine.steps) < 5:  # t0 generates, and the engine holds at its 5th token
        await asyncio.sleep(0.005)
    from safetensors.torch import save

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    await bus.put_weights(1, save(export_state_dict(model)), "float32", step=1)
    await bus.publish(S.PROMPTS, task(1, 1))
    # t1 and v1 are both in hand while t0 is still generating: then let the engine go on
    while f"{run_id}-t1" not in svc.sched.tasks or svc.sched.known_version < 1:
        await asyncio.sleep(0.005)
    engine.release.set()
    while len(samples) < 2:
        await asyncio.sleep(0.02)
    stop.set()
    await runner
    await bus.close()
    await raw.close()
    t0, t1 = f"{run_id}-t0/0", f"{run_id}-t1/0"
    with_t0 = [i for i, keys in enumerate(engine.steps) if t0 in keys]
    with_t1 = [i for i, keys in enumerate(engine.steps) if t1 in keys]
    assert with_t0 and with_t1
    assert max(with_t0) < min(with_t1)  # never decoded together: t1 started after t0 ended
    by_id = {s.task_id: s for s in samples}
    assert set(unpack(by_id[f"{run_id}-t0"].versions).tolist()) == {0, 1}  # switched mid-sample
    assert set(unpack(by_id[f"{run_id}-t1"].versions).tolist()) == {1}
    assert len(unpack(by_id[f"{run_id}-t0"].output_ids)) == N_TOKENS
