"""Bus benchmark: what the message bus costs, and whether it can keep up with the pipeline.

1. Publish-to-consume latency (p50/p99) and throughput of real `Sample` messages with 1k, 8k and
   32k generated tokens through a real `EmbeddedNats`, the run's real `trajectories` work-queue
   stream and the real codec: `Bus.publish` (encode + JetStream publish awaiting its ack) in this
   process, `Bus.consume` + lease ack in a separate consumer process (as the reward worker does).
   Latency = from just before `Bus.publish` (encode included) to just after the consumer's
   handler got the decoded `Sample` and acked it (both ends read CLOCK_MONOTONIC). Latency is
   measured closed-loop (one message in flight); throughput open-loop (up to 64 publishes in
   flight, like the rollout's publish-per-finished-sample, consumer `max_inflight` as the reward
   worker's default, 4).
2. The share of a real run's wall time spent in bus + codec code: `areal run
   examples/arithmetic.yaml --set train.total_steps=30`, with `py-spy record --idle --threads`
   attached to the rollout and the trainer worker as soon as each logs that it started.
   Samples whose stack has a frame in `areal/bus/`, `nats/`, `msgpack`, `schemas/` or pydantic
   count as bus + codec; share of wall = those samples / main-thread samples (py-spy --idle
   samples every thread at every tick, so main-thread samples = ticks).
3. The pipeline's need: samples/s of the run (metrics.jsonl: samples / wall_s), against the
   bus throughput of 1k-token samples (the run's samples are ~3 tokens, so this is conservative).

    python bench/bus.py [--quick]

No timing assertions: it prints a machine header, the command and markdown tables, and writes
`bench/results/bus.md` and `bench/results/bus.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench/_common.py, the repo

from _common import (  # noqa: E402
    REPO_ROOT,
    RESULTS_DIR,
    machine_header,
    md_table,
    median,
    percentile,
    write_result,
)

from areal.bus.client import Bus  # noqa: E402
from areal.bus.codec import decode, encode, pack  # noqa: E402
from areal.bus.embedded import EmbeddedNats  # noqa: E402
from areal.bus.weights import THREAD_NAME as WEIGHTS_THREAD_NAME  # noqa: E402
from schemas import Sample  # noqa: E402
from schemas import subjects as S  # noqa: E402

SIZES = (1024, 8192, 32768)
CONSUMER_MAX_INFLIGHT = 4  # RewardService: max_inflight = 4 * pool_workers (default 1)
PUBLISH_CONCURRENCY = 64
PROMPT_TOKENS = 64
_REC = struct.Struct("<qdd")  # seq, t0 (before publish), t1 (consumer decoded + acked)


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
    records: list[bytes] = []
    ctl: asyncio.Queue[bytes] = asyncio.Queue()

    async def handler(sample: Sample, lease) -> None:
        await lease.ack()
        t1 = time.perf_counter()
        records.append(_REC.pack(int(sample.timings["seq"]), sample.timings["bench_t0"], t1))

    async def flusher() -> None:
        while True:
            await asyncio.sleep(0.002)
            if records:
                blob = b"".join(records)
                records.clear()
                await bus.nc.publish(f"bench.{run_id}.done", blob)

    async def on_ctl(msg) -> None:
        await ctl.put(msg.data)

    await bus.nc.subscribe(f"bench.{run_id}.ctl", cb=on_ctl)
    flush = asyncio.create_task(flusher())
    await bus.nc.publish(f"bench.{run_id}.ack", b"ready")
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
        await bus.nc.publish(f"bench.{run_id}.ack", cmd[0].encode())
    flush.cancel()
    await bus.nc.flush()
    await bus.close()


# ------------------------------------------------------------------------------- publisher
class Done:
    """Collects the consumer's (seq, t0, t1) reports."""

    def __init__(self) -> None:
        self.recs: dict[int, tuple[float, float]] = {}
        self.changed = asyncio.Event()

    async def on_msg(self, msg) -> None:
        for seq, t0, t1 in _REC.iter_unpack(msg.data):
            self.recs[seq] = (t0, t1)
        self.changed.set()

    async def wait_for(self, pred, timeout_s: float = 60.0) -> None:
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
    """Commands to the consumer process, each answered on the ack subject."""

    def __init__(self, bus: Bus, run_id: str) -> None:
        self.bus, self.run_id = bus, run_id
        self.acks: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_ack(self, msg) -> None:
        await self.acks.put(msg.data)

    async def send(self, cmd: str) -> None:
        await self.bus.nc.publish(f"bench.{self.run_id}.ctl", cmd.encode())
        if cmd != "exit":
            await asyncio.wait_for(self.acks.get(), 30)
        else:
            await self.bus.nc.flush()


