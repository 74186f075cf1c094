"""A full or failing disk pauses a trainer write instead of crashing it (issue 42): the
classifier, the retry loop (one pair of events per pause, however many retries), and the run
files that must survive a retried append.

Time is a fake clock; the backoff's sleeps advance it instead of waiting."""

from __future__ import annotations

import asyncio
import errno
import io
import os

import pytest
import torch
from structlog.testing import capture_logs

from areal.bus.errors import PermissionDenied, server_storage_error
from areal.services.run_files import EvalLog, MetricsLog, append_line
from areal.services.storage import StorageGuard, StorageWriteError, storage_error


def torch_save_into_full_file() -> RuntimeError:
    """What `torch.save` into a Python file object raises when the disk fills (the torch
    engine's checkpoint): a RuntimeError, with the ENOSPC only as its context."""

    class FillsUp(io.RawIOBase):  # takes 1000 bytes, then the disk is full
        n = 0

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            self.n += len(b)
            if self.n > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return len(b)

    try:
        torch.save({"w": torch.zeros(10_000)}, FillsUp())
    except RuntimeError as e:
        return e
    raise AssertionError("torch.save did not fail")


def raised_while_handling(inner: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:
            raise outer  # noqa: B904 - the implicit context is the point
    except BaseException as e:
        return e


# ---------------------------------------------------------------- the classifier
def test_enospc_in_the_context_of_torch_save_s_runtime_error_is_storage_full():
    e = torch_save_into_full_file()
    assert "unexpected pos" in str(e)  # not an OSError at the top ...
    kind, cause = storage_error(e)  # ... the chain says why
    assert kind == "storage_full" and cause.errno == errno.ENOSPC


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_or_quota_is_storage_full(code):
    assert storage_error(OSError(code, os.strerror(code)))[0] == "storage_full"


def test_a_full_disk_raised_from_another_error_is_storage_full():
    e = RuntimeError("write failed")
    e.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert storage_error(e)[0] == "storage_full"


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.EIO, errno.ENOENT])
def test_another_disk_error_is_write_failed(code):
    assert storage_error(OSError(code, os.strerror(code)))[0] == "write_failed"


def test_a_programming_error_is_no_storage_error():
    assert storage_error(ValueError("bad shape")) is None
    assert storage_error(KeyError("model")) is None
    # a FileNotFoundError some library handled on its way to a ValueError is not a disk error
    assert storage_error(raised_while_handling(FileNotFoundError(2, "x"), ValueError("y"))) is None
    # ... but EACCES underneath is
    assert storage_error(raised_while_handling(PermissionError(13, "x"), ValueError("y")))


def test_bus_outages_and_refusals_are_no_storage_errors():
    assert storage_error(TimeoutError()) is None
    assert storage_error(ConnectionRefusedError(errno.ECONNREFUSED, "refused")) is None
    assert storage_error(PermissionDenied("may not publish to x")) is None  # a PermissionError


def test_a_server_store_that_is_full_is_storage_full():
    full = server_storage_error(10047, "insufficient storage resources available", "storing v3")
    assert full is not None and storage_error(full)[0] == "storage_full"
    disk = server_storage_error(10051, "write /x/1.blk: no space left on device", "storing v3")
    assert disk is not None and disk.errno == errno.ENOSPC
    broken = server_storage_error(10051, "write /x/1.blk: input/output error", "storing v3")
    assert broken is not None and storage_error(broken)[0] == "write_failed"
    assert server_storage_error(10059, "stream not found", "storing v3") is None


def test_writers_that_keep_only_the_message_are_read_by_it():
    # safetensors (the final model): a Rust io::Error in the message
    full = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert storage_error(full)[0] == "storage_full"
    # torch's path-based writer (DeepSpeed, DCP): no errno anywhere
    torn = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    torn.__context__ = RuntimeError("basic_ios::clear: iostream error")
    assert storage_error(torn)[0] == "write_failed"


# ---------------------------------------------------------------- the retry loop
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s
        await asyncio.sleep(0)


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    async def __call__(self, type_: str, **detail) -> None:
        self.seen.append((type_, detail))

    @property
    def types(self) -> list[str]:
        return [t for t, _ in self.seen]


def guard(clock: Clock, events: Events | None = None, **kw) -> StorageGuard:
    return StorageGuard(events, sleep=clock.sleep, wall=clock.now, monotonic=clock.now, **kw)


def failing(n: int, exc: BaseException, result: str = "landed"):
    calls = {"n": 0}

    async def op() -> str:
        calls["n"] += 1
        if calls["n"] <= n:
            raise exc
        return result

    return op, calls


async def test_a_write_on_a_full_disk_pauses_retries_with_backoff_and_resumes(tmp_path):
    clock, events = Clock(), Events()
    g = guard(clock, events)
    op, calls = failing(6, OSError(errno.ENOSPC, "No space left on device"))
    assert await g.write("checkpoint", tmp_path / "ckpt", op, needs_bytes=5 * 2**20) == "landed"
    await g.drain()
    assert calls["n"] == 7
    # 1 s doubling, capped at 30 s: 1 + 2 + 4 + 8 + 16 + 30 = 61 s paused
    assert clock.slept == [1, 2, 4, 8, 16, 30]
    # one event when the pause began, one when it ended: not one per retry
    assert events.types == ["storage_full", "storage_recovered"]
    full, recovered = events.seen[0][1], events.seen[1][1]
    assert full["path"] == str(tmp_path / "ckpt") and full["what"] == "checkpoint"
    assert full["needs_bytes"] == 5 * 2**20 and full["free_bytes"] > 0
    assert "No space left" in full["error"]
    assert recovered["paused_s"] == 61 and recovered["retries"] == 5
    assert recovered["since"] == full["since"]
    assert g.pause is None and g.pauses == 1 and g.failures == 6 and g.paused_s == 61


