"""Part 1 of the bus benchmark: latency and throughput of real `Sample`s through the bus.

A publisher (this process, `Bus.publish`) and a consumer (its own process, `Bus.consume` + lease
ack, as the reward worker does) share the run's real `trajectories` work-queue stream on a real
`EmbeddedNats`. The two talk over a control channel of core subjects `bench.<run_id>.{ctl, ack,
done}` on a separate raw connection per process (`areal.bus.connection.connect`), never through
the `Bus`, so control traffic shares no socket with the measured path.

Invariants:
- Every measured message carries its sequence number and `bench_t0` (CLOCK_MONOTONIC read just
  before `Bus.publish`, encode included) in `Sample.timings`; the consumer reports
  (seq, t0, t1) with t1 read just after its handler acked the decoded `Sample`.
- Every control command but `exit` is answered on the ack subject before the next one is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from _common import median, percentile

from areal.bus.client import Bus
from areal.bus.codec import decode, encode, pack
from areal.bus.connection import connect
from areal.bus.embedded import EmbeddedNats
from schemas import Sample
from schemas import subjects as S

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from areal.bus.client import Lease

SIZES = (1024, 8192, 32768)
CONSUMER_MAX_INFLIGHT = 4  # RewardService: max_inflight = 4 * pool_workers (default 1)
PUBLISH_CONCURRENCY = 64
PROMPT_TOKENS = 64
_REC = struct.Struct("<qdd")  # seq, t0 (before publish), t1 (consumer decoded + acked)

# size -> metric -> one value per repeat: lat_p50_ms, lat_p99_ms, publish, drain<max_inflight>
# (msg/s) and bytes (the encoded size, one value)
BusResults = dict[int, dict[str, list[float]]]


# ------------------------------------------------------------------------------- messages
def make_sample(n_tokens: int, tag: str, seq: int, rng: np.random.Generator) -> Sample:
    """A `Sample` as the rollout publishes it: packed int32 ids/versions, float32 log-probs, the
    decoded text (one char per token with the built-in char tokenizer)."""
    return Sample(
        task_id=f"{tag}-{seq // 8}",
        task_seq=seq // 8,
        sample_idx=seq % 8,
        group_size=8,
        prompt_ids=pack(rng.integers(3, 60, PROMPT_TOKENS), "int32"),
        output_ids=pack(rng.integers(3, 60, n_tokens), "int32"),
        behav_logp=pack(-3.0 * rng.random(n_tokens, dtype=np.float32), "float32"),
        versions=pack(np.full(n_tokens, 7), "int32"),
        output_text="".join(chr(48 + int(c)) for c in rng.integers(0, 40, n_tokens)),
        answer="12345",
        metadata={"task": "bench", "index": seq},
        finish_reason="length",
        worker_id="bench-publisher",
        n_interrupts=1,
        n_reprefill_tokens=PROMPT_TOKENS + n_tokens // 2,
        timings={"admitted_at": time.time(), "received_at": time.time(), "seq": float(seq)},
    )


def codec_cost_us(n_tokens: int, reps: int) -> tuple[float, float, int]:
    """Median (over 5 batches) µs per encode and per decode; encoded size in bytes."""
    s = make_sample(n_tokens, "codec", 0, np.random.default_rng(0))
    data = encode(s)
    enc, dec = [], []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            encode(s)
        enc.append((time.perf_counter() - t) / reps * 1e6)
        t = time.perf_counter()
        for _ in range(reps):
            decode(data, Sample)
        dec.append((time.perf_counter() - t) / reps * 1e6)
    return median(enc), median(dec), len(data)


# ------------------------------------------------------------------------------- consumer
async def consumer_main(url: str, run_id: str) -> None:
    """Runs in its own process: consume `trajectories` like the reward worker (`Bus.consume`,
    decode, ack) while told to ("go <max_inflight>" ... "pause"), and report (seq, t0, t1) in
    batches on a core subject, off the measured path."""
    bus = await Bus.connect(url, run_id, "reward", "bench-consumer", declare=False)
    ctl_nc = await connect(url, f"bench-{run_id}-consumer-ctl")
    records: list[bytes] = []
    ctl: asyncio.Queue[bytes] = asyncio.Queue()

    async def handler(sample: Sample, lease: Lease) -> None:
        await lease.ack()
        t1 = time.perf_counter()
        records.append(_REC.pack(int(sample.timings["seq"]), sample.timings["bench_t0"], t1))

    async def flusher() -> None:
        while True:
            await asyncio.sleep(0.002)
            if records:
                blob = b"".join(records)
                records.clear()
                await ctl_nc.publish(f"bench.{run_id}.done", blob)

    async def on_ctl(msg: Msg) -> None:
        await ctl.put(msg.data)

    await ctl_nc.subscribe(f"bench.{run_id}.ctl", cb=on_ctl)
    flush = asyncio.create_task(flusher())
    await ctl_nc.publish(f"bench.{run_id}.ack", b"ready")
    stop, task = asyncio.Event(), None
    while True:
        cmd = (await ctl.get()).decode().split()
        if cmd[0] == "go":
            stop = asyncio.Event()
            task = asyncio.create_task(
                bus.consume(S.TRAJECTORIES, Sample, handler, max_inflight=int(cmd[1]), stop=stop)
            )
        elif cmd[0] == "pause" and task is not None:
            stop.set()
            await task
            task = None
        elif cmd[0] == "exit":
            break
        await ctl_nc.publish(f"bench.{run_id}.ack", cmd[0].encode())
    flush.cancel()
    await ctl_nc.flush()
    await ctl_nc.close()
    await bus.close()


# ------------------------------------------------------------------------------- publisher
class Done:
    """Collects the consumer's (seq, t0, t1) reports."""

    def __init__(self) -> None:
        self.recs: dict[int, tuple[float, float]] = {}
        self.changed = asyncio.Event()

    async def on_msg(self, msg: Msg) -> None:
        for seq, t0, t1 in _REC.iter_unpack(msg.data):
            self.recs[seq] = (t0, t1)
        self.changed.set()

    async def wait_for(self, pred: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"consumer reported {len(self.recs)} messages only")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)


