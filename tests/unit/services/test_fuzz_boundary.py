"""Property-based fuzzing of every stage's boundary: thousands of generated bad or lying
messages (random bytes, wrong types, boundary and non-finite values, huge arrays, lying lengths,
foreign task ids, unadmitted seqs, future versions; groups with one lying sample, an index
twice, a sample of another task or prompt, a marker among samples) go through the real decode step and the real
handlers of the rollout, reward and trainer services. Every one is dead-lettered with a reason,
none raises (a worker would exit), none is scheduled, scored or filed, and good traffic still
flows afterwards.

The bus is a recording stand-in (no server): what is under test is each service's decision for
each message, which is all the bus would carry out."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal.bus.codec import DecodeError, decode, encode, pack
from areal.config import NatsSettings
from areal.core.intake import IntakePolicy
from areal.core.scheduling import SchedulerPolicy
from areal.core.validate import Bounds
from areal.engines.base import SamplingParams
from areal.services.reward import RewardService
from areal.services.rollout import RolloutService
from areal.services.samples import rejection_marker
from areal.services.trainer import TrainerOptions, TrainerService
from schemas import SampleGroup, ScoredGroup, ScoredSample, Task
from schemas import subjects as S
from schemas.state import ControllerState
from schemas.subjects import RunNames
from tests.factories import make_sample, make_task

EXAMPLES = 1000  # per stage
RUN, G, VOCAB, MAX_NEW, ADMITTED, LATEST = "fz", 4, 50, 8, 100, 3
BOUNDS = Bounds(
    run_id=RUN,
    group_size=G,
    max_new_tokens=MAX_NEW,
    vocab_size=VOCAB,
    max_seq_len=64,
    reward_range=(0.0, 1.0),
)
FUZZ = settings(
    max_examples=EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)


class FakeBus:
    """What a service asks of the bus, recorded."""

    def __init__(self) -> None:
        self.names = RunNames(RUN)
        self.worker_id = "fuzz"
        self.settings = NatsSettings()
        self.published: list[tuple[str, Any]] = []
        self.dead: list[tuple[str, str]] = []  # (stage, reason) of copies (lease held)
        self.events: list[str] = []

    async def publish(self, stream: str, msg: Any, *rest: str, msg_id: str | None = None):
        self.published.append((stream, msg))

    async def dead_letter(self, stage: str, msg: Any, reason: str) -> None:
        self.dead.append((stage, reason))

    async def latest_weights(self):
        return SimpleNamespace(version=LATEST)

    async def kv_get(self, key: str, model: type) -> Any:
        return ControllerState(admitted=ADMITTED)

    async def event(self, type_: str, **detail: Any) -> None:
        self.events.append(type_)


class FakeLease:
    def __init__(self, stage: str, data: bytes, delivered: int) -> None:
        self.stage, self.msg = stage, SimpleNamespace(data=data, subject=stage, headers={})
        self.num_delivered = delivered
        self.outcome: str | None = None
        self.reason = ""

    async def ack(self) -> None:
        self.outcome = self.outcome or "ack"

    async def nak(self, delay_s: float | None = None) -> None:
        self.outcome = self.outcome or "nak"

    async def dead_letter(self, reason: str) -> None:
        self.outcome, self.reason = self.outcome or "dead_letter", reason


async def deliver(bus: FakeBus, svc: Any, stage: str, cls: type, data: bytes) -> FakeLease:
    """What `Bus.consume` does with one delivery (its last one: max_deliver reached)."""
    lease = FakeLease(stage, data, delivered=bus.settings.max_deliver)
    try:
        obj = decode(data, cls)
    except DecodeError as e:
        await lease.dead_letter(str(e))
        return lease
    n_dead = len(bus.dead)
    await svc.handle(obj, lease)  # must not raise
    if lease.outcome is None and len(bus.dead) > n_dead:  # a copy was dead-lettered, lease held
        lease.outcome, lease.reason = "dead_letter", bus.dead[-1][1]
    return lease


# ---------------------------------------------------------------- generated lies

BAD_INTS = st.sampled_from([-1, -(2**31), VOCAB, VOCAB + 1, 2**31 - 1, 10**6])
BAD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30, 5.0])
WRONG_TYPES = st.sampled_from(["x", None, [], {}, b"\x00", 1.5, [1, 2]])  # never int-like


def _ids(draw, n: int) -> list[int]:
    return draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))


def _good_sample(draw, seq: int, idx: int, prompt: list[int]) -> tuple[dict, int]:
    """A sample dict (wire form) of task `seq` of this run, and its length."""
    n = draw(st.integers(1, MAX_NEW))
    good = make_sample(
        n=n,
        task_id=f"{RUN}-t{seq}",
        task_seq=seq,
        sample_idx=idx,
        group_size=G,
        prompt_ids=pack(prompt, "int32"),
        output_ids=pack(_ids(draw, n), "int32"),
        behav_logp=pack(
            -np.abs(np.array(draw(st.lists(st.floats(0, 20), min_size=n, max_size=n)))), "float32"
        ),
        versions=pack(
            sorted(draw(st.lists(st.integers(0, LATEST), min_size=n, max_size=n))), "int32"
        ),
    ).model_dump(by_alias=True)
    return good, n


@st.composite
def lying_group(draw) -> dict:
    """A group dict (wire form): the G samples of a task of this run, with exactly one lie in
    one sample, or in the group's shape."""
    seq = draw(st.integers(0, ADMITTED - 3))  # the last two are for good traffic
    prompt = _ids(draw, draw(st.integers(1, 6)))
    samples, lengths = zip(*(_good_sample(draw, seq, i, prompt) for i in range(G)), strict=True)
    samples = list(samples)
    if draw(st.booleans()):
        k = draw(st.integers(0, G - 1))
        draw(st.sampled_from(LIES))(draw, samples[k], lengths[k])
    else:
        draw(st.sampled_from(GROUP_LIES))(draw, samples)
    return {"samples": samples}


