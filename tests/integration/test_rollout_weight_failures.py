"""A weight load that fails, through the real rollout service, bus and engine.

The engine's `load_weights` fails (a transient error, as a CUDA or RPC error would be) at a
token boundary or between batches. The worker must live on, go back to the version the engine
holds, retry the update after a pause, then generate at the new version: tokens stamped v1 carry
v1's log-probs (recomputed here with a plain forward pass), nothing generates between the failed
load and the good one, and no task admitted at v1 is prefilled on v0 weights.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from areal.bus.client import Bus
from areal.bus.codec import decode, pack, unpack
from areal.bus.connection import connect
from areal.core.scheduling import SchedulerPolicy
from areal.data.tiny_model import build_tiny_model
from areal.engines.base import SamplingParams
from areal.engines.config import InferenceEngineConfig
from areal.engines.torch_infer import TorchInferenceEngine, weights_from_safetensors
from areal.engines.torch_train import export_state_dict
from areal.services.rollout import RolloutService
from areal.services.weights_follower import LOAD_RETRY_S
from schemas import Sample, SampleGroup, Task
from schemas import subjects as S
from tests.factories import make_task

pytestmark = pytest.mark.integration
N_TOKENS = 40
PROMPT = [5, 6, 7]


class FlakyEngine(TorchInferenceEngine):
    """The real engine: its first `fail_loads` weight loads raise; records every load and every
    prefill (which request, on which version) in order; holds at its `hold_at`-th decode step
    until `release` is set."""

    def __init__(self, cfg, *, fail_loads: int, hold_at: int = 0) -> None:
        super().__init__(cfg)
        self.fail_loads, self.hold_at = fail_loads, hold_at
        self.events: list[tuple] = []  # ("load", version, ok, in_generate, t) | ("prefill", key, v)
        self.steps = 0
        self.release = threading.Event()
        self._in_generate = False

    def generate(self, requests, **kw):
        self._in_generate = True
        try:
            return super().generate(requests, **kw)
        finally:
            self._in_generate = False

    def load_weights(self, update):
        ok = self.fail_loads == 0
        self.events.append(("load", update.version, ok, self._in_generate, time.monotonic()))
        if not ok:
            self.fail_loads -= 1
            raise RuntimeError("CUDA error: an illegal memory access (simulated, transient)")
        return super().load_weights(update)

    def _prefill(self, rows):
        self.events.extend(("prefill", r.req.key, self.version) for r in rows)
        return super()._prefill(rows)

    def _decode(self, batch, tokens):
        self.steps += 1
        if self.steps == self.hold_at:
            assert self.release.wait(60), "the test never released the engine"
        return super()._decode(batch, tokens)

    def loads(self) -> list[tuple]:
        return [e for e in self.events if e[0] == "load"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def new_model(model_dir):
    """v1: the v0 model with every parameter moved, so its log-probs differ."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def token_logps(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def task(run_id: str, i: int, version: int) -> Task:
    return make_task(
        task_id=f"{run_id}-t{i}",
        seq=i,
        dataset_index=i,
        prompt_ids=pack(PROMPT, "int32"),
        group_size=1,
        admitted_version=version,
    )


class Rollout:
    """A rollout worker on `engine`, and every sample it publishes."""

    def __init__(self, bus: Bus, engine: FlakyEngine, policy: SchedulerPolicy) -> None:
        self.bus, self.engine = bus, engine
        params = SamplingParams(max_new_tokens=N_TOKENS, temperature=1.0, stop_token_ids=())
        self.svc = RolloutService(
            bus,
            engine,
            lambda ids: "",
            params,
            policy=policy,
            max_concurrent_tasks=2,
            weights_from_bytes=weights_from_safetensors,
        )
        self.samples: dict[str, Sample] = {}
        self.changed = asyncio.Event()

    async def on_sample(self, msg) -> None:
        for s in decode(msg.data, SampleGroup).samples:
            self.samples[s.task_id] = s
        self.changed.set()

    async def wait_for(self, task_ids: set[str], timeout_s: float = 60.0) -> None:
        async def until() -> None:
            while not task_ids <= set(self.samples):
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(until(), timeout_s)


