"""Part 2 of the bus benchmark: the share of a real run's wall time in bus + codec code.

`profile_run` starts `areal run examples/arithmetic.yaml` and attaches `py-spy record --threads`
(`--gil` or `--idle`) to the rollout and the trainer worker as soon as each logs that it started;
`parse_pyspy_raw` bills every sampled stack to one category with `classify`.

Invariants:
- Every stack lands in exactly one category: 'weights' | 'codec' | 'bus' | 'other'.
- In `--idle` mode py-spy samples every thread at every tick, so main-thread samples = ticks;
  in `--gil` mode every sample is GIL-held work and the wall is the profiled duration x rate.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypedDict

from _common import REPO_ROOT, percentile

from areal.bus.weights import THREAD_NAME as WEIGHTS_THREAD_NAME

ProfileMode = Literal["gil", "idle"]


class Profile(TypedDict):
    """Sample counts of one worker's py-spy profile."""

    ticks: int  # main-thread samples (= ticks in idle mode)
    empty: int  # main-thread ticks without a Python stack
    wall: int  # the denominator of "% of wall": ticks with a stack (idle), duration x rate (gil)
    nonidle: int  # samples whose leaf is not a wait (selectors, threading, queue)
    cats: dict[str, int]  # category -> samples
    hot: Counter[tuple[str, str]]  # (category, "outer > innermost" bus/codec frame) -> samples


class RunProfile(TypedDict):
    """One profiled `areal run`."""

    launcher_wall_s: float
    metrics: list[dict[str, Any]]  # the run's metrics.jsonl step records
    profiles: dict[str, Profile]  # worker id -> its profile
    weights_bytes: int  # size of final/model.safetensors (0 if absent)


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


def parse_pyspy_raw(path: Path) -> Profile:
    """Counts per category from `py-spy record --format raw --threads` output."""
    cats: Counter[str] = Counter()
    ticks = nonidle = empty = 0
    hot: Counter[tuple[str, str]] = Counter()
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
    steps: int,
    rate: int,
    keep_dir: Path | None,
    mode: ProfileMode = "gil",
    extra: Sequence[str] = (),
) -> RunProfile:
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
    res: RunProfile = {
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


def pipeline_rate(recs: list[dict[str, Any]]) -> tuple[float, float]:
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