def _twice(draw, samples: list[dict]) -> None:
    samples[draw(st.integers(1, G - 1))] = samples[0]


def _foreign(draw, samples: list[dict]) -> None:
    other = draw(st.integers(0, ADMITTED - 1).filter(lambda s: s != samples[0]["task_seq"]))
    k = draw(st.integers(0, G - 1))
    samples[k] = {**samples[k], "task_id": f"{RUN}-t{other}", "task_seq": other}


def _marker_among(draw, samples: list[dict]) -> None:
    s = samples[0]
    marker = rejection_marker(s["task_id"], s["task_seq"], G, "x", worker_id="w")
    samples[draw(st.integers(0, G - 1))] = marker.model_dump(by_alias=True)


def _other_prompt(draw, samples: list[dict]) -> None:
    k = draw(st.integers(1, G - 1))
    samples[k] = {**samples[k], "prompt_ids": pack([VOCAB - 1] * 7, "int32").model_dump()}


GROUP_LIES = [_twice, _foreign, _marker_among, _other_prompt]


def _poke_array(field: str, dtype: str, bad: Any):
    def lie(draw, d: dict, n: int) -> None:
        values = list(
            np.frombuffer(d[field]["data"], dtype="<i4" if d[field]["dtype"] == "int32" else "<f4")
        )
        values[draw(st.integers(0, len(values) - 1))] = bad(draw)
        d[field] = pack(values, dtype).model_dump()

    return lie


def _set(field: str, value):
    def lie(draw, d: dict, n: int) -> None:
        d[field] = value(draw) if callable(value) else value

    return lie


def _lying_length(draw, d: dict, n: int) -> None:
    d["behav_logp"] = pack([-1.0] * (n + draw(st.integers(1, 5))), "float32").model_dump()


def _huge(draw, d: dict, n: int) -> None:
    m = draw(st.integers(MAX_NEW + 1, 5000))
    d["output_ids"] = pack([1] * m, "int32").model_dump()
    d["behav_logp"] = pack([-1.0] * m, "float32").model_dump()
    d["versions"] = pack([0] * m, "int32").model_dump()


def _random_bytes_field(draw, d: dict, n: int) -> None:
    d[draw(st.sampled_from(["output_ids", "behav_logp", "versions", "prompt_ids"]))] = {
        "dtype": draw(
            st.sampled_from(["int32", "int64", "float32", "float16", "bfloat16", "int8"])
        ),
        "data": draw(st.binary(min_size=1, max_size=40)),
    }
    # a field of the right dtype may still decode: then make it certainly bad
    d["versions"] = pack([LATEST + 1] * n, "int32").model_dump()


def _lying_mask(draw, d: dict, n: int) -> None:
    """A loss mask that lies: a model token (a version, a log-prob) called the environment's, a
    value other than 0/1, or a length other than the output's."""
    mask = [1] * n
    mask[draw(st.integers(0, n - 1))] = draw(st.sampled_from([0, 2, 255]))
    if draw(st.booleans()):
        mask += [1] * draw(st.integers(1, 3))
    d["loss_mask"] = pack(mask, "uint8").model_dump()


