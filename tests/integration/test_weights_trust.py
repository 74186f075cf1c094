"""Weights are trusted only from the run's trainer (issue 13), against a real nats-server.

The adversary of the issue can publish anywhere on the bus: it stores random tensors with the
model's names and shapes in the run's object store and announces them with a correct sha256,
unsigned or signed with a key of its own. Before the fix every rollout worker loaded them, a
forged version 1000021 blocked every later real one, a blob with one wrong-shaped tensor left
the others overwritten, and a `file://` announcement could name any path and was read whole.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from areal.bus.client import Bus
from areal.bus.errors import WeightsRejected
from areal.bus.weights import WeightsChannel
from areal.core.intake import IntakePolicy
from areal.core.scheduling import SchedulerPolicy
from areal.data.tiny_model import build_tiny_model
from areal.engines.base import SamplingParams, WeightUpdate
from areal.engines.config import InferenceEngineConfig, TrainEngineConfig
from areal.engines.torch_infer import TorchInferenceEngine
from areal.engines.torch_train import TorchTrainEngine, export_state_dict
from areal.security.keys import RunKeys
from areal.services.rollout import RolloutService
from areal.services.trainer import TrainerOptions, TrainerService
from schemas import WeightAnnouncement

pytestmark = pytest.mark.integration
FORGED_VERSION = 1000021


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture
def keys() -> RunKeys:
    return RunKeys.generate()


async def wait_until(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll `cond` until it holds; a hang guard, not a timing assertion."""
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.02)


def random_blob(engine: TorchInferenceEngine, seed: int, **replace: torch.Tensor) -> bytes:
    """Random tensors with exactly the model's names and shapes (some replaced)."""
    g = torch.Generator().manual_seed(seed)
    state = {
        k: torch.randn(v.shape, generator=g).to(v.dtype)
        for k, v in export_state_dict(engine.model).items()
    }
    return save({**state, **replace})