async def bus_bench(sizes, reps: int, n_lat: dict, n_tput: dict) -> dict:
    """Per size, lists over reps: closed-loop latency p50/p99 (ms); publish msg/s (publisher
    alone, 64 in flight); drain msg/s of that backlog by the consumer at max_inflight 4 and 64."""
    run_id = f"benchbus{uuid.uuid4().hex[:8]}"
    out: dict[int, dict] = {}
    with EmbeddedNats() as server:
        bus = await Bus.connect(server.url, run_id, "rollout", "bench-publisher")
        done = Done()
        ctl = Control(bus, run_id)
        await bus.nc.subscribe(f"bench.{run_id}.done", cb=done.on_msg)
        await bus.nc.subscribe(f"bench.{run_id}.ack", cb=ctl.on_ack)
        await bus.nc.flush()
        consumer = subprocess.Popen(
            [sys.executable, __file__, "--_consumer", server.url, run_id],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            await asyncio.wait_for(ctl.acks.get(), 60)  # ready
            rng = np.random.default_rng(0)
            seq = 0
            for size in sizes:
                res = out.setdefault(size, defaultdict(list))
                for rep in range(reps):
                    # closed loop: one message in flight -> unloaded end-to-end latency
                    samples = [
                        make_sample(size, f"l{size}r{rep}", seq + i, rng)
                        for i in range(n_lat[size])
                    ]
                    seq += len(samples)
                    res["bytes"] = [len(encode(samples[0]))]
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
                    # publish throughput (consumer paused), then drain rate of that backlog
                    for mi in (CONSUMER_MAX_INFLIGHT, 64):
                        samples = [
                            make_sample(size, f"t{size}r{rep}m{mi}", seq + i, rng)
                            for i in range(n_tput[size])
                        ]
                        keys = [int(s.timings["seq"]) for s in samples]
                        seq += len(samples)
                        sem = asyncio.Semaphore(PUBLISH_CONCURRENCY)

                        async def guarded(s: Sample, sem=sem) -> None:
                            async with sem:
                                await publish_one(bus, s)

                        t_start = time.perf_counter()
                        await asyncio.gather(*(guarded(s) for s in samples))
                        res["publish"].append(len(samples) / (time.perf_counter() - t_start))
                        t_go = time.perf_counter()
                        await ctl.send(f"go {mi}")
                        left = set(keys)

                        def drained(left=left) -> bool:
                            left.difference_update([k for k in list(left) if k in done.recs])
                            return not left

                        await done.wait_for(drained, 300)
                        t_end = max(done.recs[k][1] for k in keys)
                        res[f"drain{mi}"].append(len(samples) / (t_end - t_go))
                        await ctl.send("pause")
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
            await bus.close()
    return out


# ------------------------------------------------------------------------------- profile
CODEC_MARKERS = ("/areal/bus/codec.py", "/msgpack/", "/schemas/", "/pydantic/", "/pydantic_core/")
BUS_MARKERS = ("/areal/bus/", "/nats/")
IDLE_LEAVES = (
    "/selectors.py",
    "/threading.py",
    "/concurrent/futures/thread.py",
    "/queue.py",
)


def _file(frame: str) -> str:
    # "func (/path/to/file.py:123)"
    i = frame.rfind(" (")
    return frame[i + 2 : frame.rfind(":")] if i >= 0 else ""


APP_MARKERS = ("/areal/", "/workers/")  # project code outside the bus (checked after bus/codec)


def _owner(file: str) -> str | None:
    if any(m in file for m in CODEC_MARKERS):
        return "codec"
    if any(m in file for m in BUS_MARKERS):
        return "bus"
    if any(m in file for m in APP_MARKERS):
        return "other"
    return None  # stdlib / third-party: billed to whoever called it


WEIGHTS_THREAD = f": {WEIGHTS_THREAD_NAME}"  # py-spy's thread label ends with its name
# `_write_atomic` writes a file-transport weights file in a worker thread (no `put_weights` frame)
WEIGHTS_FUNCS = ("get_weights", "put_weights", "_write_atomic")


def classify(frames: list[str], thread: str = "") -> str:
    """'weights' | 'codec' | 'bus' | 'other' for one py-spy stack (outermost first).

    Weights transfer is any stack of the object-store weights thread (`areal.bus.weights`), or
    through `get_weights`/`put_weights` (or the file write of the latter, in its worker thread)
    or the object store.
    Otherwise the innermost frame that is codec, bus or project code decides: a handler's own
    code (e.g. the trainer filing a sample into its group) runs *under* `Bus.consume` but is
    application work, while asyncio or socket frames under a bus call are bus work."""
    files = [_file(f) for f in frames]
    if thread.endswith(WEIGHTS_THREAD):  # the object-store weights connection's own thread
        return "weights"
    if any(
        f.endswith("/areal/bus/client.py") and fr.startswith(WEIGHTS_FUNCS)
        for f, fr in zip(files, frames, strict=True)
    ) or any("/nats/js/object_store.py" in f for f in files):
        return "weights"
    for f in reversed(files):
        owner = _owner(f)
        if owner is not None:
            return owner
    return "other"


def parse_pyspy_raw(path: Path) -> dict:
    """Counts per category from `py-spy record --format raw --threads --idle` output."""
    cats: Counter = Counter()
    ticks = nonidle = empty = 0
    hot: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        parts = stack.split(";")
        thread, frames = parts[0], parts[1:]
        if thread.endswith("MainThread"):
            ticks += n
            empty += n if not frames else 0
        leaf = _file(frames[-1]) if frames else ""
        idle = not frames or any(leaf.endswith(x) for x in IDLE_LEAVES)
        if not idle:
            nonidle += n
        c = classify(frames, thread)
        cats[c] += n
        if c != "other":
            # innermost frame inside bus/codec code: where the time goes
            inner = [f for f in frames if any(m in _file(f) for m in BUS_MARKERS + CODEC_MARKERS)]
            inner = inner or [f"{thread.rpartition(': ')[2]} thread"]  # e.g. its asyncio frames
            outer, innermost = inner[0].split(" (")[0], inner[-1].split(" (")[0]
            hot[(c, outer if outer == innermost else f"{outer} > {innermost}")] += n
    # py-spy finds no Python frame on the main thread for some ticks (~15-20% here, also in
    # blocking mode); shares use the ticks with a stack as the wall (conservative: higher share).
    return {
        "ticks": ticks,
        "empty": empty,
        "wall": max(1, ticks - empty),
        "nonidle": nonidle,
        "cats": dict(cats),
        "hot": hot,
    }


def find_worker_pid(worker_id: str, cfg_path: Path) -> int | None:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if worker_id in args and str(cfg_path) in args and any("workers." in a for a in args):
            return int(d.name)
    return None


def profile_run(
    steps: int, rate: int, keep_dir: Path | None, mode: str = "gil", extra: list[str] = ()
) -> dict:
    """One `areal run` with py-spy on the rollout and trainer workers.

    mode "gil": sample only threads holding the GIL, so a stack is counted only while that
    code really runs (the wall is the profiled duration x rate); mode "idle": sample every
    thread always, so time a thread spends *waiting for the GIL* inside bus code (held by the
    generating / training thread) is counted as bus time too (an upper bound)."""
    tmp = Path(tempfile.mkdtemp(prefix="areal-bench-bus-"))
    out = tmp / "run"
    prof_dir = tmp / "profiles"
    prof_dir.mkdir()
    areal = Path(sys.executable).parent / "areal"
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    cmd = [
        str(areal),
        "run",
        "examples/arithmetic.yaml",
        "--out",
        str(out),
        "--quiet",
        "--set",
        f"train.total_steps={steps}",
        *[a for kv in extra for a in ("--set", kv)],
    ]
    markers = {"rollout-0": "rollout_started", "trainer-0": "trainer_started"}
    spies: dict[str, subprocess.Popen] = {}
    spy_t0: dict[str, float] = {}
    spy_dur: dict[str, float] = {}
    t0 = time.monotonic()
    with open(tmp / "launcher.log", "wb") as logf:
        launcher = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        while launcher.poll() is None and len(spies) < len(markers):
            for wid, marker in markers.items():
                logp = out / "logs" / f"{wid}.log"
                if (
                    wid in spies
                    or not logp.exists()
                    or marker not in logp.read_text(errors="replace")
                ):
                    continue
                pid = find_worker_pid(wid, out / "config.json")
                if pid is None:
                    continue
                spies[wid] = subprocess.Popen(
                    [
                        pyspy,
                        "record",
                        "--pid",
                        str(pid),
                        "--gil" if mode == "gil" else "--idle",
                        "--threads",
                        "--full-filenames",
                        "--rate",
                        str(rate),
                        "--format",
                        "raw",
                        "-o",
                        str(prof_dir / f"{wid}.txt"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                spy_t0[wid] = time.monotonic()
            time.sleep(0.05)
        deadline = time.monotonic() + 600
        while launcher.poll() is None or any(
            w not in spy_dur and p.poll() is None for w, p in spies.items()
        ):
            for w, p in spies.items():  # a spy exits with its worker: that ends the profile
                if w not in spy_dur and p.poll() is not None:
                    spy_dur[w] = time.monotonic() - spy_t0[w]
            if time.monotonic() > deadline:
                launcher.kill()
                break
            time.sleep(0.02)
        for w in spies:
            spy_dur.setdefault(w, time.monotonic() - spy_t0[w])
        rc = launcher.wait(timeout=60)
    for p in spies.values():
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.terminate()
            p.wait()
    wall = time.monotonic() - t0
    if rc != 0:
        raise RuntimeError(f"areal run failed ({rc}); see {tmp}/launcher.log and {out}/logs")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    weights = out / "final" / "model.safetensors"
    res: dict = {
        "launcher_wall_s": wall,
        "metrics": recs,
        "profiles": {},
        "weights_bytes": weights.stat().st_size if weights.exists() else 0,
    }
    for wid in markers:
        f = prof_dir / f"{wid}.txt"
        if f.exists():
            prof = parse_pyspy_raw(f)
            if mode == "gil":  # every sample is GIL-held work; the wall is duration x rate
                prof["nonidle"] = sum(prof["cats"].values())
                prof["empty"] = 0
                prof["ticks"] = prof["wall"] = max(1, int(spy_dur.get(wid, 0) * rate))
            res["profiles"][wid] = prof
    if keep_dir is not None:
        shutil.copytree(prof_dir, keep_dir, dirs_exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return res


def flusher_note(extra: list[str], weights_bytes: int, versions: int) -> str:
    """What the trainer's nats-py flusher writes, for the profile section."""
    note = (
        "The nats-py flusher (`Client._flusher > TcpTransport.writelines`) writes every outgoing "
        "byte of a connection, so its time is counted as bus msg"
    )
    if "weights.transport=file" in extra:
        return note + " (weights go to files here, so its bytes are acks, pulls and metrics).\n"
    return note + (
        f"; in the trainer those bytes are mostly weights: {weights_bytes / 2**20:.1f} MiB of "
        f"safetensors per version x {versions} versions ({weights_bytes * versions / 2**20:.0f} "
        "MiB) against ~100 B per ack / heartbeat.\n"
    )


def pipeline_rate(recs: list[dict]) -> tuple[float, float]:
    """(mean samples/s over the run, p90 of per-step samples/s)."""
    total = sum(r["samples"] for r in recs)
    mean = total / recs[-1]["wall_s"]
    per_step, prev = [], 0.0
    for r in recs:
        dt = r["wall_s"] - prev
        prev = r["wall_s"]
        if dt > 0:
            per_step.append(r["samples"] / dt)
    return mean, percentile(per_step, 90)


# ------------------------------------------------------------------------------- report
def plot(path: Path, sizes, bus_res, need: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    p50 = [median(bus_res[s]["lat_p50_ms"]) for s in sizes]
    p99 = [median(bus_res[s]["lat_p99_ms"]) for s in sizes]
    a1.plot(sizes, p50, "o-", label="p50")
    a1.plot(sizes, p99, "s--", label="p99")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("generated tokens per Sample")
    a1.set_ylabel("publish -> consumed + acked (ms)")
    a1.set_title("Bus latency (closed loop, median of reps)")
    a1.grid(True, alpha=0.3)
    a1.legend()
    mi = CONSUMER_MAX_INFLIGHT
    for key, label, style in (
        ("publish", "publish (64 in flight)", "o-"),
        (f"drain{mi}", f"consume, max_inflight {mi} (reward default)", "s-"),
        ("drain64", "consume, max_inflight 64", "^--"),
    ):
        a2.plot(sizes, [median(bus_res[s][key]) for s in sizes], style, label=label)
    if need:
        a2.axhline(need, color="r", ls=":", label=f"arithmetic run needs {need:.0f}/s")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("generated tokens per Sample")
    a2.set_ylabel("Samples / s")
    a2.set_title("Bus throughput (median of reps)")
    a2.grid(True, alpha=0.3, which="both")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages, one profiled run")
    ap.add_argument("--reps", type=int, default=None, help="repeats of the bus measurements")
    ap.add_argument("--runs", type=int, default=None, help="profiled `areal run`s")
    ap.add_argument("--steps", type=int, default=30, help="train.total_steps of profiled runs")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument(
        "--profile-mode",
        choices=("gil", "idle"),
        default="gil",
        help="gil: count code only while it holds the GIL (default); idle: count every thread "
        "always, including waits for the GIL inside bus code (an upper bound)",
    )
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled runs")
    ap.add_argument("--keep-profiles", type=Path, default=None, help="copy raw py-spy output here")
    ap.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        help="extra override for the profiled runs, e.g. model.preset=small",
    )
    ap.add_argument("--tag", default="", help="suffix of the output files, e.g. _small")
    ap.add_argument("--_consumer", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._consumer:
        asyncio.run(consumer_main(*args._consumer))
        return 0

    import torch

    torch.set_num_threads(1)
    reps = args.reps or (1 if args.quick else 3)
    runs = args.runs or (1 if args.quick else 3)
    n_lat = {1024: 1000, 8192: 600, 32768: 300}
    n_tput = {1024: 1500, 8192: 600, 32768: 200}
    if args.quick:
        n_lat = {k: v // 5 for k, v in n_lat.items()}
        n_tput = {k: v // 5 for k, v in n_tput.items()}

    header = machine_header(
        {
            "bus": f"nats-server (EmbeddedNats, file storage), nats-py, consumer in its own process "
            f"with max_inflight {CONSUMER_MAX_INFLIGHT}, publisher {PUBLISH_CONCURRENCY} in flight",
            "repeats": f"{reps} per size (table: median of reps; best throughput in brackets)",
        }
    )
    print("# Bus benchmark\n")
    print(header + "\n", flush=True)

    print("codec micro-benchmark (in process) ...", flush=True)
    codec = {s: codec_cost_us(s, 400 if s <= 1024 else 100 if s <= 8192 else 30) for s in SIZES}
    print("bus round trips ...", flush=True)
    bus_res = asyncio.run(bus_bench(SIZES, reps, n_lat, n_tput))

    rows = []
    for s in SIZES:
        r = bus_res[s]
        nbytes = r["bytes"][0]
        mi = CONSUMER_MAX_INFLIGHT
        pub, d4, d64 = (median(r[k]) for k in ("publish", f"drain{mi}", "drain64"))
        e2e = min(pub, d4)
        rows.append(
            [
                s,
                f"{nbytes / 1024:.0f}",
                f"{codec[s][0]:.0f} / {codec[s][1]:.0f}",
                f"{median(r['lat_p50_ms']):.2f}",
                f"{median(r['lat_p99_ms']):.2f}",
                f"{pub:.0f} ({max(r['publish']):.0f})",
                f"{d4:.0f} ({max(r[f'drain{mi}']):.0f})",
                f"{d64:.0f} ({max(r['drain64']):.0f})",
                f"{e2e * nbytes / 2**20:.0f} / {min(pub, d64) * nbytes / 2**20:.0f}",
                f"{e2e * s / 1e6:.2f} / {min(pub, d64) * s / 1e6:.2f}",
            ]
        )
    bus_table = md_table(
        [
            "gen tokens",
            "msg KiB",
            "encode / decode µs",
            "latency p50 ms",
            "latency p99 ms",
            "publish msg/s",
            f"consume msg/s, max_inflight {CONSUMER_MAX_INFLIGHT}",
            "consume msg/s, max_inflight 64",
            f"end-to-end MiB/s (inflight {CONSUMER_MAX_INFLIGHT} / 64)",
            f"end-to-end M tokens/s (inflight {CONSUMER_MAX_INFLIGHT} / 64)",
        ],
        rows,
    )
    print("\n## Sample messages through the trajectories stream\n")
    print(bus_table + "\n", flush=True)

    prof_section = ""
    need = None
    if not args.no_profile and not (
        shutil.which("py-spy") or (Path(sys.executable).parent / "py-spy").exists()
    ):
        print("py-spy not found (`pip install py-spy`): skipping the profiled runs", flush=True)
        args.no_profile = True
    if not args.no_profile:
        print(f"profiling {runs} x `areal run` ({args.steps} steps) ...", flush=True)
        results = []
        for i in range(runs):
            keep = args.keep_profiles / f"run{i}" if args.keep_profiles else None
            res = profile_run(args.steps, args.rate, keep, args.profile_mode, args.extra)
            results.append(res)
            mean_rate, _ = pipeline_rate(res["metrics"])
            print(
                f"  run {i}: {res['launcher_wall_s']:.1f}s, {mean_rate:.0f} samples/s, "
                + ", ".join(
                    f"{w}: {sum(v for k, v in p['cats'].items() if k != 'other') / p['wall']:.2%}"
                    for w, p in res["profiles"].items()
                ),
                flush=True,
            )
        prof_rows = []
        hot_all: dict[str, Counter] = defaultdict(Counter)
        for wid in ("rollout-0", "trainer-0"):
            profs = [r["profiles"][wid] for r in results if wid in r["profiles"]]
            if not profs:
                continue

            def share(p, cats, denom="wall"):
                return sum(p["cats"].get(c, 0) for c in cats) / max(1, p[denom])

            for p in profs:
                hot_all[wid].update(p["hot"])
            prof_rows.append(
                [
                    wid,
                    f"{median([p['ticks'] / args.rate for p in profs]):.1f}",
                    f"{median([p['empty'] / max(1, p['ticks']) for p in profs]):.0%}",
                    f"{median([p['nonidle'] / p['wall'] for p in profs]):.0%}",
                    f"{median([share(p, ['codec']) for p in profs]):.2%}",
                    f"{median([share(p, ['bus']) for p in profs]):.2%}",
                    f"{median([share(p, ['codec', 'bus']) for p in profs]):.2%}",
                    f"{median([share(p, ['weights']) for p in profs]):.2%}",
                    f"{median([share(p, ['codec', 'bus', 'weights'], 'nonidle') for p in profs]):.2%}",
                ]
            )
        prof_table = md_table(
            [
                "worker",
                "profiled wall s",
                "ticks without a stack",
                "busy (non-idle samples / wall)",
                "codec % of wall",
                "bus msg % of wall",
                "**bus + codec % of wall**",
                "weights I/O % of wall",
                "all bus code % of busy samples",
            ],
            prof_rows,
        )
        rates = [pipeline_rate(r["metrics"]) for r in results]
        need = median([m for m, _ in rates])
        peak = median([p for _, p in rates])
        r1k = bus_res[1024]
        bus_1k = min(median(r1k["publish"]), median(r1k[f"drain{CONSUMER_MAX_INFLIGHT}"]))
        bus_1k_64 = min(median(r1k["publish"]), median(r1k["drain64"]))
        gen_len = median(
            [
                sum(x["tokens"] for x in r["metrics"]) / sum(x["samples"] for x in r["metrics"])
                for r in results
            ]
        )
        need_table = md_table(
            [
                "profiled run: samples/s (mean)",
                "p90 per-step samples/s",
                "bus msg/s, 1k-token Samples",
                "**ratio (bus / mean need)**",
                "ratio vs p90 step",
            ],
            [
                [
                    f"{need:.0f}",
                    f"{peak:.0f}",
                    f"{bus_1k:.0f} (consumer max_inflight {CONSUMER_MAX_INFLIGHT})",
                    f"**{bus_1k / need:.1f}x**",
                    f"{bus_1k / peak:.1f}x",
                ],
                [
                    f"{need:.0f}",
                    f"{peak:.0f}",
                    f"{bus_1k_64:.0f} (consumer max_inflight 64)",
                    f"**{bus_1k_64 / need:.1f}x**",
                    f"{bus_1k_64 / peak:.1f}x",
                ],
            ],
        )
        hot_lines = []
        for wid, hot in hot_all.items():
            tot = sum(p["wall"] for r in results for w, p in r["profiles"].items() if w == wid)
            top = ", ".join(
                f"{name} [{cat}] {n / max(1, tot):.2%}" for (cat, name), n in hot.most_common(6)
            )
            hot_lines.append(f"- {wid}: {top}")
        prof_section = (
            f"\n## Share of a real run's wall time in bus + codec code\n\n"
            f"`areal run examples/arithmetic.yaml --out <tmp> --quiet --set "
            f"train.total_steps={args.steps}"
            + "".join(f" --set '{kv}'" for kv in args.extra)
            + f"`, {runs} run(s), py-spy {args.rate} Hz "
            f"(`--{args.profile_mode} --threads`; gil: a stack counts only while it holds the GIL, "
            f"so waits for the GIL held by the generate/train thread are not billed to the bus; "
            f"idle: every thread always, an upper bound) attached to each worker from its "
            f"`*_started` log line to its exit; median over runs. codec = stacks in "
            f"`areal/bus/codec.py`, msgpack, `schemas/`, pydantic (incl. building `Sample`s); bus "
            f"msg = other `areal/bus/` + `nats/` stacks (publish, pull, ack, heartbeats, KV); "
            f"weights I/O = `Bus.get_weights`/`put_weights` incl. the object-store weights "
            f"connection's thread, the file write and sha256 "
            f"(bus code too, but bulk transfer, reported apart).\n\n{prof_table}\n\n"
            f"Top bus/codec stacks, outermost > innermost bus/codec frame (share of that worker's wall, "
            f"all runs):\n\n"
            + "\n".join(hot_lines)
            + "\n\n"
            + flusher_note(args.extra, results[0]["weights_bytes"], args.steps + 1)
            + "\n## Bus throughput vs what the pipeline needs\n\n"
            f"Samples/s of the same runs from `metrics.jsonl` (sum of samples / final wall_s; "
            f"mean generated length {gen_len:.1f} tokens). Each sample crosses the bus twice "
            f"(trajectories, rewards), plus one prompt per {8} samples.\n\n{need_table}\n"
        )
        print(prof_section, flush=True)

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    png = f"bus{args.tag}.png"
    plot(RESULTS_DIR / png, SIZES, bus_res, need)
    md = (
        "# Bus benchmark\n\n"
        + header
        + "\n\n## Sample messages through the trajectories stream\n\n"
        + "Latency: closed loop (one message in flight), from before `Bus.publish` (encode "
        "included) to after the consumer's handler has the decoded `Sample` and acked it "
        f"(consumer `max_inflight` {CONSUMER_MAX_INFLIGHT}). Publish: `Bus.publish` alone "
        f"(consumer paused), {PUBLISH_CONCURRENCY} in flight, each awaiting its JetStream ack. "
        "Consume: a separate process drains that backlog with `Bus.consume` (decode + ack), "
        f"`max_inflight` {CONSUMER_MAX_INFLIGHT} (the reward worker's default, "
        "4 x pool_workers) and 64. End-to-end = min(publish, consume). encode/decode: "
        "in-process codec cost per message.\n\n"
        + bus_table
        + "\n"
        + prof_section
        + f"\n![latency and throughput vs size]({png})\n"
    )
    path = write_result(f"bus{args.tag}.md", md)
    print(f"wrote {path} and {RESULTS_DIR / png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
