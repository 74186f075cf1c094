"""Multi-turn episodes through the real rollout service, bus, object store and torch engine.

A test workflow generates, waits on a "tool" (an event the test sets once new weights are in
hand: a weight switch between turns), appends environment tokens, and generates again while
more weights arrive (a switch mid-turn). The sample on `trajectories` must hold exactly the
token stream the model saw, a loss mask with zeros on the environment tokens (version -1,
log-prob 0), and for every model token the log-prob that a plain forward pass gives under the
version that produced it. A workflow that raises costs only its own task.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from areal.bus.client import Bus
from areal.bus.codec import decode, pack, unpack
from areal.bus.connection import connect
from areal.core.scheduling import SchedulerPolicy
from areal.data.tiny_model import build_tiny_model
from areal.data.tokenizer import load_tokenizer
from areal.engines.base import SamplingParams
from areal.engines.config import InferenceEngineConfig
from areal.engines.torch_train import export_state_dict
from areal.services.rollout import RolloutService
from areal.workflows.api import Episode, Generator, Segment
from schemas import DeadLetter, Sample, SampleGroup, Task
from schemas import subjects as S
from tests.factories import make_task
from tests.integration.test_interruptible import SlowEngine

pytestmark = pytest.mark.integration
TURN_TOKENS = 40
GUARD_S = 120.0


class TwoTurnsWithATool:
    """Turn 1, a tool wait (`tool_gate`), the tool's tokens, turn 2."""

    def __init__(self, env_ids: list[int], tool_gate: asyncio.Event, fail_on: set[int]) -> None:
        self.env_ids, self.tool_gate, self.fail_on = env_ids, tool_gate, fail_on
        self.in_tool = asyncio.Event()

    async def arun_episode(self, gen: Generator, task: Task, sample_idx: int) -> Episode:
        if (task.seq, sample_idx) in self.fail_on:
            raise RuntimeError(f"workflow bug on task {task.seq}")
        ids = task.prompt_ids.to_list()
        first = await gen.generate(ids, max_new_tokens=TURN_TOKENS)
        self.in_tool.set()
        await self.tool_gate.wait()  # the tool runs: the row is free meanwhile
        second = await gen.generate(ids + first.output_ids + self.env_ids)
        return Episode(
            segments=[
                Segment.model(first),
                Segment.env(self.env_ids, "<r>7</r>"),
                Segment.model(second),
            ],
            finish_reason=second.finish_reason,
            n_turns=2,
        )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def perturbed(path, scale: float, seed: int):
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * scale)
    return m