async def test_writes_failing_together_are_one_pause(tmp_path):
    clock, events = Clock(), Events()
    g = guard(clock, events)
    disk_full = OSError(errno.ENOSPC, "No space left on device")
    weights, _ = failing(3, disk_full)
    metrics, _ = failing(1, disk_full)
    await asyncio.gather(
        g.write("weights", tmp_path / "w", weights), g.write("metrics", tmp_path / "m", metrics)
    )
    await g.drain()
    # the metrics write landed while the weights still failed: the pause lasted until both did
    assert events.types == ["storage_full", "storage_recovered"]
    assert g.pauses == 1
    # a later failure is a new pause, reported again
    again, _ = failing(1, OSError(errno.EACCES, "Permission denied"))
    await g.write("summary", tmp_path / "s", again)
    await g.drain()
    assert events.types[2:] == ["write_failed", "storage_recovered"]


async def test_a_programming_error_is_raised_at_once_with_no_pause(tmp_path):
    clock, events = Clock(), Events()
    g = guard(clock, events)
    op, calls = failing(1, ValueError("bad shape"))
    with pytest.raises(ValueError, match="bad shape"):
        await g.write("metrics", tmp_path, op)
    await g.drain()
    assert calls["n"] == 1 and clock.slept == [] and events.types == [] and g.pause is None


async def test_a_pause_past_give_up_s_stops_with_the_reason(tmp_path):
    clock, events = Clock(), Events()
    g = guard(clock, events, give_up_s=10.0)
    op, calls = failing(10**6, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(StorageWriteError, match=r"No space left on device.*--resume"):
        await g.write("checkpoint", tmp_path, op)
    # 1 + 2 + 4 = 7 s; the next 8 s would pass 10 s
    assert calls["n"] == 4 and clock.slept == [1, 2, 4]
    await g.drain()
    assert events.types == ["storage_full"]


async def test_an_event_the_bus_cannot_publish_never_holds_a_write(tmp_path):
    clock = Clock()
    stuck = asyncio.Event()

    async def emit(type_: str, **detail) -> None:
        await stuck.wait()  # the bus's own store is full: its publish waits

    g = guard(clock, emit)
    op, _ = failing(2, OSError(errno.ENOSPC, "No space left on device"))
    assert await asyncio.wait_for(g.write("metrics", tmp_path, op), 30) == "landed"  # hang guard
    await g.drain(timeout_s=0.01)  # gives up waiting; the events go on in the background
    stuck.set()
    await g.drain()


async def test_an_event_that_fails_to_publish_is_logged_not_raised(tmp_path):
    clock = Clock()

    async def emit(type_: str, **detail) -> None:
        raise RuntimeError("bus closed")

    g = guard(clock, emit, event_patience_s=0.0)  # refused for good: given up at once
    op, _ = failing(1, OSError(errno.ENOSPC, "No space left on device"))
    with capture_logs() as logs:
        assert await g.write("metrics", tmp_path, op) == "landed"
        await g.drain()
    said = [(r["event"], r.get("event_type")) for r in logs]
    assert ("storage_full", None) in said and ("storage_recovered", None) in said
    assert ("storage_event_not_published", "storage_full") in said


async def test_an_event_the_bus_refused_is_retried_and_lands_in_order(tmp_path):
    """The bus's store sat on the disk that filled: it refuses the pause's events until it
    stores again; they reach the stream then, in order."""
    clock = Clock()
    published: list[str] = []
    refusals = {"n": 2}

    async def emit(type_: str, **detail) -> None:
        if refusals["n"]:
            refusals["n"] -= 1
            raise RuntimeError("nats: insufficient resources")
        published.append(type_)

    g = guard(clock, emit)
    op, _ = failing(1, OSError(errno.ENOSPC, "No space left on device"))
    with capture_logs() as logs:
        assert await g.write("metrics", tmp_path, op) == "landed"
        await asyncio.wait_for(g.drain(), 30)  # hang guard: two retries of 0.5 s and 1 s
    assert published == ["storage_full", "storage_recovered"]
    said = [(r["event"], r.get("event_type"), r.get("retrying")) for r in logs]
    assert ("storage_event_not_published", "storage_full", True) in said
    assert ("storage_event_published", "storage_full", None) in said
    assert clock.slept == [1]  # the write's own retry: its events' retries never held it


# ---------------------------------------------------------------- run files, retried
def test_an_append_cut_short_by_a_full_disk_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    append_line(path, '{"step": 1}')
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 4:
            return real_write(fd, bytes(data[: len(data) // 2]))  # some bytes got through ...
        raise OSError(errno.ENOSPC, "No space left on device")  # ... then the disk was full

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError):
        append_line(path, '{"step": 2, "reward_mean": 0.5}')
    monkeypatch.undo()
    assert path.read_text() == '{"step": 1}\n'  # no torn record for the retry to follow
    append_line(path, '{"step": 2, "reward_mean": 0.5}')
    assert [r["step"] for r in MetricsLog(path).records()] == [1, 2]


async def test_an_eval_record_is_retried_and_kept_once(tmp_path, monkeypatch):
    clock, events = Clock(), Events()
    g = guard(clock, events)
    evals = EvalLog(tmp_path / "eval.jsonl")
    real_write = os.write
    fails = {"n": 2}

    def flaky(fd, data):
        if fails["n"]:
            fails["n"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", flaky)
    assert await g.write_sync("eval", evals.path, evals.add, {"round": 0, "eval_reward": 0.5})
    monkeypatch.undo()
    await g.drain()
    assert [r["round"] for r in evals.records()] == [0]
    assert events.types == ["storage_full", "storage_recovered"]
