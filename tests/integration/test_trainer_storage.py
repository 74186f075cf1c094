"""The trainer's writes on a full disk pause and go on by themselves (issue 42): weights to a
file or to the run's object store, the summary and the final model. Each pause is one
`storage_full` run event on the bus, then one `storage_recovered`, whatever the retries.

The object store is full for real: a server with a small `max_file_store`, filled by another
bucket that the test empties while the trainer waits. The file writes fail as a full disk makes
them fail (ENOSPC from the writer, or safetensors' message). Backoff is shortened to 10 ms."""

from __future__ import annotations

import asyncio
import errno

import nats
import pytest
from nats.js.api import ObjectStoreConfig

from areal.bus import run_weights
from areal.bus.client import Bus
from areal.bus.embedded import EmbeddedNats
from areal.bus.weights import WeightsChannel
from areal.security.keys import RunKeys
from areal.services import trainer as trainer_module
from schemas import Event
from tests.integration.test_trainer_publish import end_step, make_trainer, run_state

pytestmark = pytest.mark.integration


class Seen:
    """The run's storage events, as another worker sees them live."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.changed = asyncio.Event()

    async def __call__(self, ev: Event) -> None:
        self.events.append(ev)
        self.changed.set()

    @property
    def types(self) -> list[str]:
        return [e.type for e in self.events]

    async def wait_for(self, type_: str) -> Event:
        async with asyncio.timeout(60):  # hang guard
            while type_ not in self.types:
                self.changed.clear()
                await self.changed.wait()
        return next(e for e in self.events if e.type == type_)


async def watch(bus: Bus) -> Seen:
    seen = Seen()
    for kind in ("storage_full", "write_failed", "storage_recovered"):
        await bus.subscribe_events(kind, seen)
    return seen


def fast(svc) -> None:
    svc.storage.first_delay_s = svc.storage.max_delay_s = 0.01


async def test_a_weights_file_write_on_a_full_disk_pauses_then_lands(
    buses, model_dir, tmp_path, monkeypatch
):
    trainer_bus, rollout_bus = buses
    seen = await watch(rollout_bus)
    weights_dir = tmp_path / "weights"
    svc = make_trainer(trainer_bus, model_dir, tmp_path, weights_dir=str(weights_dir))
    fast(svc)
    real_write, fails = run_weights._write_atomic, {"n": 3}

    def full_disk(path, blob):
        if fails["n"]:
            fails["n"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, blob)

    monkeypatch.setattr(run_weights, "_write_atomic", full_disk)
    await svc.restore()  # publishes v0: three failed writes, then it lands
    assert (await rollout_bus.latest_weights()).version == 0
    assert (weights_dir / "v0.safetensors").is_file()
    full = await seen.wait_for("storage_full")
    recovered = await seen.wait_for("storage_recovered")
    assert full.detail["what"] == "weights"
    assert full.detail["path"] == str(weights_dir / "v0.safetensors")
    assert full.detail["needs_bytes"] > 0 and "No space left" in full.detail["error"]
    assert recovered.detail["retries"] == 2 and recovered.detail["since"] == full.detail["since"]
    assert seen.types.count("storage_full") == 1  # once per pause, not per retry


async def test_the_summary_and_the_final_model_on_a_full_disk_pause_then_land(
    buses, model_dir, tmp_path, monkeypatch
):
    trainer_bus, rollout_bus = buses
    seen = await watch(rollout_bus)
    svc = make_trainer(trainer_bus, model_dir, tmp_path)
    fast(svc)
    await svc.restore()
    end_step(svc, 2)
    real_save, real_summary = svc.engine.save_pretrained, trainer_module.write_summary
    fails = {"final": 2, "summary": 2}

    def save_pretrained(path: str) -> None:
        if fails["final"]:
            fails["final"] -= 1  # what safetensors says: the errno is only in the message
            raise Exception(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )  # noqa: E501
        real_save(path)

    def write_summary(path, summary) -> None:
        if fails["summary"]:
            fails["summary"] -= 1
            raise OSError(errno.EDQUOT, "Disk quota exceeded", str(path))
        real_summary(path, summary)

    monkeypatch.setattr(svc.engine, "save_pretrained", save_pretrained)
    monkeypatch.setattr(trainer_module, "write_summary", write_summary)
    summary = await svc._finish()
    assert summary.steps == 2 and (tmp_path / "summary.json").is_file()
    assert (tmp_path / "final" / "config.json").is_file()
    async with asyncio.timeout(60):  # hang guard
        while seen.types.count("storage_recovered") < 2:
            seen.changed.clear()
            await seen.changed.wait()
    # two pauses, one after the other: each reported once
    assert seen.types == ["storage_full", "storage_recovered"] * 2
    assert [e.detail["what"] for e in seen.events[::2]] == ["final_model", "summary"]
    assert (await run_state(trainer_bus)).done


async def test_an_object_store_that_is_full_pauses_the_publish_until_it_has_room(
    model_dir, tmp_path, run_id
):
    """A JetStream server at its storage limit refuses the chunks (10023/10047); the trainer
    waits, announcing nothing, and publishes once another bucket's bytes are gone."""
    with EmbeddedNats(store_dir=tmp_path / "nats", max_file_store_bytes=8 * 2**20) as server:
        keys = RunKeys.generate()
        trainer_bus = await Bus.connect(server.url, run_id, "trainer", "trainer-0", keys=keys)
        rollout_bus = await Bus.connect(
            server.url, run_id, "rollout", "rollout-0", keys=keys.public()
        )
        ballast = WeightsChannel(server.url, "ballast", "ballast")
        try:
            seen = await watch(rollout_bus)
            nc = await nats.connect(server.url)  # a second bucket, to fill the store with
            js = nc.jetstream()
            await js.create_object_store("ballast", ObjectStoreConfig())
            used = (await js.account_info()).storage
            await nc.close()
            await ballast.start()
            svc = make_trainer(trainer_bus, model_dir, tmp_path / "out")
            fast(svc)
            # leave 1 MiB: room for events and run state, not for the weights (1.6 MB)
            await ballast.put("fill", b"\0" * (8 * 2**20 - used - 2**20))
            publishing = asyncio.ensure_future(svc.restore())
            full = await seen.wait_for("storage_full")
            assert (
                full.detail["path"].startswith("nats-obj://") and full.detail["what"] == "weights"
            )
            assert "JetStream error" in full.detail["error"]
            assert not publishing.done() and await rollout_bus.latest_weights() is None
            await ballast.delete("fill")  # room again
            async with asyncio.timeout(60):  # hang guard
                await publishing
            await seen.wait_for("storage_recovered")
            assert (await rollout_bus.latest_weights()).version == 0
        finally:
            await ballast.close()
            await trainer_bus.close()
            await rollout_bus.close()