async def publish_one(bus: Bus, s: Sample) -> None:
    s.timings["bench_t0"] = time.perf_counter()
    await bus.publish(S.TRAJECTORIES, s)


class Control:
    """Commands to the consumer process over the raw control connection, each answered on the
    ack subject."""

    def __init__(self, nc: Client, run_id: str) -> None:
        self.nc, self.run_id = nc, run_id
        self.acks: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_ack(self, msg: Msg) -> None:
        await self.acks.put(msg.data)

    async def send(self, cmd: str) -> None:
        await self.nc.publish(f"bench.{self.run_id}.ctl", cmd.encode())
        if cmd != "exit":
            await asyncio.wait_for(self.acks.get(), 30)
        else:
            await self.nc.flush()


async def _latency_rep(
    bus: Bus, ctl: Control, done: Done, samples: list[Sample], res: dict[str, list[float]]
) -> None:
    """Closed loop, one message in flight: the unloaded end-to-end latency."""
    await ctl.send(f"go {CONSUMER_MAX_INFLIGHT}")
    lats = []
    for s in samples:
        k = int(s.timings["seq"])
        await publish_one(bus, s)
        await done.wait_for(lambda k=k: k in done.recs)
        t0, t1 = done.recs[k]
        lats.append((t1 - t0) * 1e3)
    await ctl.send("pause")
    res["lat_p50_ms"].append(percentile(lats, 50))
    res["lat_p99_ms"].append(percentile(lats, 99))


async def _throughput_rep(
    bus: Bus,
    ctl: Control,
    done: Done,
    samples: list[Sample],
    max_inflight: int,
    res: dict[str, list[float]],
) -> None:
    """Publish throughput with the consumer paused, then the drain rate of that backlog."""
    keys = [int(s.timings["seq"]) for s in samples]
    sem = asyncio.Semaphore(PUBLISH_CONCURRENCY)

    async def guarded(s: Sample) -> None:
        async with sem:
            await publish_one(bus, s)

    t_start = time.perf_counter()
    await asyncio.gather(*(guarded(s) for s in samples))
    res["publish"].append(len(samples) / (time.perf_counter() - t_start))
    t_go = time.perf_counter()
    await ctl.send(f"go {max_inflight}")
    left = set(keys)

    def drained() -> bool:
        left.difference_update([k for k in list(left) if k in done.recs])
        return not left

    await done.wait_for(drained, 300)
    t_end = max(done.recs[k][1] for k in keys)
    res[f"drain{max_inflight}"].append(len(samples) / (t_end - t_go))
    await ctl.send("pause")


async def bus_bench(
    sizes: tuple[int, ...], reps: int, n_lat: dict[int, int], n_tput: dict[int, int]
) -> BusResults:
    """Per size, lists over reps: closed-loop latency p50/p99 (ms); publish msg/s (publisher
    alone, 64 in flight); drain msg/s of that backlog by the consumer at max_inflight 4 and 64."""
    run_id = f"benchbus{uuid.uuid4().hex[:8]}"
    out: BusResults = {}
    with EmbeddedNats() as server:
        bus = await Bus.connect(server.url, run_id, "rollout", "bench-publisher")
        ctl_nc = await connect(server.url, f"bench-{run_id}-publisher-ctl")
        done = Done()
        ctl = Control(ctl_nc, run_id)
        await ctl_nc.subscribe(f"bench.{run_id}.done", cb=done.on_msg)
        await ctl_nc.subscribe(f"bench.{run_id}.ack", cb=ctl.on_ack)
        await ctl_nc.flush()
        consumer = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("bus.py")), "--_consumer"]
            + [server.url, run_id],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            await asyncio.wait_for(ctl.acks.get(), 60)  # ready
            rng = np.random.default_rng(0)
            seq = 0
            for size in sizes:
                res = out.setdefault(size, defaultdict(list))
                for rep in range(reps):
                    samples = [
                        make_sample(size, f"l{size}r{rep}", seq + i, rng)
                        for i in range(n_lat[size])
                    ]
                    seq += len(samples)
                    res["bytes"] = [len(encode(samples[0]))]
                    await _latency_rep(bus, ctl, done, samples, res)
                    for mi in (CONSUMER_MAX_INFLIGHT, 64):
                        samples = [
                            make_sample(size, f"t{size}r{rep}m{mi}", seq + i, rng)
                            for i in range(n_tput[size])
                        ]
                        seq += len(samples)
                        await _throughput_rep(bus, ctl, done, samples, mi, res)
                    print(
                        f"  {size:>6} tokens rep {rep}: latency p50 {res['lat_p50_ms'][-1]:.2f} "
                        f"ms p99 {res['lat_p99_ms'][-1]:.2f} ms, publish {res['publish'][-1]:.0f} "
                        f"msg/s, drain {res[f'drain{CONSUMER_MAX_INFLIGHT}'][-1]:.0f} msg/s "
                        f"(max_inflight {CONSUMER_MAX_INFLIGHT}), {res['drain64'][-1]:.0f} msg/s (64)",
                        flush=True,
                    )
        finally:
            with contextlib.suppress(Exception):
                await ctl.send("exit")
            try:
                consumer.wait(timeout=15)
            except subprocess.TimeoutExpired:
                consumer.kill()
                consumer.wait()
            await ctl_nc.close()
            await bus.close()
    return out
