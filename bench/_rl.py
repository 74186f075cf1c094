"""Drive whole `areal run` jobs for the RL benchmarks (staleness ablation, async vs sync).

One private nats-server (`EmbeddedNats`) serves every run of a benchmark; each run gets its own
`run_id` (its own streams), so after a run ends its `metrics` stream still holds the workers'
heartbeats, which `read_heartbeats` replays (rollout `busy_frac`, generated tokens).

CPU pinning: `pin_roles` gives the `cpu_affinity` overrides that put each process of a run on
its cores (the launcher pins each child between fork and exec); `run_areal` reads back where
each worker ran from its `worker_prepared` log line. The benchmark's own nats-server, shared by
its runs, is pinned with `pin_pid`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _common import REPO_ROOT

# The long-generation workload of bench/async_vs_sync.py and `bench/vs_trl.py --workload long`,
# as overrides of examples/arithmetic.yaml (B=16, G=8, T=1.5, lr 3e-4, 2 minibatches). The
# `small` preset (Qwen2, 4 layers of width 256, ~3.2M params) on running sums with a long tail
# of lengths: up to 12 terms, P(k) ~ 1/k, so most answers take a few tokens and a few take 30+,
# up to 96 at T=1.5. Its warm start (300 supervised steps, cached) is label-smoothed like the
# quickstart's: on 512 held-out tasks it samples 0.143 right at T=1.5 but decodes 0.449 right
# greedily (`warm_line`), so RL has something to sharpen within a few dozen steps. (The setting
# until 2026-12, unsmoothed, T=1.0, up to 24 terms, learned in no mode within 40 steps.)
LONG_WORKLOAD = (
    "model.preset=small",
    "model.warm_start_label_smoothing=0.1",
    "data.source=synthetic:running_sum",
    "data.task_kwargs={max_terms: 12, tail: 1.0}",
    "rollout.max_new_tokens=96",
)


def pin_roles(
    rollout: set[int],
    trainer: set[int],
    others: set[int] | None = None,
    moved: dict[str, set[int]] | None = None,
) -> list[str]:
    """The `cpu_affinity` override that puts the rollout workers on `rollout`, the trainer on
    `trainer`, and the controller, reward workers, launcher and (embedded) nats-server on
    `others` (None: where the OS puts them), except the roles `moved` names (e.g. {"reward":
    {0}})."""
    from areal.proc import format_cpu_list

    roles = {"rollout": rollout, "trainer": trainer, **(moved or {}), "other": others}
    spec = ", ".join(f"{k}: '{format_cpu_list(v)}'" for k, v in roles.items() if v)
    return [f"cpu_affinity={{{spec}}}"]


def pin_pid(pid: int, cores: set[int]) -> None:
    """Every thread of one process (e.g. the nats-server) onto `cores`."""
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cores)


def worker_cpus(out_dir: Path) -> dict[str, str]:
    """Worker id -> the cores it reported at start (`worker_prepared` cpus=, last start)."""
    found: dict[str, str] = {}
    for log in sorted((out_dir / "logs").glob("*.log")):
        with contextlib.suppress(OSError):
            for m in _PREPARED_CPUS.finditer(log.read_text(errors="replace")):
                found[log.stem] = m[1]
    return found


_PREPARED_CPUS = re.compile(r"worker_prepared\b.*?\bcpus=([\d,-]+)")


@dataclass
class RunResult:
    name: str
    out_dir: Path
    cmd: list[str]
    rc: int
    process_wall_s: float
    records: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    heartbeats: dict[str, dict] = field(default_factory=dict)  # worker id -> last values
    pinned: dict[str, str] = field(default_factory=dict)  # worker id -> cores it ran on
    load_before: float = 0.0
    load_after: float = 0.0
    eval_reward: float | None = None  # final policy on held-out tasks (`eval_final`)
    code: str = ""  # `code_state()` when the run started (others commit while benches run)

    @property
    def ok(self) -> bool:
        return self.rc == 0 and bool(self.records)

    @property
    def wall_s(self) -> float:
        """Trainer wall time from its start to the last step (excludes process start-up)."""
        return float(self.records[-1]["wall_s"]) if self.records else float("nan")

    @property
    def samples(self) -> int:
        return sum(int(r["samples"]) for r in self.records)

    @property
    def tokens(self) -> int:
        return sum(int(r["tokens"]) for r in self.records)

    def rewards(self) -> list[float]:
        return [float(r["reward_mean"]) for r in self.records]

    def mean_of(self, key: str, default: float = 0.0) -> float:
        xs = [float(r[key]) for r in self.records if key in r]
        return sum(xs) / len(xs) if xs else default

    def last(self, key: str, default: float = float("nan")) -> float:
        return float(self.records[-1].get(key, default)) if self.records else default

    def rollout_busy_frac(self) -> float:
        fr = [hb["busy_frac"] for w, hb in self.heartbeats.items() if w.startswith("rollout-")]
        return sum(fr) / len(fr) if fr else float("nan")

    def rollout_tokens(self) -> int:
        return sum(
            int(hb.get("tokens", 0))
            for w, hb in self.heartbeats.items()
            if w.startswith("rollout-")
        )


def areal_cmd(
    config: str | Path, out_dir: Path, nats_url: str, run_id: str, overrides: list[str]
) -> list[str]:
    cmd = [sys.executable, "-m", "areal.cli", "run", str(config), "--out", str(out_dir)]
    cmd += ["--quiet", "--nats-url", nats_url, "--set", f"run_id={run_id}"]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def show_cmd(cmd: list[str]) -> str:
    """The command as a user would type it (`areal run ...`, URL and paths kept)."""
    shown = ["areal", *cmd[3:]] if cmd[1:3] == ["-m", "areal.cli"] else cmd
    return " ".join(shlex.quote(c) for c in shown)


def run_areal(
    name: str,
    config: str | Path,
    out_dir: Path,
    nats_url: str,
    run_id: str,
    overrides: list[str],
    timeout_s: float = 1800.0,
) -> RunResult:
    cmd = areal_cmd(config, out_dir, nats_url, run_id, overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    code = code_state()
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    launcher_log = out_dir.with_name(out_dir.name + ".launcher.log")  # beside: --out stays empty
    with open(launcher_log, "wb") as logf:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the launcher signals its own workers
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    res = RunResult(name, out_dir, cmd, rc, time.perf_counter() - t0)
    res.load_before, res.load_after = load_before, os.getloadavg()[0]
    res.code = code
    if any(o.startswith("cpu_affinity") for o in overrides):
        res.pinned = worker_cpus(out_dir)
    metrics = out_dir / "metrics.jsonl"
    if metrics.exists():
        res.records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    with contextlib.suppress(OSError, ValueError):
        res.summary = json.loads((out_dir / "summary.json").read_text())
    # A run that failed before declaring its streams has no heartbeats to replay.
    res.heartbeats = read_heartbeats(nats_url, run_id) if res.records else {}
    if rc != 0:
        tail = launcher_log.read_text(errors="replace")[-1500:]
        print(f"  !! {name}: areal run exited {rc}; launcher log tail:\n{tail}", file=sys.stderr)
    return res


def read_heartbeats(nats_url: str, run_id: str, idle_s: float = 1.5) -> dict[str, dict]:
    """The last heartbeat of every worker of a (finished) run, replayed from `metrics`."""
    return asyncio.run(_read_heartbeats(nats_url, run_id, idle_s))


async def _read_heartbeats(nats_url: str, run_id: str, idle_s: float) -> dict[str, dict]:
    from areal.bus.codec import decode
    from areal.bus.tap import TapClient
    from schemas import MetricRecord

    last: dict[str, dict] = {}
    seen = time.monotonic()

    async def on_msg(tm) -> None:
        nonlocal seen
        seen = time.monotonic()
        with contextlib.suppress(Exception):
            rec = decode(tm.data, MetricRecord)
            last[rec.worker_id] = {**rec.values, "_time": rec.time}

    _quiet_structlog()
    try:
        client = await TapClient.connect(nats_url, run_id, name="bench")
    except Exception as e:  # a bench should still print its table without heartbeats
        print(f"  (heartbeats unavailable: {e})", file=sys.stderr)
        return {}
    try:
        for role in ("rollout", "trainer"):
            await client.follow(f"metrics.{role}.heartbeat", on_msg, history=-1)
        while time.monotonic() - seen < idle_s:
            await asyncio.sleep(0.1)
    finally:
        await client.close()
    return last


@contextlib.contextmanager
def runs_dir(keep: Path | None, prefix: str):
    """Where the runs' dirs (checkpoints, logs, nats store) go: `keep`, or a temp dir."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield str(keep)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield tmp


