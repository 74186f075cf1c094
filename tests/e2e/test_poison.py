"""Well-formed lies against a real run: every poison is dead-lettered with its reason on its
first delivery (or, for a task that was never admitted, after its redeliveries), good traffic
keeps flowing, no worker restarts, and the run finishes with exact accounting and a finite loss
at every step.

The run uses an external nats-server without accounts, so this test can publish as an outsider
would on an open bus (or as a compromised worker could on its own subjects). Weights forgery and
the sandbox have their own tests."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import uuid
from pathlib import Path

import nats
import pytest
from nats.js.api import DeliverPolicy

from areal.bus.codec import decode, encode, pack
from areal.bus.embedded import EmbeddedNats
from schemas import DeadLetter, PackedArray, SampleGroup, ScoredGroup, ScoredSample
from schemas import subjects as S
from schemas.state import CONTROLLER_KEY, TRAINER_KEY
from schemas.subjects import RunNames
from tests.e2e.test_run import _worker_pid, records, start_run, wait_steps
from tests.factories import make_sample, make_task

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

RUN = "poison"
G, B, ETA, MAX_NEW = 8, 16, 1, 6  # examples/arithmetic.yaml
HUGE_ID = 10**6  # beyond any vocabulary here
STEPS = 30
NEVER_ADMITTED = "was never admitted"


def _sample(seq: int, **fields):
    """A sample of task `seq` of the run that looks like a rollout's (until `fields`)."""
    return make_sample(
        **{
            "task_id": f"{RUN}-t{seq}",
            "task_seq": seq,
            "group_size": G,
            "sample_idx": 0,
            "versions": pack([0] * 5, "int32"),
            **fields,
        }
    )


IDENTITY = ("task_id", "task_seq", "group_size", "prompt_ids")  # the same in every sample


def _group(seq: int, **fields) -> SampleGroup:
    """The group message of task `seq`: sample 0 carries `fields`, the others are good (the
    fields naming the task go to every sample, so the group stays one task's)."""
    same = {k: v for k, v in fields.items() if k in IDENTITY}
    n = same.get("group_size", G)
    return SampleGroup(
        samples=[_sample(seq, sample_idx=i, **(fields if i == 0 else same)) for i in range(n)]
    )


def _scored_group(seq: int, reward: float = 1.0, **fields) -> ScoredGroup:
    """`_group` scored: sample 0 gets `reward`, the others 1.0."""
    samples = _group(seq, **fields).samples
    return ScoredGroup(
        scored=[
            ScoredSample(sample=s, reward=reward if i == 0 else 1.0) for i, s in enumerate(samples)
        ]
    )