async def until(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def check_v1_sample(s: Sample, new_model) -> None:
    """Every token stamped v1, with v1's log-probs."""
    out = unpack(s.output_ids).tolist()
    assert len(out) == N_TOKENS
    assert unpack(s.versions).tolist() == [1] * N_TOKENS
    behav = torch.from_numpy(unpack(s.behav_logp).copy())
    torch.testing.assert_close(behav, token_logps(new_model, PROMPT, out), atol=1e-4, rtol=0)


def nothing_generated_while_failing(events: list[tuple]) -> None:
    """No prefill between the first failed load and the good one; none of a task admitted at
    v1 (t1) on v0."""
    loads = [i for i, e in enumerate(events) if e[0] == "load"]
    first_failed, good = loads[0], loads[-1]
    assert not [e for e in events[first_failed:good] if e[0] == "prefill"]
    assert all(e[2] >= 1 for e in events if e[0] == "prefill" and e[1].endswith("-t1/0"))


async def run_worker(nats_url, run_id, engine, policy, body) -> dict[str, Sample]:
    """Run a rollout worker on `engine` through `body(bus, rollout, runner)`; its samples."""
    bus = await Bus.connect(nats_url, run_id, "rollout", "rollout-0")
    r = Rollout(bus, engine, policy)
    raw = await connect(nats_url, "test-raw")  # the bus hands out no nats object
    await raw.subscribe(bus.names.subject(S.TRAJECTORIES), cb=r.on_sample)
    stop = asyncio.Event()
    runner = asyncio.create_task(r.svc.run(stop))
    try:
        await body(bus, r, runner)
    finally:
        engine.release.set()
        stop.set()
        await asyncio.wait_for(runner, 30)
        await bus.close()
        await raw.close()
    return r.samples


async def test_a_load_failed_at_a_token_boundary_is_retried(nats_url, run_id, model_dir, new_model):
    cfg = InferenceEngineConfig(kind="torch", model_path=str(model_dir), seed=0)
    engine = FlakyEngine(cfg, fail_loads=1, hold_at=5)
    t0, t1 = f"{run_id}-t0", f"{run_id}-t1"

    async def body(bus: Bus, r: Rollout, runner: asyncio.Task) -> None:
        await bus.publish(S.PROMPTS, task(run_id, 0, 0))
        await until(lambda: engine.steps >= 5)  # t0 generates on v0; the engine holds
        await bus.put_weights(1, save(export_state_dict(new_model)), "float32", step=1)
        await bus.publish(S.PROMPTS, task(run_id, 1, 1))  # admitted at v1: runs on v1 only
        await until(lambda: r.svc.sched.known_version == 1 and r.svc.sched.is_active(t1))
        engine.release.set()  # the switch to v1 comes at the next token boundary, and fails
        await r.wait_for({t0, t1})
        assert not runner.done()  # the worker lives on

    samples = await run_worker(nats_url, run_id, engine, SchedulerPolicy(interruptible=True), body)
    loads = engine.loads()
    assert [e[1:4] for e in loads[:1]] == [(1, False, True)]  # failed mid-generate
    assert [e[1:3] for e in loads[1:]] == [(1, True)]  # one retry, which loaded v1
    assert loads[1][4] - loads[0][4] >= LOAD_RETRY_S * 0.9  # after a pause, not at once
    assert engine.version == 1
    nothing_generated_while_failing(engine.events)
    # t0 was handed back with the failed batch and generated again, all of it on v1
    for key in (t0, t1):
        check_v1_sample(samples[key], new_model)
        assert samples[key].n_interrupts == 0


async def test_loads_failed_between_batches_do_not_kill_the_worker(
    nats_url, run_id, model_dir, new_model
):
    cfg = InferenceEngineConfig(kind="torch", model_path=str(model_dir), seed=0)
    engine = FlakyEngine(cfg, fail_loads=2)
    t0, t1 = f"{run_id}-t0", f"{run_id}-t1"

    async def body(bus: Bus, r: Rollout, runner: asyncio.Task) -> None:
        await bus.publish(S.PROMPTS, task(run_id, 0, 0))
        await r.wait_for({t0})
        await bus.put_weights(1, save(export_state_dict(new_model)), "float32", step=1)
        await bus.publish(S.PROMPTS, task(run_id, 1, 1))
        await r.wait_for({t1})
        assert not runner.done()  # the worker lives on

    policy = SchedulerPolicy(interruptible=False)  # updates load between batches only
    samples = await run_worker(nats_url, run_id, engine, policy, body)
    loads = engine.loads()
    assert [e[1:4] for e in loads] == [(1, False, False), (1, False, False), (1, True, False)]
    # a pause before each retry, doubling: LOAD_RETRY_S, then 2 * LOAD_RETRY_S
    assert loads[1][4] - loads[0][4] >= LOAD_RETRY_S * 0.9
    assert loads[2][4] - loads[1][4] >= 2 * LOAD_RETRY_S * 0.9
    assert engine.version == 1
    nothing_generated_while_failing(engine.events)
    assert unpack(samples[t0].versions).tolist() == [0] * N_TOKENS
    check_v1_sample(samples[t1], new_model)