def forward_logps(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def task(run_id: str, i: int, prompt: list[int]) -> Task:
    return make_task(
        task_id=f"{run_id}-t{i}",
        seq=i,
        dataset_index=i,
        prompt="12+34=",
        prompt_ids=pack(prompt, "int32"),
        answer="46",
        group_size=1,
    )


async def until(cond, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GUARD_S
    while not cond():
        assert loop.time() < deadline, f"hang guard: {what}"
        await asyncio.sleep(0.01)


async def two_turn_episode(nats_url, run_id, model_dir, engine, *, mid_turn: bool) -> None:
    """One two-turn episode on `engine` through the real rollout service: v1 is published
    while the episode waits in its tool (a switch between turns), and with `mid_turn` v2 a few
    tokens into turn 2 (a switch within it); then every token is checked (module docstring)."""
    from areal.engines.torch_infer import weights_from_safetensors

    models = [AutoModelForCausalLM.from_pretrained(model_dir)]
    models += [perturbed(model_dir, 0.05, 1), perturbed(model_dir, 0.05, 2)]
    tok = load_tokenizer(model_dir)
    prompt = tok.encode("12+34=", add_special_tokens=False)
    env_ids = tok.encode("<r>7</r>", add_special_tokens=False)
    gate = asyncio.Event()
    workflow = TwoTurnsWithATool(env_ids, gate, set())
    bus = await Bus.connect(nats_url, run_id, "rollout", "rollout-0")
    params = SamplingParams(max_new_tokens=TURN_TOKENS * 3, temperature=1.0, stop_token_ids=())
    svc = RolloutService(
        bus,
        engine,
        lambda ids: tok.decode(ids),
        params,
        policy=SchedulerPolicy(interruptible=True),
        max_concurrent_tasks=1,
        weights_from_bytes=weights_from_safetensors,
        workflow=workflow,
    )
    samples: list[Sample] = []

    async def on_sample(msg) -> None:
        samples.extend(decode(msg.data, SampleGroup).samples)

    raw = await connect(nats_url, "test-raw")
    await raw.subscribe(bus.names.subject(S.TRAJECTORIES), cb=on_sample)
    stop = asyncio.Event()
    runner = asyncio.create_task(svc.run(stop))
    try:
        await bus.publish(S.PROMPTS, task(run_id, 0, prompt))
        await asyncio.wait_for(workflow.in_tool.wait(), GUARD_S)  # turn 1 done, in the tool
        await bus.put_weights(1, save(export_state_dict(models[1])), "float32", step=1)
        await until(lambda: svc.sched.known_version >= 1, "v1 fetched")
        gate.set()  # the tool answers: turn 2 starts on v1
        if mid_turn:
            await until(lambda: engine.version >= 1 and svc.meter._since is not None, "turn 2")
            await asyncio.sleep(0.1)  # a few tokens into turn 2 (10 ms a token)
            await bus.put_weights(2, save(export_state_dict(models[2])), "float32", step=2)
        await until(lambda: bool(samples), "the sample")
    finally:
        stop.set()
        await runner
        await bus.close()
        await raw.close()

    (s,) = samples
    out = unpack(s.output_ids).tolist()
    versions = unpack(s.versions).tolist()
    mask = unpack(s.loss_mask).tolist()
    behav = torch.from_numpy(unpack(s.behav_logp).copy())
    n1, ne = TURN_TOKENS, len(env_ids)
    assert out[n1 : n1 + ne] == env_ids  # the stream is the ids the model saw, appended
    assert mask == [1] * n1 + [0] * ne + [1] * (len(out) - n1 - ne)
    assert versions[:n1] == [0] * n1  # turn 1 on v0
    assert versions[n1 : n1 + ne] == [-1] * ne and behav[n1 : n1 + ne].eq(0).all()
    turn2 = versions[n1 + ne :]
    assert turn2[0] == 1 and turn2 == sorted(turn2), turn2  # v1 from the first token on
    if mid_turn:
        assert turn2[-1] == 2, turn2  # and v2 within turn 2
    assert s.n_turns == 2 and s.finish_reason == "length"
    lps = [forward_logps(m, prompt, out) for m in models]
    for t, v in enumerate(versions):
        if v >= 0:
            torch.testing.assert_close(behav[t], lps[v][t], atol=1e-4, rtol=0)
    assert not torch.allclose(lps[0][n1 + ne :], lps[1][n1 + ne :], atol=1e-3)


async def test_weight_switches_between_and_within_turns_keep_every_logp_true(
    nats_url, run_id, model_dir
):
    engine = SlowEngine(InferenceEngineConfig(kind="torch", model_path=str(model_dir), seed=0))
    await two_turn_episode(nats_url, run_id, model_dir, engine, mid_turn=True)


async def test_a_workflow_that_raises_costs_only_its_own_task(nats_url, run_id, model_dir):
    tok = load_tokenizer(model_dir)
    prompt = tok.encode("12+34=", add_special_tokens=False)
    gate = asyncio.Event()
    gate.set()
    workflow = TwoTurnsWithATool(tok.encode("<r>7</r>", add_special_tokens=False), gate, {(1, 0)})
    bus = await Bus.connect(nats_url, run_id, "rollout", "rollout-0")
    engine = SlowEngine(InferenceEngineConfig(kind="torch", model_path=str(model_dir), seed=0))
    svc = RolloutService(
        bus,
        engine,
        lambda ids: tok.decode(ids),
        SamplingParams(max_new_tokens=TURN_TOKENS, temperature=1.0, stop_token_ids=()),
        policy=SchedulerPolicy(interruptible=True),
        max_concurrent_tasks=3,
        workflow=workflow,
    )
    groups: list[SampleGroup] = []
    dead: list[DeadLetter] = []

    async def on_group(msg) -> None:
        groups.append(decode(msg.data, SampleGroup))

    async def on_dead(msg) -> None:
        dead.append(decode(msg.data, DeadLetter))

    raw = await connect(nats_url, "test-raw")
    await raw.subscribe(bus.names.subject(S.TRAJECTORIES), cb=on_group)
    await raw.subscribe(bus.names.dlq_subject(S.PROMPTS), cb=on_dead)
    stop = asyncio.Event()
    runner = asyncio.create_task(svc.run(stop))
    try:
        for i in range(3):
            await bus.publish(S.PROMPTS, task(run_id, i, prompt))
        await until(lambda: len(groups) == 3 and dead, "3 groups and a dead letter")
        await until(lambda: svc.sched.tasks == {}, "every task settled")
    finally:
        stop.set()
        await runner
        await bus.close()
        await raw.close()
    by_seq = {g.first.task_seq: g.first for g in groups}
    assert by_seq[1].rejected and "workflow bug on task 1" in by_seq[1].rejected
    assert not by_seq[0].rejected and not by_seq[2].rejected
    assert by_seq[0].n_turns == by_seq[2].n_turns == 2
    (dl,) = dead
    assert "RuntimeError: workflow bug on task 1" in dl.reason and "Traceback" in dl.reason
    assert svc.stats["workflow_failures"] == 1
    assert await bus_depth(nats_url, run_id) == 0  # every prompt acked or dead-lettered


async def bus_depth(nats_url: str, run_id: str) -> int:
    bus = await Bus.connect(nats_url, run_id, "rollout", "rollout-1", declare=False)
    try:
        return await bus.stream_depth(S.PROMPTS)
    finally:
        await bus.close()


async def test_the_docs_example_workflow_runs_from_its_spec(nats_url, run_id, model_dir):
    """`examples.workflows.double_check:DoubleCheck` (docs/workflows.md), built by the registry
    from its spec as the rollout worker builds it, on the real engine: two model turns around
    the environment's question, masked."""
    from areal.workflows.context import WorkflowContext
    from areal.workflows.registry import make_workflow

    tok = load_tokenizer(model_dir)
    ctx = WorkflowContext(
        decode=lambda ids: tok.decode(ids),
        encode=lambda text: tok.encode(text, add_special_tokens=False),
        max_new_tokens=8,
        max_turns=2,
    )
    workflow = make_workflow("examples.workflows.double_check:DoubleCheck", ctx, {})
    bus = await Bus.connect(nats_url, run_id, "rollout", "rollout-0")
    engine = SlowEngine(InferenceEngineConfig(kind="torch", model_path=str(model_dir), seed=0))
    svc = RolloutService(
        bus,
        engine,
        ctx.decode,
        SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=()),
        policy=SchedulerPolicy(interruptible=True),
        max_concurrent_tasks=1,
        workflow=workflow,
    )
    groups: list[SampleGroup] = []

    async def on_group(msg) -> None:
        groups.append(decode(msg.data, SampleGroup))

    raw = await connect(nats_url, "test-raw")
    await raw.subscribe(bus.names.subject(S.TRAJECTORIES), cb=on_group)
    stop = asyncio.Event()
    runner = asyncio.create_task(svc.run(stop))
    try:
        prompt = tok.encode("12+34=", add_special_tokens=False)
        await bus.publish(S.PROMPTS, task(run_id, 0, prompt).model_copy(update={"group_size": 2}))
        await until(lambda: bool(groups), "the group")
    finally:
        stop.set()
        await runner
        await bus.close()
        await raw.close()
    asked = ctx.encode(" Check: ")
    for s in groups[0].samples:
        assert [t.role for t in s.turns] == ["model", "env", "model"]
        assert unpack(s.loss_mask).tolist() == [1] * 8 + [0] * len(asked) + [1] * 8
        assert unpack(s.output_ids).tolist()[8 : 8 + len(asked)] == asked