def snapshot(engine: TorchInferenceEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def unchanged(engine: TorchInferenceEngine, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())


class Rollout:
    """A rollout worker's weights path: its bus (verify key only), the real torch engine and
    the real `WeightsFollower.on_weights`, subscribed as `RolloutService.run` does (`WeightsFollower.start`)."""

    def __init__(self, bus: Bus, model_dir: str) -> None:
        self.bus = bus
        self.engine = TorchInferenceEngine(
            InferenceEngineConfig(kind="torch", model_path=model_dir, seed=0)
        )
        self.svc = RolloutService(
            bus,
            self.engine,
            lambda ids: "",
            SamplingParams(),
            policy=SchedulerPolicy(interruptible=True),
            max_concurrent_tasks=1,  # weights stream into tensors (no weights_from_bytes)
        )

    def apply_pending(self) -> int | None:
        """What the generate loop does between batches: load the offered weights."""
        update = self.svc.sched.switch_between_batches(0.0)
        if update is None:
            return None
        self.engine.load_weights(WeightUpdate(*update))
        return update[0]


@pytest.fixture
async def buses(nats_url, run_id, keys, tmp_path):
    """trainer (signing key), rollout (verify key, weights dir), and two adversaries: one
    without keys (unsigned announcements) and one with a key of its own."""
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    made = {
        "trainer": await Bus.connect(nats_url, run_id, "trainer", "trainer-0", keys=keys),
        "rollout": await Bus.connect(
            nats_url,
            run_id,
            "rollout",
            "rollout-0",
            keys=keys.public(),
            weights_dir=str(weights_dir),
        ),
        "unsigned": await Bus.connect(nats_url, run_id, "attacker", "attacker-0"),
        "other_key": await Bus.connect(
            nats_url, run_id, "attacker", "attacker-1", keys=RunKeys.generate()
        ),
    }
    yield made
    for bus in made.values():
        await bus.close()


@pytest.fixture
def fetches(monkeypatch) -> list[str]:
    """Names of every object-store weights fetch (the real fetch, counted: every read of the
    run's bucket, streamed or whole, goes through `WeightsChannel.read_into`)."""
    seen: list[str] = []
    real = WeightsChannel.read_into

    async def counted(self, name, nbytes, sink):
        seen.append(name)
        return await real(self, name, nbytes, sink)

    monkeypatch.setattr(WeightsChannel, "read_into", counted)
    return seen


async def test_a_forged_announcement_is_never_fetched_nor_loaded(buses, model_dir, fetches):
    r = Rollout(buses["rollout"], model_dir)
    before = snapshot(r.engine)
    sub = await r.bus.subscribe_weights(r.svc.weights.on_weights)
    try:
        # right names and shapes, a correct sha256, in the run's own object store
        for name in ("unsigned", "other_key"):
            ann = await buses[name].put_weights(1, random_blob(r.engine, 1), "float32", step=1)
            assert ann.sha256 and (ann.signature is None) == (name == "unsigned")
        real = save(export_state_dict(r.engine.model))
        await buses["trainer"].put_weights(2, real, "float32", step=2)
        await wait_until(lambda: r.svc.sched.known_version == 2)
    finally:
        await sub.unsubscribe()
    assert fetches == ["v2"]  # the forged ones were refused before a byte was read
    assert r.svc.stats["weight_loads"] == 1
    assert unchanged(r.engine, before)  # nothing was loaded from the forgeries
    assert r.apply_pending() == 2
    # a direct call is refused just the same (not only the subscription filters)
    forged = await buses["unsigned"].put_weights(3, random_blob(r.engine, 3), "float32", step=3)
    await r.svc.weights.on_weights(forged)
    assert r.svc.sched.known_version == 2 and fetches == ["v2"]
    with pytest.raises(WeightsRejected, match="unsigned"):
        await r.bus.get_weights(forged)
    assert fetches == ["v2"]


async def test_a_forged_high_version_never_blocks_the_real_ones(buses, model_dir):
    r = Rollout(buses["rollout"], model_dir)
    sub = await r.bus.subscribe_weights(r.svc.weights.on_weights)
    blob = save(export_state_dict(r.engine.model))
    try:
        await buses["unsigned"].put_weights(FORGED_VERSION, blob, "float32", step=1)
        await buses["other_key"].put_weights(FORGED_VERSION + 1, blob, "float32", step=1)
        for v in (1, 2, 3):
            await buses["trainer"].put_weights(v, blob, "float32", step=v)
            await wait_until(lambda v=v: r.svc.sched.known_version == v)
            assert r.apply_pending() == v
    finally:
        await sub.unsubscribe()
    assert r.engine.version == 3
    # the stream's newest messages are forgeries: latest is still the trainer's newest
    await buses["unsigned"].put_weights(FORGED_VERSION + 2, blob, "float32", step=1)
    assert (await r.bus.latest_weights()).version == 3
    # and a worker that starts now (its first delivery would be the forgery) gets v3
    late = Rollout(buses["rollout"], model_dir)
    sub = await late.bus.subscribe_weights(late.svc.weights.on_weights)
    try:
        await wait_until(lambda: late.svc.sched.known_version == 3)
    finally:
        await sub.unsubscribe()


async def test_latest_verifies_each_announcement_once(
    buses, model_dir, monkeypatch, nats_url, run_id, keys
):
    """`latest` is called on every version change by the reward and controller workers: it
    reads and verifies only the announcements that arrived since its previous call (it used to
    re-read and re-verify the whole history, O(versions) per call), and still skips forgeries."""
    blob = save(export_state_dict(Rollout(buses["rollout"], model_dir).engine.model))
    reader = buses["rollout"]
    checked: list[str] = []
    real_verify = RunKeys.verify

    def verify(self: RunKeys, payload: bytes, signature: str) -> bool:
        checked.append(signature)
        return real_verify(self, payload, signature)

    monkeypatch.setattr(RunKeys, "verify", verify)
    for v in range(1, 6):
        await buses["trainer"].put_weights(v, blob, "float32", step=v)
    assert (await reader.latest_weights()).version == 5
    assert len(checked) == 5  # the history, once
    for _ in range(3):
        assert (await reader.latest_weights()).version == 5
    assert len(checked) == 5  # nothing new: nothing verified again
    await buses["other_key"].put_weights(FORGED_VERSION, blob, "float32", step=1)
    await buses["trainer"].put_weights(6, blob, "float32", step=6)
    await buses["other_key"].put_weights(FORGED_VERSION + 1, blob, "float32", step=1)
    assert (await reader.latest_weights()).version == 6
    assert len(checked) == 8  # the three new announcements, the two forgeries refused
    # a worker that starts now reads the whole history once, and agrees
    late = await Bus.connect(nats_url, run_id, "controller", "controller-0", keys=keys.public())
    try:
        assert (await late.latest_weights()).version == 6
    finally:
        await late.close()


@pytest.mark.parametrize("defect", ["wrong_shape", "nan"])
async def test_a_bad_blob_signed_by_the_trainer_changes_nothing(buses, model_dir, defect):
    """Even the trainer's own signature does not make a blob that does not fit loadable."""
    r = Rollout(buses["rollout"], model_dir)
    before = snapshot(r.engine)
    state = export_state_dict(r.engine.model)
    name = sorted(state)[-1]  # checked last: a copy-as-you-go loader would have done the rest
    if defect == "wrong_shape":
        bad = torch.zeros(state[name].shape[0] + 1, *state[name].shape[1:])
    else:
        bad = state[name].clone()
        bad.view(-1)[0] = float("nan")
    ann = await buses["trainer"].put_weights(
        1, random_blob(r.engine, 5, **{name: bad}), "float32", step=1
    )
    await r.svc.weights.on_weights(ann)
    assert r.svc.sched.known_version == 0 and r.svc.sched.pending is None  # nothing offered
    assert r.svc.stats["weight_loads"] == 0
    assert unchanged(r.engine, before) and r.engine.version == 0


def read_bytes() -> int:
    """Bytes this process has read through read(2) and friends so far (/proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def signed(keys: RunKeys, run_id: str, uri: str, nbytes: int, version: int = 9):
    ann = WeightAnnouncement(version=version, uri=uri, sha256="0" * 64, bytes=nbytes, step=1)
    return ann.model_copy(update={"signature": keys.sign(ann.signed_payload(run_id))})


async def test_file_weights_only_from_regular_files_under_the_weights_dir(
    buses, keys, run_id, tmp_path
):
    """Signed by the trainer, so only the file checks stand between the URI and a read."""
    rollout = buses["rollout"]
    weights_dir = tmp_path / "weights"
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"w" * 1000)
    (weights_dir / "escape.safetensors").symlink_to(outside)
    (weights_dir / "zero.safetensors").symlink_to("/dev/zero")
    os.mkfifo(weights_dir / "fifo.safetensors")
    sparse = weights_dir / "huge.safetensors"
    with sparse.open("wb") as f:
        f.truncate(1 << 30)  # 1 GiB, no blocks: reading it whole is what must not happen
    cases = {
        f"file://{outside}": "outside the weights dir",
        f"file://{weights_dir}/escape.safetensors": "outside the weights dir",
        f"file://{weights_dir}/../outside.safetensors": "without '..'",
        "file:///dev/zero": "outside the weights dir",
        f"file://{weights_dir}/zero.safetensors": "outside the weights dir",
        f"file://{weights_dir}/fifo.safetensors": "not a regular file",
        f"file://{sparse}": "holds 1073741824 bytes, 1000 were announced",
    }
    for uri, reason in cases.items():
        start = read_bytes()
        with pytest.raises(WeightsRejected, match=reason):
            await asyncio.wait_for(rollout.get_weights(signed(keys, run_id, uri, 1000)), 30)
        assert read_bytes() - start < 1 << 20, uri  # not one MiB read (socket reads included)
    # the trainer's own file weights still load (a regular file under the dir)
    trainer_ann = await buses["trainer"].put_weights(
        1, b"ok" * 500, "float32", step=1, file_dir=str(weights_dir)
    )
    assert await rollout.get_weights(trainer_ann) == b"ok" * 500
    # without weights.transport=file a worker reads no file at all
    with pytest.raises(WeightsRejected, match="weights.transport=file"):
        await buses["trainer"].get_weights(trainer_ann)


async def test_an_object_of_another_size_than_announced_is_refused_before_reading(
    buses, keys, run_id
):
    big = await buses["unsigned"].put_weights(9, b"x" * (3 << 20), "float32", step=1)
    ann = signed(keys, run_id, big.uri, 1000)  # a small size announced for a 3 MiB object
    with pytest.raises(WeightsRejected, match=f"holds {3 << 20} bytes, 1000 were announced"):
        await buses["rollout"].get_weights(ann)


async def test_the_trainers_restore_ignores_a_forged_newer_announcement(buses, model_dir, tmp_path):
    def trainer(out: Path) -> TrainerService:
        engine = TorchTrainEngine(TrainEngineConfig(kind="torch", model_path=model_dir, lr=1e-4))
        opts = TrainerOptions(
            intake=IntakePolicy(batch_size=1, group_size=1, max_staleness=1),
            total_steps=1,
            max_tokens_per_mb=64,
        )
        out.mkdir()
        return TrainerService(buses["trainer"], engine, opts, out)

    blob = b"w" * 100
    await buses["unsigned"].put_weights(FORGED_VERSION, blob, "float32", step=1)
    await buses["other_key"].put_weights(FORGED_VERSION + 1, blob, "float32", step=1)
    svc = trainer(tmp_path / "a")
    await svc.restore()
    assert svc.engine.version == 0  # not rolled forward past the forgeries
    assert (await buses["rollout"].latest_weights()).version == 0  # it announced its own
    # the control: a newer announcement the trainer did sign is rolled forward past
    await buses["trainer"].put_weights(5, blob, "float32", step=5)
    svc = trainer(tmp_path / "b")
    await svc.restore()
    assert svc.engine.version == 6