def _poisons(admitted: int) -> list[tuple[str, bytes, str]]:
    """(stream, payload, what the dead letter's reason must say). Tasks named by `open_seq` are
    admitted and most likely still open, so their rejection retires them (accounted)."""
    open_seq = admitted - 1
    never = 10**7  # a seq the controller never admits in this run
    scored = [
        ({"reward": math.nan}, "not finite"),
        ({"reward": math.inf}, "not finite"),
        ({"reward": 1e30}, "outside the scorer's range"),
        ({"behav_logp": pack([-1.0, math.nan, -1.0, -1.0, -1.0], "float32")}, "non-finite"),
        ({"behav_logp": pack([-1.0, math.inf, -1.0, -1.0, -1.0], "float32")}, "non-finite"),
        ({"output_ids": pack([1, 2, HUGE_ID, 3, 4], "int32")}, "outside the vocabulary"),
        ({"output_ids": pack([1, -5, 2, 3, 4], "int32")}, "negative token id"),
        ({"prompt_ids": pack([1, HUGE_ID], "int64")}, "outside the vocabulary"),
        ({"group_size": 3}, "group_size 3"),
        ({"behav_logp": PackedArray(dtype="float16", data=b"\0" * 10)}, "not float32"),
        ({"versions": pack([0, 0, 0, 0, 10**6], "int32")}, "newest published version"),
        ({"task_id": "intruder-t1", "task_seq": 1}, "not this run's id"),
    ]
    out: list[tuple[str, bytes, str]] = []
    for fields, why in scored:
        reward = fields.pop("reward", 1.0)
        out.append((S.REWARDS, encode(_scored_group(open_seq, reward, **fields)), why))
    # groups that are not one whole task
    whole = _scored_group(open_seq).scored
    for scored, why in [
        ([*whole[:-1], whole[0]], "more than once"),
        ([*whole[:-1], _scored_group(open_seq - 1).scored[-1]], "is not of this task"),
    ]:
        out.append((S.REWARDS, encode(ScoredGroup(scored=scored)), why))
    # a valid group of a task that was never admitted: handed back, then dead-lettered
    out.append((S.REWARDS, encode(_scored_group(never)), NEVER_ADMITTED))
    # lying lengths (decode fails) and a payload just under max_payload
    lying = _scored_group(open_seq).model_dump(by_alias=True)
    lying["scored"][0]["sample"]["behav_logp"] = {"dtype": "float32", "data": b"\0" * 8}
    import msgpack

    out.append((S.REWARDS, msgpack.packb(lying, use_bin_type=True), "tokens but behav_logp"))
    out.append((S.REWARDS, os.urandom(8 * 1024 * 1024 - 4096), "payload is"))
    # samples at the reward worker
    for fields, why in [
        ({"behav_logp": pack([-1.0, 5.0, -1.0, -1.0, -1.0], "float32")}, "behav_logp outside"),
        ({"versions": pack([0, 1, 0, 0, 0], "int32")}, "decrease"),
        (
            {
                "output_ids": pack(list(range(MAX_NEW + 3)), "int32"),
                "versions": pack([0] * 9, "int32"),
                "behav_logp": pack([-1.0] * 9, "float32"),
            },
            "more than max_new_tokens",
        ),
        ({"task_id": "intruder-t2", "task_seq": 2}, "not this run's id"),
    ]:
        out.append((S.TRAJECTORIES, encode(_group(open_seq, **fields)), why))
    # tasks at the rollout
    for fields, why in [
        ({"prompt_ids": pack([3, HUGE_ID], "int32")}, "outside the vocabulary"),
        ({"prompt_ids": pack([-3, 4], "int32")}, "negative token id"),
        ({"prompt_ids": pack([], "int32")}, "empty prompt_ids"),
        ({"prompt_ids": PackedArray(dtype="float32", data=b"\0" * 8)}, "dtype float32"),
        ({"admitted_version": 2_000_000_000}, "admitted at version 2000000000"),
        ({"group_size": 3}, "group_size 3"),
        ({"task_id": "intruder-t3", "seq": 3}, "not this run's id"),
    ]:
        task = make_task(
            **{"task_id": f"{RUN}-t{open_seq}", "seq": open_seq, "group_size": G, **fields}
        )
        out.append((S.PROMPTS, encode(task), why))
    return out


async def _inject(url: str) -> tuple[list[tuple[str, bytes, str]], int]:
    """Publish the poisons; returns them and the seq of the admitted task they name."""
    names = RunNames(RUN)
    nc = await nats.connect(url)
    js = nc.jetstream()
    kv = await js.key_value(names.state_bucket)
    admitted = json.loads((await kv.get(CONTROLLER_KEY)).value)["admitted"]
    poisons = _poisons(admitted)
    for stream, data, _ in poisons:  # fresh message ids: nothing the server would de-duplicate
        await js.publish(names.subject(stream), data, headers={"Nats-Msg-Id": uuid.uuid4().hex})
    await nc.close()
    return poisons, admitted - 1


async def _tamper(url: str, out: Path) -> None:
    """Tamper with the run state: each write must be refused by the controller, none may stop or
    crash it. The trainer may overwrite a write before the controller reads it, so a write is
    repeated until the controller has refused it. Each one starts from the trainer's newest
    record (every record it writes is seen through a watch, even one that a write of ours
    overwrote at once), never from one of ours."""
    names = RunNames(RUN)
    nc = await nats.connect(url)
    kv = await nc.jetstream().key_value(names.state_bucket)
    watcher = await kv.watch(TRAINER_KEY)
    log_path = out / "logs" / "controller-0.log"
    ours: set[bytes] = set()
    good: dict | None = None

    async def newest_good() -> dict:
        nonlocal good
        while True:
            try:
                entry = await watcher.updates(timeout=0.1 if good is None else 0.01)
            except nats.errors.TimeoutError:
                if good is not None:
                    return good
                continue
            if entry is not None and entry.value and entry.value not in ours:
                good = json.loads(entry.value)

    for tamper, refusal in (
        (lambda good: b"{not json", "undecodable"),
        (lambda good: {**good, "done": True}, "done at step"),
        (lambda good: {**good, "version": 1_000_021}, "never announced"),
        (lambda good: {**good, "dropped_stale": 10**6}, "returned slots for"),
    ):
        for _ in range(20):
            value = tamper(await newest_good())
            raw = value if isinstance(value, bytes) else json.dumps(value).encode()
            ours.add(raw)
            await kv.put(TRAINER_KEY, raw)
            await asyncio.sleep(0.5)
            if refusal in log_path.read_text():
                break
    await watcher.stop()
    await nc.close()