LIES = [
    _poke_array("output_ids", "int32", lambda draw: draw(BAD_INTS)),
    _poke_array("prompt_ids", "int32", lambda draw: draw(BAD_INTS)),
    _poke_array("behav_logp", "float32", lambda draw: draw(BAD_FLOATS)),
    _poke_array("versions", "int32", lambda draw: draw(st.sampled_from([-1, LATEST + 1, 10**9]))),
    _set("group_size", lambda draw: draw(st.sampled_from([1, G + 1, 10**6]))),
    _set("task_id", lambda draw: draw(st.sampled_from(["other-t1", "", "x" * 5000, f"{RUN}-t"]))),
    _set("task_seq", lambda draw: draw(st.sampled_from([-1, ADMITTED + 5, 10**12]))),
    _set("sample_idx", lambda draw: draw(st.sampled_from([-1, G, 10**9]))),
    _set("schema_version", lambda draw: draw(st.sampled_from([0, 3, 99]))),
    _set("finish_reason", lambda draw: draw(st.sampled_from(["", "stop\x00", "eos"]))),
    _set("prompt_ids", pack([], "int32").model_dump()),
    _set("timings", {"t": math.nan}),
    _set("output_ids", lambda draw: draw(WRONG_TYPES)),
    _set("task_seq", lambda draw: draw(WRONG_TYPES)),
    _lying_length,
    _huge,
    _random_bytes_field,
    _lying_mask,
]


MSGPACK_INTS = st.integers(-(2**63), 2**64 - 1)


@st.composite
def garbage(draw) -> bytes:
    return draw(
        st.one_of(
            st.binary(max_size=200),
            st.builds(
                lambda x: msgpack.packb(x),
                st.one_of(MSGPACK_INTS, st.text(), st.lists(MSGPACK_INTS)),
            ),
            st.builds(
                lambda d: msgpack.packb(d, use_bin_type=True),
                st.dictionaries(
                    st.text(max_size=8), st.one_of(MSGPACK_INTS, st.text(), st.none()), max_size=6
                ),
            ),
        )
    )


# ---------------------------------------------------------------- stages


class Engine:
    vocab_size, max_seq_len, version = VOCAB, 64, LATEST


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _check_refused(lease: FakeLease) -> None:
    assert lease.outcome == "dead_letter", (lease.outcome, lease.reason)
    assert lease.reason.strip()


def good_group(seq: int, reward: float = 1.0, bad_reward: float | None = None) -> ScoredGroup:
    """The scored group of task `seq`; with `bad_reward`, the last sample carries it."""
    rewards = [reward] * (G - 1) + [reward if bad_reward is None else bad_reward]
    return ScoredGroup(
        scored=[
            ScoredSample(
                sample=make_sample(
                    task_id=f"{RUN}-t{seq}", task_seq=seq, sample_idx=i, group_size=G
                ),
                reward=r,
            )
            for i, r in enumerate(rewards)
        ]
    )


@pytest.mark.slow  # ~14 s on 2 cores: hundreds of generated lies
@FUZZ
@given(st.one_of(lying_group(), garbage()))
def test_the_trainer_refuses_every_lie_and_files_nothing(loop, msg):
    bus = _trainer_bus.get()
    svc = _trainer.get()
    if isinstance(msg, dict):  # a lying group with good rewards
        scored = [{"sample": s, "reward": 1.0} for s in msg["samples"]]
        data = msgpack.packb({"scored": scored}, use_bin_type=True)
    else:
        data = msg
    lease = loop.run_until_complete(deliver(bus, svc, S.REWARDS, ScoredGroup, data))
    _check_refused(lease)
    assert all(not g.samples for g in svc.intake.groups.values())  # nothing filed to train on


@FUZZ
@given(st.floats(allow_nan=True, allow_infinity=True).filter(lambda r: not 0 <= r <= 1))
def test_the_trainer_refuses_every_reward_outside_the_range(loop, reward):
    bus, svc = _trainer_bus.get(), _trainer.get()
    data = encode(good_group(3, bad_reward=reward))
    _check_refused(loop.run_until_complete(deliver(bus, svc, S.REWARDS, ScoredGroup, data)))
    assert all(not g.samples for g in svc.intake.groups.values())


@pytest.mark.slow  # ~15 s on 2 cores: hundreds of generated lies
@FUZZ
@given(st.one_of(lying_group(), garbage()))
def test_the_reward_worker_refuses_every_lie_and_scores_nothing(loop, msg):
    bus, svc = _reward_bus.get(), _reward.get()
    data = msgpack.packb(msg, use_bin_type=True) if isinstance(msg, dict) else msg
    n_pub = len(bus.published)
    lease = loop.run_until_complete(deliver(bus, svc, S.TRAJECTORIES, SampleGroup, data))
    _check_refused(lease)
    # at most a rejection marker went on (for a task of this run), never a scored sample
    for _, group in bus.published[n_pub:]:
        assert len(group.scored) == 1 and group.first.rejected and group.scored[0].reward == 0.0