def eval_final(
    res: RunResult, config: str | Path, overrides: list[str], n: int = 512
) -> float | None:
    """Mean reward of the run's final policy (`<out>/final`) on `n` fixed held-out tasks,
    sampled at the run's temperature: the same items for every mode, unlike the per-step
    reward whose task mix depends on which groups finished first."""
    final = res.out_dir / "final"
    return eval_model(final, config, overrides, n) if final.is_dir() else None


def eval_model(
    model_dir: str | Path, config: str | Path, overrides: list[str], n: int = 512
) -> float:
    """`eval_final` for any model dir (e.g. the warm start, i.e. step 0)."""
    import torch

    from areal.config import load_settings
    from areal.data.evaluate import evaluate_accuracy
    from areal.data.sources import make_source

    s = load_settings(config, overrides)
    source = make_source(s.data.source, s.data, s.seed, shuffle=False)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the workers: one intra-op thread on a shared box
    try:
        return evaluate_accuracy(
            model_dir, source, n, s.rollout.temperature, seed=s.seed, max_new_tokens=None
        )
    finally:
        torch.set_num_threads(threads)


def warm_line(model_dir: str | Path, config: str | Path, overrides: list[str]) -> str:
    """The report line of the warm start (step 0): its eval at the rollout temperature, and
    decoding greedily (how much a sharper policy could get right: what RL has to work with)."""
    hot = eval_model(model_dir, config, overrides)
    greedy = eval_model(model_dir, config, [*overrides, "rollout.temperature=0"])
    return f"- warm-start model (step 0): {model_dir}, eval {hot:.3f} (greedy: {greedy:.3f})"