async def _await_dead_letter(url: str, reason: str, timeout_s: float = 300) -> None:
    """Wait until a dead letter whose reason holds `reason` is in the DLQ (hang guard)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not any(reason in d.reason for d in await _dead_letters(url)):
        assert asyncio.get_running_loop().time() < deadline, f"no dead letter says {reason!r}"
        await asyncio.sleep(0.5)


async def _dead_letters(url: str) -> list[DeadLetter]:
    names = RunNames(RUN)
    nc = await nats.connect(url)
    js = nc.jetstream()
    n = (await js.stream_info(names.stream(S.DLQ))).state.messages
    sub = await js.subscribe(
        names.subject(S.DLQ, ">"), ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
    )
    out = [decode((await sub.next_msg(timeout=30)).data, DeadLetter) for _ in range(n)]
    await nc.close()
    return out


@pytest.mark.slow  # a 30-step quickstart run with 28 poisons: ~1-2 minutes on 2 cores
def test_poison_is_dead_lettered_and_the_run_finishes_with_exact_accounting(tmp_path):
    server = EmbeddedNats(store_dir=tmp_path / "nats").start()
    out = tmp_path / "run"
    proc = start_run(
        out,
        f"train.total_steps={STEPS}",
        f"nats.url={server.url}",
        f"run_id={RUN}",
        "seed=3",
        "nats.max_deliver=3",  # a never-admitted group is handed back twice, then dead-lettered
        "watchdog.frozen_after_s=3600",  # the rollout worker is paused on purpose below
    )
    try:
        wait_steps(proc, out, 3)
        # The never-admitted group is dead-lettered only on its last delivery, seconds after the
        # first (the trainer's waits double), and a fast machine can finish the run before
        # then. Pausing the rollout worker holds the run (no new trajectories, so no step)
        # while the trainer keeps consuming: the run goes on once that dead letter is in and
        # the run state has been tampered with.
        rollout = _worker_pid(proc.pid, "rollout-0")
        assert rollout is not None
        os.kill(rollout, signal.SIGSTOP)
        try:
            poisons, open_seq = asyncio.run(_inject(server.url))
            asyncio.run(_await_dead_letter(server.url, NEVER_ADMITTED))
            asyncio.run(_tamper(server.url, out))  # the run held: it cannot finish meanwhile
        finally:
            os.kill(rollout, signal.SIGCONT)
        _, err = proc.communicate(timeout=900)  # hang guard
        assert proc.returncode == 0, err.decode()[-3000:]
        dead = asyncio.run(_dead_letters(server.url))
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()

    # every poison is in the DLQ with its reason, bounded in size
    for stream, data, why in poisons:
        hits = [d for d in dead if d.payload_bytes == len(data) and data.startswith(d.payload)]
        assert hits, (stream, why, [d.reason[:120] for d in dead])
        assert any(why in d.reason for d in hits), (stream, why, [d.reason for d in hits])
        assert all(len(d.payload) <= 64 * 1024 for d in hits)
    # exact accounting; rejected tasks gave their slots back; every step's loss is finite
    summary = json.loads((out / "summary.json").read_text())
    assert summary["admitted"] == (
        summary["trained"]
        + summary["dropped_stale"]
        + summary["filtered"]
        + summary["rejected"]
        + summary["in_flight"]
    ), summary
    assert summary["in_flight"] == 0 and summary["steps"] == STEPS, summary
    assert summary["trained"] == STEPS * B
    recs = records(out)
    # the task the poisons named ended once: rejected, or trained when the poisons reached the
    # trainer while its group was in the batch being trained (the trainer keeps filing then)
    trained_seqs = [seq for r in recs for seq in r["task_seqs"]]
    assert len(trained_seqs) == len(set(trained_seqs)) == STEPS * B
    assert summary["rejected"] == (0 if open_seq in trained_seqs else 1), (summary, open_seq)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in recs)
    for r in recs:
        assert r["outstanding"] <= (r["version"] + ETA + 1) * B, r
    assert summary["skipped_steps"] == 0
    # no worker crashed or restarted; the controller refused every tampered run state
    assert "worker_restarted" not in err.decode()
    ctrl = (out / "logs" / "controller-0.log").read_text()
    for reason in ("undecodable", "done at step", "never announced", "returned slots for"):
        assert reason in ctrl, reason