@st.composite
def lying_task(draw) -> dict:
    seq = draw(st.integers(0, ADMITTED - 1))
    good = make_task(
        task_id=f"{RUN}-t{seq}",
        seq=seq,
        group_size=G,
        prompt_ids=pack(_ids(draw, draw(st.integers(1, 6))), "int32"),
        admitted_version=draw(st.integers(0, LATEST)),
    ).model_dump(by_alias=True)
    lie = draw(
        st.sampled_from(
            [
                _poke_array("prompt_ids", "int32", lambda draw: draw(BAD_INTS)),
                _set("prompt_ids", pack([], "int32").model_dump()),
                _set("prompt_ids", pack(list(range(64)), "int32").model_dump()),
                _set(
                    "prompt_ids",
                    lambda draw: {"dtype": "float32", "data": b"\0" * 4 * draw(st.integers(1, 5))},
                ),
                _set(
                    "admitted_version",
                    lambda draw: draw(st.sampled_from([LATEST + 1, 2 * 10**9, -1])),
                ),
                _set("group_size", lambda draw: draw(st.sampled_from([0, 1, G + 1, 10**9]))),
                _set(
                    "task_id", lambda draw: draw(st.sampled_from(["other-t1", f"{RUN}-t{seq + 1}"]))
                ),
                _set("seq", lambda draw: draw(WRONG_TYPES)),
                _set("schema_version", 7),
            ]
        )
    )
    lie(draw, good, 0)
    return good


@pytest.mark.slow  # ~6 s on 2 cores: hundreds of generated lies
@FUZZ
@given(st.one_of(lying_task(), garbage()))
def test_the_rollout_refuses_every_lying_task_and_schedules_nothing(loop, msg):
    bus, svc = _rollout_bus.get(), _rollout.get()
    data = msgpack.packb(msg, use_bin_type=True) if isinstance(msg, dict) else msg
    lease = loop.run_until_complete(deliver(bus, svc, S.PROMPTS, Task, data))
    _check_refused(lease)
    assert not svc.sched.tasks and not svc.sched.queue  # never reached the scheduler


def test_good_traffic_still_flows_through_each_stage(loop):
    """After the lies, a good message of each kind is filed, scored or scheduled."""
    tb, trainer = _trainer_bus.get(), _trainer.get()
    data = encode(good_group(99))
    lease = loop.run_until_complete(deliver(tb, trainer, S.REWARDS, ScoredGroup, data))
    assert lease.outcome is None and trainer.intake.groups[f"{RUN}-t99"].samples  # held, filed
    rwb, reward = _reward_bus.get(), _reward.get()
    samples = SampleGroup(samples=[sc.sample for sc in good_group(97).scored])
    lease = loop.run_until_complete(
        deliver(rwb, reward, S.TRAJECTORIES, SampleGroup, encode(samples))
    )
    assert lease.outcome == "ack" and len(rwb.published[-1][1].scored) == G  # scored, one message
    rb, rollout = _rollout_bus.get(), _rollout.get()
    task = make_task(task_id=f"{RUN}-t98", seq=98, group_size=G)
    lease = loop.run_until_complete(deliver(rb, rollout, S.PROMPTS, Task, encode(task)))
    assert lease.outcome is None and f"{RUN}-t98" in rollout.sched.tasks


# ---------------------------------------------------------------- one service per stage


class _Lazy:
    def __init__(self, make):
        self.make, self.value = make, None

    def get(self):
        if self.value is None:
            self.value = self.make()
        return self.value


_trainer_bus, _reward_bus, _rollout_bus = _Lazy(FakeBus), _Lazy(FakeBus), _Lazy(FakeBus)


def _make_trainer():
    import tempfile

    opts = TrainerOptions(
        intake=IntakePolicy(batch_size=2, group_size=G, max_staleness=2),
        total_steps=1,
        max_tokens_per_mb=256,
        bounds=BOUNDS,
    )
    svc = TrainerService(_trainer_bus.get(), Engine(), opts, tempfile.mkdtemp())
    svc.intake.state.version = LATEST
    return svc


def _make_reward():
    return RewardService(
        _reward_bus.get(),
        "arithmetic",
        timeout_s=5,
        pool_workers=1,
        bounds=BOUNDS,
        score_range=(0.0, 1.0),
    )


def _make_rollout():
    return RolloutService(
        _rollout_bus.get(),
        Engine(),
        lambda ids: "",
        SamplingParams(max_new_tokens=MAX_NEW),
        policy=SchedulerPolicy(interruptible=False),
        max_concurrent_tasks=4,
        weights_from_bytes=lambda b: {},
        bounds=BOUNDS,
    )


_trainer, _reward, _rollout = _Lazy(_make_trainer), _Lazy(_make_reward), _Lazy(_make_rollout)