def code_state() -> str:
    """HEAD and the files that differ from it (others edit the tree while benches run)."""
    with contextlib.suppress(Exception):
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--short", "--untracked-files=no", "areal", "workers", "schemas"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
        ).stdout.split("\n")
        changed = [x.split()[-1] for x in dirty if x.strip()]
        return f"git {head}" + (f", modified: {', '.join(changed)}" if changed else ", clean")
    return "unknown"


def code_note(results: list[RunResult]) -> str:
    """One line: the code every run started from, or which run saw which state."""
    states = {r.code for r in results}
    if len(states) <= 1:
        return f"- code for every run: {states.pop() if states else '?'}"
    return "- code changed during the bench: " + "; ".join(f"{r.name}: {r.code}" for r in results)


def _quiet_structlog() -> None:
    """The bench's own tap connection logs a warning when it closes; keep the output clean."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))


def rolling(xs: list[float], k: int) -> list[float]:
    out, s = [], 0.0
    for i, x in enumerate(xs):
        s += x - (xs[i - k] if i >= k else 0.0)
        out.append(s / min(i + 1, k))
    return out


def time_to_target(res: RunResult, target: float, k: int = 10) -> float | None:
    """Trainer wall time at the first step whose rolling (k steps) mean reward >= target."""
    for r, m in zip(res.records, rolling(res.rewards(), k), strict=True):
        if m >= target and r["step"] >= k:
            return float(r["wall_s"])
    return None


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def prewarm(config: str | Path, overrides: list[str]) -> str:
    """Build (or find cached) the warm-start model so no timed run pays for it."""
    from areal.config import load_settings
    from areal.launch.worker import resolve_model_path

    return resolve_model_path(load_settings(config, overrides))


def cpu_load() -> str:
    a, b, c = os.getloadavg()
    return f"{a:.2f} / {b:.2f} / {c:.2f}"


def top_other_processes(n: int = 3) -> str:
    """Busiest processes right now (other jobs on a shared box), for the report."""
    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["ps", "-eo", "pcpu,comm", "--sort=-pcpu", "--no-headers"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.splitlines()[:n]
        return "; ".join(" ".join(x.split()) for x in out)
    return "?"
