"""Asynchronous vs synchronous RL on the tool workload, with simulated tool latency (issue 43).

The task of `examples/tool_arithmetic.yaml`: the built-in tiny model (warm-started, cached)
learns to call the `calc` tool on a*b+c (2-digit a and b) in a two-turn episode (the call, the
tool's result as environment tokens, the answer). Every call waits a simulated latency first
(`rollout.workflow_kwargs.latency`, `areal.tools.runner.SimulatedLatency`: an `asyncio.sleep`,
no CPU, the episode's decode row freed meanwhile), standing in for a remote tool:

- none: no wait;
- fixed: 1.0 s per call;
- heavy: lognormal, median 0.607 s and sigma 1.0 (mean 1.0 s, like fixed), capped at 25 s
  (below the 30 s tool timeout): most calls are quick, a few take 5-25 s.

Modes (whole `areal run` jobs on one private nats-server, a distinct run_id each):
- sync: `algo.max_staleness=0` (η = 0: the controller admits the next batch only once the
  trainer has published the weights of the last one), `rollout.interruptible=false`. Its core
  layout is the fastest synchronous one that `--probe` found on this workload (see SYNC_LAYOUT:
  the candidates are async_vs_sync.py's sync modes: default = unpinned, 1 torch thread per role;
  colocated = unpinned, 2 threads per role; pinned = rollout core 0, trainer core 1);
- async-η1 and async-η4: `algo.max_staleness` 1 (as the example) and 4 (the setting's
  default), `rollout.interruptible=true`, the core layout `--probe` found fastest among
  unpinned and pinned (ASYNC_LAYOUT).
Every mode: `rollout.max_concurrent_tasks=64` (the one rollout worker holds every task that
admission lets be outstanding, (η+1)·B = 16 and 32 at η = 0 and 1; at η = 4, 64 of up to 80),
`rollout.workflow_kwargs.max_concurrent_calls=1024` (the workflow's default of 8 calls at once
per worker would queue simulated waits behind each other; a remote tool serves many calls at
once), `data.eval_size=512` (held out of training), the example's B=16, G=8, lr, 2 turns.

Seeds are interleaved within each latency setting: seed 0 sync, async-η1, async-η4, seed 1
sync, ..., all in one sitting on one machine (30 steps a run by default). Per run:
- wall s: the trainer's wall time to its last step (`metrics.jsonl` `wall_s`; the same number
  of steps, so the same trained samples, in every mode); samples/s = trained samples / wall s;
- t→target: trainer wall time at the first step (>= 10) whose rolling 10-step mean training
  reward reaches the target. Target (per latency setting and seed): 90% of the sync run's
  final reward (mean of its last 10 steps), so "async reaches what sync ends at, sooner";
- final reward: mean training reward of the last 10 steps;
- eval: the final policy (`<out>/final`) on the 512 held-out tasks, run through the same
  `tool_call` workflow (the real calc tool, no simulated latency: accuracy only) at the run's
  temperature (1.0) and greedily; the in-run eval (`eval.every_versions`) generates one turn
  and cannot call a tool, so it is not used;
- speedup = sync wall / async wall (samples/s ratio) and sync t→target / async t→target.

Staleness across turns: during every run the bench watches the run's `rewards` subject (a
plain core subscription: it consumes nothing, `areal.bus.tap`) and its `events`, so for every
scored episode it knows its turns, tool calls, tool latency, tokens, model-token versions, and
whether its group was trained (a step record's `task_seqs`) or retired (`task_dropped_stale`).
The report gives the drop rate (episodes of dropped groups / episodes of ended groups) bucketed
by turns, tool latency and episode wall time. `bench/episode_staleness.py` stresses this.

    python bench/agentic.py                 # 3 latency settings x 2 seeds x 3 modes, ~30 min
    python bench/agentic.py --quick         # 1 seed, 12 steps, results in the --out dir only
    python bench/agentic.py --probe --steps 20 --latency none fixed   # the core layouts

Writes agentic.{md,json,png} (`--probe`: agentic_probe<tag>.{md,json}) to the results dir
(bench/_common.py: outside the checkout unless `AREAL_BENCH_RESULTS=bench/results`, which
updates the committed ones; `--quick`: into the --out dir). Every finished run is also
appended to <out>/agentic_runs.jsonl (its numbers and its episodes) as it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench/_common.py, bench/_rl.py, the repo

from _common import REPO_ROOT, RESULTS_DIR, machine_header, md_table, median  # noqa: E402
from _rl import (  # noqa: E402
    RunResult,
    code_note,
    code_state,
    cpu_load,
    mean,
    pin_pid,
    pin_roles,
    prewarm,
    rolling,
    run_areal,
    show_cmd,
    time_to_target,
    top_other_processes,
)

CONFIG = REPO_ROOT / "examples" / "tool_arithmetic.yaml"
ROLLOUT_CORE, TRAINER_CORE = {0}, {1}
EVAL_N = 512
TARGET_FRAC = 0.9  # target = this x the sync run's final reward (same latency and seed)
K = 10  # rolling window (steps) of time to target and final reward

LATENCIES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "fixed": {"kind": "fixed", "seconds": 1.0},
    # median 0.607 s, sigma 1: mean exp(ln 0.607 + 0.5) = 1.0 s, as fixed; p99 6.2 s
    "heavy": {"kind": "lognormal", "seconds": 0.607, "sigma": 1.0, "max_s": 25.0},
}
COMMON = (
    "rollout.max_concurrent_tasks=64",
    "rollout.workflow_kwargs.max_concurrent_calls=1024",
    f"data.eval_size={EVAL_N}",
)


@dataclass
class Mode:
    name: str
    eta: int
    interruptible: bool
    pinned: bool = False
    threads: int = 1
    extra: list[str] = field(default_factory=list)

    @property
    def sync(self) -> bool:
        return self.eta == 0

    def overrides(self) -> list[str]:
        ov = [
            f"algo.max_staleness={self.eta}",
            f"rollout.interruptible={'true' if self.interruptible else 'false'}",
            f"rollout.torch_threads={self.threads}",
            f"train.torch_threads={self.threads}",
            *self.extra,
        ]
        if self.pinned:  # the controller, reward, launcher and nats-server on the trainer's core
            ov += pin_roles(ROLLOUT_CORE, TRAINER_CORE, TRAINER_CORE)
        return ov

    def layout(self) -> str:
        if self.pinned:
            return "pinned: rollout core 0, trainer + the rest core 1"
        return f"unpinned, {self.threads} torch thread(s) per role"


PROBE_MODES = [
    Mode("sync-default", 0, False),
    Mode("sync-colocated", 0, False, threads=2),
    Mode("sync-pinned", 0, False, pinned=True),
    Mode("async-unpinned", 1, True),
    Mode("async-pinned", 1, True, pinned=True),
]
# The layouts `--probe` found fastest here; change them only with a new probe.
# bench/results/agentic_probe.md (20 steps, none and fixed latency, one run each): sync-default
# 21.2 / 37.7 s, sync-colocated 23.6 / 51.4, sync-pinned 18.8 / 45.5, async-unpinned 12.9 /
# 28.1, async-pinned 13.5 / 30.4; agentic_probe_sync.md (the two best sync layouts, 2 repeats
# interleaved): sync-default 19.7, 16.5 / 37.2, 45.7 s, sync-pinned 17.9, 18.8 / 34.6, 39.1 s:
# pinned is faster in 3 of 4 pairs and 7% in total, so sync is pinned (as in async_vs_sync.py,
# where sync-pinned was the fastest sync mode too) and async unpinned.
SYNC_LAYOUT = "sync-pinned"
ASYNC_LAYOUT = "async-unpinned"
# η of the async modes: 1 (examples/tool_arithmetic.yaml) and 4 (the default of algo.max_staleness)
ASYNC_ETAS = (1, 4)
MODE_COLORS = {"sync": "black", "async-η1": "tab:blue", "async-η4": "tab:orange"}


def modes_for_bench() -> list[Mode]:
    by = {m.name: m for m in PROBE_MODES}
    s, a = by[SYNC_LAYOUT], by[ASYNC_LAYOUT]
    return [
        Mode("sync", s.eta, s.interruptible, s.pinned, s.threads, list(s.extra)),
        *(
            Mode(f"async-η{eta}", eta, a.interruptible, a.pinned, a.threads, list(a.extra))
            for eta in ASYNC_ETAS
        ),
    ]


def latency_override(name: str, seed: int) -> list[str]:
    lat = LATENCIES[name]
    if lat is None:
        return []
    spec = ", ".join(f"{k}: {v}" for k, v in {**lat, "seed": seed}.items())
    return [f"rollout.workflow_kwargs.latency={{{spec}}}"]


# --------------------------------------------------------------------------- episode watch
@dataclass
class EpisodeWatch:
    """Every scored episode of one run (from `rewards`) and its groups' retirements (from
    `events`), watched live by a core subscription in a thread of its own; nothing consumed."""

    nats_url: str
    run_id: str
    episodes: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    retired: dict[str, dict[str, Any]] = field(default_factory=dict)  # task_id -> event
    error: str | None = None
    _thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    _ready: threading.Event = field(default_factory=threading.Event)

    def start(self) -> EpisodeWatch:
        self._thread = threading.Thread(target=self._main, name="episode-watch", daemon=True)
        self._thread.start()
        self._ready.wait(15)
        return self

    def stop(self, settle_s: float = 0.5) -> None:
        time.sleep(settle_s)
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the watch already ended (`error`)
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(15)

    def _main(self) -> None:
        try:
            asyncio.run(self._watch())
        except Exception as e:  # noqa: BLE001 - the bench reports it and goes on
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self._ready.set()

    async def _watch(self) -> None:
        from areal.bus.tap import TapClient
        from areal.core.intake import model_versions
        from areal.monitor.format import decode_for, expand
        from schemas import Event, ScoredSample

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()

        async def on_reward(tm) -> None:
            try:
                msgs = expand(decode_for(tm.subject, tm.data))
            except Exception:  # noqa: BLE001
                return
            for sc in msgs:
                if not isinstance(sc, ScoredSample) or sc.sample.rejected:
                    continue
                s = sc.sample
                mv = model_versions(sc)
                t = s.timings or {}
                self.episodes[(s.task_id, s.sample_idx)] = {
                    "task_id": s.task_id,
                    "task_seq": s.task_seq,
                    "sample_idx": s.sample_idx,
                    "reward": sc.reward,
                    "n_turns": s.n_turns,
                    "n_tool_calls": s.n_tool_calls,
                    "tool_s": round(s.tool_s, 4),
                    "tokens": _n(s.output_ids),
                    "model_tokens": int(len(mv)),
                    "vmin": int(mv.min()) if len(mv) else None,
                    "vmax": int(mv.max()) if len(mv) else None,
                    "finish_reason": s.finish_reason,
                    "n_interrupts": s.n_interrupts,
                    "gen_s": _span(t, "received_at", "finished_at"),
                    "since_admit_s": _span(t, "admitted_at", "finished_at"),
                }

        async def on_event(tm) -> None:
            with contextlib.suppress(Exception):
                ev = decode_for(tm.subject, tm.data)
                if isinstance(ev, Event) and ev.type.startswith("task_"):
                    tid = str(ev.detail.get("task_id", ""))
                    self.retired[tid] = {"type": ev.type, **ev.detail}

        client = await TapClient.connect(self.nats_url, self.run_id, name="bench-agentic")
        try:
            await client.follow("rewards", on_reward)
            await client.follow("events", on_event)
            self._ready.set()
            await self._stop.wait()
        finally:
            await client.close()


def _n(arr: Any) -> int:
    from areal.bus.codec import unpack

    return int(len(unpack(arr)))


def _span(t: dict[str, float], a: str, b: str) -> float | None:
    return round(t[b] - t[a], 4) if a in t and b in t else None


def episode_table(watch: EpisodeWatch, res: RunResult) -> list[dict[str, Any]]:
    """The watched episodes of ended groups, each with `outcome` (trained | dropped_stale |
    filtered | rejected) and `lag`: the policy version it was trained against (or retired at)
    minus its oldest model token's version. Groups still in flight when the run stopped are
    left out."""
    trained = {
        int(seq): int(r.get("trained_on_version", r["step"] - 1))
        for r in res.records
        for seq in r.get("task_seqs", [])
    }
    out = []
    for ep in watch.episodes.values():
        ret = watch.retired.get(ep["task_id"])
        if ret is not None:
            outcome, at = ret["type"].removeprefix("task_"), ret.get("version")
        elif ep["task_seq"] in trained:
            outcome, at = "trained", trained[ep["task_seq"]]
        else:
            continue
        lag = None if at is None or ep["vmin"] is None else max(0, int(at) - ep["vmin"])
        out.append({**ep, "outcome": outcome, "lag": lag})
    return out


BUCKETS = {
    "turns": ("n_turns", None),
    "tool latency s": ("tool_s", [0.0, 1e-9, 0.5, 1.0, 2.0, 5.0, 10.0]),
    "episode wall s": ("gen_s", [0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0]),
    "tokens": ("tokens", [0, 16, 24, 32, 40, 48]),
}


def _bucket_of(value: float, edges: list[float] | None) -> tuple[float, str]:
    """(sort key, label) of `value`'s bucket; `edges` None: the value itself (turns)."""
    if edges is None:
        return value, str(int(value))
    for lo, hi in zip(edges, edges[1:], strict=False):
        if lo <= value < hi:
            if hi == 1e-9:
                return -1.0, "0"
            if lo == 1e-9:
                return lo, f"(0, {hi:g})"
            return lo, f"[{lo:g}, {hi:g})"
    return edges[-1], f">= {edges[-1]:g}"


def drop_buckets(episodes: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """For each bucketing (`BUCKETS`): rows of bucket, episodes, dropped, drop rate (episodes of
    dropped groups / episodes of ended groups), mean model-token version span within the
    episode, and mean / max lag (version trained against or retired at - oldest model token's
    version)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name, (key, edges) in BUCKETS.items():
        rows: dict[str, dict[str, Any]] = {}
        for ep in episodes:
            v = ep.get(key)
            if v is None:
                continue
            order, b = _bucket_of(float(v), edges)
            row = rows.setdefault(
                b, {"bucket": b, "order": order, "episodes": 0, "dropped": 0, "span": [], "lag": []}
            )
            row["episodes"] += 1
            row["dropped"] += ep["outcome"] == "dropped_stale"
            if ep["vmin"] is not None:
                row["span"].append(ep["vmax"] - ep["vmin"])
            if ep.get("lag") is not None:
                row["lag"].append(ep["lag"])
        table = []
        for r in sorted(rows.values(), key=lambda r: r["order"]):
            span, lag = r.pop("span"), r.pop("lag")
            r.pop("order")
            r["drop_rate"] = r["dropped"] / r["episodes"] if r["episodes"] else float("nan")
            r["version_span_mean"] = mean(span)
            r["lag_mean"] = mean(lag)
            r["lag_max"] = max(lag) if lag else None
            table.append(r)
        out[name] = table
    return out


def drops_md(columns: dict[str, dict[str, list[dict[str, Any]]]], names: list[str]) -> str:
    """One table per bucketing in `names`: a row per bucket, a column per run set (`columns`:
    label -> `drop_buckets` result), each cell `dropped/episodes (rate), lag mean/max`."""
    parts = []
    for name in names:
        labels = list(columns)
        buckets: dict[str, float] = {}
        cells: dict[tuple[str, str], str] = {}
        for label, b in columns.items():
            for i, r in enumerate(b.get(name, [])):
                buckets.setdefault(r["bucket"], len(buckets) + i * 1e-3)
                cells[(r["bucket"], label)] = (
                    f"{r['dropped']}/{r['episodes']} ({r['drop_rate']:.3f}), "
                    f"{r['lag_mean']:.2f}/{r['lag_max'] if r['lag_max'] is not None else '-'}"
                )
        order = _order_buckets(list(buckets))
        parts.append(
            md_table(
                [name, *labels], [[b, *(cells.get((b, lb), "") for lb in labels)] for b in order]
            )
        )
        parts.append("")
    return "\n".join(parts)


def _order_buckets(labels: list[str]) -> list[str]:
    def key(b: str) -> float:
        if b == "0":
            return -1.0
        if b.startswith(">="):
            return float(b[2:]) + 1e-6
        if b[0] in "[(":
            return float(b[1:].split(",")[0]) + (1e-9 if b[0] == "(" else 0.0)
        return float(b)

    return sorted(labels, key=key)


# --------------------------------------------------------------------------- held-out eval
class _BatchGen:
    """A `Generator` for many episodes at once: their turns are batched into one
    `engine.generate` call whenever every live episode waits on a turn (or after a short
    grace, for episodes busy in a tool)."""

    def __init__(self) -> None:
        self.pending: list[tuple[Any, asyncio.Future]] = []
        self.n = 0

    async def generate(self, ids: list[int], *, max_new_tokens: int | None = None):
        from areal.engines.base import GenRequest

        self.n += 1
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((GenRequest(f"eval/{self.n}", list(ids), max_new_tokens), fut))
        return await fut


async def _run_eval(parts: Any, tasks: list[Any]) -> list[Any]:
    from areal.workflows.api import Generation

    gen = _BatchGen()
    eps = [asyncio.create_task(parts.workflow.arun_episode(gen, t, 0)) for t in tasks]
    waited = 0.0
    while not all(e.done() for e in eps):
        await asyncio.sleep(0.002)
        waited += 0.002
        live = sum(not e.done() for e in eps)
        if gen.pending and (len(gen.pending) >= live or waited > 0.05):
            batch, gen.pending, waited = gen.pending, [], 0.0
            outs = await asyncio.to_thread(
                parts.engine.generate, [r for r, _ in batch], params=parts.params
            )
            for (_, fut), o in zip(batch, outs, strict=True):
                fut.set_result(Generation(o.output_ids, o.behav_logp, o.versions, o.finish_reason))
    return [e.result() for e in eps]


def eval_tool_model(
    model_dir: str | Path, overrides: list[str], temperature: float, n: int = EVAL_N
) -> float:
    """Mean reward of `model_dir` on the run's `n` held-out tasks (`data.eval_size`), each
    one episode of the run's own workflow (the calc tool, no simulated latency)."""
    import torch

    from areal.bus.codec import pack
    from areal.config import load_settings
    from areal.data.prompts import PromptBuilder
    from areal.data.sources import make_sources
    from areal.rewards.registry import get_reward_fn
    from schemas import Task
    from workers.rollout import prepare

    s = load_settings(
        CONFIG,
        [
            *(o for o in overrides if not o.startswith("rollout.workflow_kwargs.latency")),
            f"model.path={model_dir}",
            "rollout.workflow_kwargs.latency={kind: none}",
            f"rollout.temperature={temperature}",
        ],
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    threads = torch.get_num_threads()
    parts = prepare(s, "bench-eval")
    try:
        _, held = make_sources(s.data, s.seed)
        assert held is not None, "data.eval_size must be set"
        tok = parts.workflow.ctx.tokenizer
        prompts = PromptBuilder(s.prompt, tok)
        tasks = []
        for i in range(min(n, len(held))):
            it = held.get(i)
            tasks.append(
                Task(
                    task_id=f"eval-{i}",
                    seq=i,
                    dataset_index=it.index,
                    prompt=it.prompt,
                    prompt_ids=pack(prompts.ids(it), "int32"),
                    answer=it.answer,
                    metadata=it.metadata,
                    group_size=1,
                    admitted_version=0,
                )
            )
        episodes = asyncio.run(_run_eval(parts, tasks))
        fn = get_reward_fn(s.reward_fn_name())
        total = 0.0
        for t, ep in zip(tasks, episodes, strict=True):
            total += float(fn("".join(seg.text for seg in ep.segments), t.answer))
        return total / len(tasks)
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- runs
@dataclass
class Run:
    latency: str
    seed: int
    mode: Mode
    res: RunResult
    episodes: list[dict[str, Any]]
    watch_error: str | None
    watched: int
    eval_t1: float | None = None
    eval_greedy: float | None = None
    eval_s: float = 0.0

    @property
    def final_reward(self) -> float:
        return mean(self.res.rewards()[-K:])

    @property
    def sps(self) -> float:
        return self.res.samples / self.res.wall_s if self.res.ok else float("nan")


def run_one(
    server: Any, tmp: Path, latency: str, seed: int, mode: Mode, steps: int, extra: list[str]
) -> Run:
    run_id = f"agentic-{latency}-{mode.name.replace('η', 'e')}-s{seed}-{int(time.time())}"
    ov = [
        *COMMON,
        f"seed={seed}",
        f"train.total_steps={steps}",
        *latency_override(latency, seed),
        *mode.overrides(),
        *extra,
    ]
    pin_pid(server.proc.pid, TRAINER_CORE if mode.pinned else set(range(os.cpu_count() or 1)))
    print(f"\n[{latency} / {mode.name} / seed {seed}] load {cpu_load()}", flush=True)
    watch = EpisodeWatch(server.url, run_id).start()
    res = run_areal(mode.name, CONFIG, tmp / run_id, server.url, run_id, ov)
    watch.stop()
    eps = episode_table(watch, res)
    run = Run(latency, seed, mode, res, eps, watch.error, len(watch.episodes))
    final = res.out_dir / "final"
    if final.is_dir():
        t0 = time.perf_counter()
        base = [o for o in ov if not o.startswith("cpu_affinity")]
        run.eval_t1 = eval_tool_model(final, base, 1.0)
        run.eval_greedy = eval_tool_model(final, base, 0.0)
        run.eval_s = time.perf_counter() - t0
    print(f"  $ {show_cmd(res.cmd)}")
    dropped = sum(e["outcome"] == "dropped_stale" for e in eps)
    print(
        f"  -> rc {res.rc}, {len(res.records)} steps, wall {res.wall_s:.1f}s, "
        f"{run.sps:.1f} samples/s, final {run.final_reward:.3f}, eval T=1 {_f(run.eval_t1)} "
        f"greedy {_f(run.eval_greedy)} ({run.eval_s:.0f}s), episodes watched {run.watched}, "
        f"ended {len(eps)}, dropped {dropped}"
        + (f", watch error {watch.error}" if watch.error else ""),
        flush=True,
    )
    return run


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None or x != x else format(x, fmt)


def run_from_json(d: dict[str, Any], mode: Mode) -> Run:
    """A run recorded in agentic_runs.jsonl (by `run_json`, with its episodes), for a report
    that resumes a sitting."""
    import shlex

    records = [dict(r) for r in d["records"]]
    for r in records:  # records from before `samples` was kept: every step trains B x G
        r.setdefault("samples", d["samples"] // max(1, len(records)))
    res = RunResult(
        d["mode"],
        Path(),
        shlex.split(d["cmd"]),
        d["rc"],
        d["process_wall_s"],
        records=records,
        summary={"dropped_stale": d["dropped_stale"], "admitted": d["admitted"]},
    )
    res.load_before, res.load_after, res.code = d["load_before"], d["load_after"], d["code"]
    run = Run(
        d["latency"], d["seed"], mode, res, d["episodes"], d["watch_error"], d["episodes_watched"]
    )
    run.eval_t1, run.eval_greedy = d["eval_t1"], d["eval_greedy"]
    return run


def run_json(r: Run, target: float | None) -> dict[str, Any]:
    res = r.res
    keys = (
        "step",
        "wall_s",
        "samples",
        "reward_mean",
        "tool_ok_frac",
        "staleness_max",
        "dropped_stale",
        "interrupted_frac",
        "tool_s_mean",
        "wait_s",
        "train_s",
        "trainer_idle_frac",
    )
    return {
        "latency": r.latency,
        "latency_spec": LATENCIES[r.latency],
        "mode": r.mode.name,
        "layout": r.mode.layout(),
        "eta": r.mode.eta,
        "interruptible": r.mode.interruptible,
        "seed": r.seed,
        "rc": res.rc,
        "steps": len(res.records),
        "wall_s": res.wall_s,
        "process_wall_s": res.process_wall_s,
        "samples": res.samples,
        "samples_per_s": r.sps,
        "target": target,
        "t_to_target_s": time_to_target(res, target, K) if target is not None else None,
        "final_reward": r.final_reward,
        "eval_t1": r.eval_t1,
        "eval_greedy": r.eval_greedy,
        "staleness_mean": res.mean_of("staleness_max"),
        "interrupted_frac": res.mean_of("interrupted_frac"),
        "dropped_stale": res.summary.get("dropped_stale"),
        "admitted": res.summary.get("admitted"),
        "episodes_watched": r.watched,
        "episodes_ended": len(r.episodes),
        "watch_error": r.watch_error,
        "load_before": res.load_before,
        "load_after": res.load_after,
        "code": res.code,
        "cmd": show_cmd(res.cmd),
        "records": [{k: rec[k] for k in keys if k in rec} for rec in res.records],
    }


def plot(runs: list[Run], targets: dict[tuple[str, int], float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lats = list(dict.fromkeys(r.latency for r in runs))
    fig, axes = plt.subplots(1, len(lats), figsize=(5.2 * len(lats), 4.2), squeeze=False)
    styles = ["-", "--", ":", "-."]
    seeds = sorted({r.seed for r in runs})
    for ax, lat in zip(axes[0], lats, strict=True):
        for r in runs:
            if r.latency != lat or not r.res.records:
                continue
            xs = [float(x["wall_s"]) for x in r.res.records]
            ax.plot(
                xs,
                rolling(r.res.rewards(), K),
                color=MODE_COLORS.get(r.mode.name, "tab:green"),
                ls=styles[seeds.index(r.seed) % len(styles)],
                label=f"{r.mode.name}, seed {r.seed}",
            )
        for (tl, seed), t in targets.items():
            if tl == lat:
                ax.axhline(t, color="gray", lw=0.6, ls=styles[seeds.index(seed) % len(styles)])
        ax.set_title(f"tool latency: {lat}")
        ax.set_xlabel("trainer wall time (s)")
        ax.set_ylabel(f"training reward (rolling {K} steps)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        "tool_arithmetic: async (η=1, η=4, interruptible) vs sync (η=0), same steps, 2-core CPU"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def probe(args: argparse.Namespace, tmp: Path) -> int:
    """The candidate layouts (`PROBE_MODES`, or `--only`) at each `--latency`, the seeds as
    repeats with the modes interleaved: which sync and which async layout is fastest here."""
    from areal.bus.embedded import EmbeddedNats

    keep = set(args.only.split(",")) if args.only else {m.name for m in PROBE_MODES}
    header = machine_header(
        {
            "probe": f"{args.steps} steps per run, latency {args.latency}, repeats (seeds) "
            f"{args.seeds}, modes {sorted(keep)}",
            "busiest processes at start": top_other_processes(),
            "code": code_state(),
        }
    )
    rows, data = [], []
    with EmbeddedNats(store_dir=tmp / "nats") as server:
        for lat in args.latency:
            for seed in args.seeds:
                for m in (m for m in PROBE_MODES if m.name in keep):
                    r = run_one(server, tmp, lat, seed, m, args.steps, args.extra)
                    rows.append(
                        [
                            lat,
                            seed,
                            m.name,
                            m.layout(),
                            f"{r.res.wall_s:.1f}",
                            f"{r.sps:.1f}",
                            f"{r.final_reward:.3f}",
                            _f(r.eval_t1),
                            f"{r.res.load_before:.1f}",
                        ]
                    )
                    data.append(run_json(r, None))
    table = md_table(
        [
            "latency",
            "seed",
            "mode",
            "layout",
            "wall s",
            "samples/s",
            "final reward",
            "eval T=1",
            "load before",
        ],
        rows,
    )
    md = f"# Probe: core layouts on the tool workload\n\n{header}\n\n{table}\n"
    out = tmp if args.quick else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / f"agentic_probe{args.tag}.md").write_text(md)
    (out / f"agentic_probe{args.tag}.json").write_text(json.dumps(data, indent=1))
    print(md)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 seed, 12 steps, results in --out")
    ap.add_argument("--probe", action="store_true", help="compare the core layouts instead")
    ap.add_argument("--seeds", type=int, nargs="+", help="default 0 1 (--quick: 0)")
    ap.add_argument("--steps", type=int, help="train.total_steps (default 30; --quick 12)")
    ap.add_argument("--latency", nargs="+", choices=list(LATENCIES), default=list(LATENCIES))
    ap.add_argument("--out", type=Path, help="run dirs (default: a new temp dir, kept)")
    ap.add_argument("--only", help="--probe: comma list of PROBE_MODES names")
    ap.add_argument("--tag", default="", help="--probe: suffix of its report's file names")
    ap.add_argument("--note", help="a line for the report's header (e.g. how a sitting went)")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    args.seeds = args.seeds or ([0] if args.quick else [0, 1])
    args.steps = args.steps or (12 if args.quick else 30)
    tmp = args.out or Path(tempfile.mkdtemp(prefix="areal-agentic-"))
    tmp.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:  # the warm start is built (or found) before any timed run
        prewarm(CONFIG, [f"seed={seed}", *args.extra])
    if args.probe:
        return probe(args, tmp)

    from areal.bus.embedded import EmbeddedNats

    modes = modes_for_bench()
    header = machine_header(
        {
            "workload": f"{CONFIG.relative_to(REPO_ROOT)} (B=16, G=8, 2 turns, calc tool), "
            f"{args.steps} steps per run, seeds {args.seeds}, overrides {list(COMMON)}"
            + (f", extra {args.extra}" if args.extra else ""),
            "latency": "; ".join(f"{k}: {v}" for k, v in LATENCIES.items() if k in args.latency),
            "modes": "; ".join(
                f"{m.name}: η={m.eta}, interruptible={m.interruptible}, {m.layout()}" for m in modes
            ),
            "busiest processes at start": top_other_processes(),
            "code": code_state(),
        }
    )
    print(header, flush=True)
    t_all = time.perf_counter()
    warm = {}
    for seed in args.seeds:
        path = prewarm(CONFIG, [f"seed={seed}", *args.extra])
        base = [*COMMON, f"seed={seed}", *args.extra]
        warm[seed] = (eval_tool_model(path, base, 1.0), eval_tool_model(path, base, 0.0))
        print(
            f"- warm start, seed {seed}: eval T=1 {warm[seed][0]:.3f}, greedy {warm[seed][1]:.3f}"
        )
    runs: list[Run] = []
    loads = []
    log = tmp / "agentic_runs.jsonl"  # every finished run, as it ends: what --out resumes
    done = {}
    if log.exists():
        for line in log.read_text().splitlines():
            d = json.loads(line)
            if d["rc"] == 0 and d["steps"] == args.steps:
                done[(d["latency"], d["seed"], d["mode"])] = d
    resumed = []
    with EmbeddedNats(store_dir=tmp / "nats") as server:
        for lat in args.latency:
            for seed in args.seeds:
                for m in modes:
                    if (lat, seed, m.name) in done:
                        runs.append(run_from_json(done[(lat, seed, m.name)], m))
                        resumed.append(f"{lat}/{m.name}/s{seed}")
                    else:
                        runs.append(run_one(server, tmp, lat, seed, m, args.steps, args.extra))
                        with open(log, "a") as f:
                            rec = {**run_json(runs[-1], None), "episodes": runs[-1].episodes}
                            f.write(json.dumps(rec) + "\n")
                    loads.append(
                        f"{lat}/{m.name}/s{seed}: {runs[-1].res.load_before:.1f}"
                        f"->{runs[-1].res.load_after:.1f}"
                    )
    total_s = time.perf_counter() - t_all

    # targets, per latency and seed: 90% of the sync run's final reward
    targets: dict[tuple[str, int], float] = {}
    for r in runs:
        if r.mode.sync and r.res.ok:
            targets[(r.latency, r.seed)] = TARGET_FRAC * r.final_reward
    rows, data = [], []
    for r in runs:
        tgt = targets.get((r.latency, r.seed))
        d = run_json(r, tgt)
        data.append(d)
        rows.append(
            [
                r.latency,
                r.mode.name,
                r.seed,
                f"{r.res.wall_s:.1f}",
                f"{r.sps:.1f}",
                _f(tgt),
                _f(d["t_to_target_s"], ".1f"),
                f"{r.final_reward:.3f}",
                _f(r.eval_t1),
                _f(r.eval_greedy),
                f"{d['staleness_mean']:.2f}",
                _f(d["interrupted_frac"], ".2f"),
                f"{d['dropped_stale']}/{d['admitted']}",
                f"{r.res.load_before:.1f}",
            ]
        )
    summary, speed_rows = speedups(runs, targets, args.latency, args.seeds, modes)
    # staleness across turns: every async run's ended episodes, per latency setting and mode
    drops = {
        f"{lat}, {m.name}": drop_buckets(
            [e for r in runs if r.latency == lat and r.mode.name == m.name for e in r.episodes]
        )
        for lat in args.latency
        for m in modes
        if not m.sync
    }
    table = md_table(
        [
            "latency",
            "mode",
            "seed",
            "wall s",
            "samples/s",
            "target",
            "t→target s",
            "final reward",
            "eval T=1",
            "eval greedy",
            "staleness mean",
            "interrupted",
            "dropped/admitted",
            "load",
        ],
        rows,
    )
    speed = md_table(
        [
            "latency",
            "async mode",
            "speedup samples/s (per seed)",
            "median",
            "speedup t→target (per seed)",
            "median",
            "eval T=1 sync / async (mean of seeds)",
        ],
        speed_rows,
    )
    out_dir = tmp if args.quick else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "agentic.png"
    plot(runs, targets, png)
    md = "\n".join(
        [
            "# Agentic RL: async vs sync on the tool workload, with simulated tool latency",
            "",
            header,
            *[
                f"- warm start (step 0), seed {s}: eval T=1 {w[0]:.3f}, greedy {w[1]:.3f}"
                for s, w in warm.items()
            ],
            code_note([r.res for r in runs]),
            *([f"- note: {args.note}"] if args.note else []),
            f"- total bench time {total_s / 60:.1f} min (this sitting; the runs' `areal run` "
            f"processes: {sum(r.res.process_wall_s for r in runs) / 60:.1f} min in all); "
            "1-min load before->after each run: " + ", ".join(loads),
            *(
                [
                    f"- resumed: {len(resumed)} of {len(runs)} runs were loaded from {log.name} "
                    "(recorded as they ended by earlier sittings of this command with the same "
                    f"--out), not run in this sitting: {', '.join(resumed)}"
                ]
                if resumed
                else []
            ),
            "",
            "## Speedup of async over sync",
            "",
            speed,
            "",
            "Speedup samples/s = sync wall s / async wall s (same trained samples); speedup "
            "t→target = sync t→target / async t→target (`-`: a run never reached the target).",
            "",
            "## Every run",
            "",
            table,
            "",
            f"Columns: wall s = trainer wall time to the last of {args.steps} steps (same "
            "trained samples in every mode); target = 90% of the sync run's final reward (same "
            f"latency and seed); t→target = trainer wall time when the rolling {K}-step mean "
            f"training reward first reaches it (step >= {K}; `-`: never); final reward = mean "
            f"of the last {K} steps; eval = the final policy on {EVAL_N} held-out tasks through "
            "the tool_call workflow (real calc tool, no latency), at T=1 and greedy; staleness "
            "mean = mean over steps of the batch's largest sample lag; interrupted = samples "
            "that switched weights mid-generation; load = 1-min load average before the run.",
            "",
            f"![async vs sync]({png.name})",
            "",
            "## Staleness across turns: drop rate by episode length (async runs, seeds pooled)",
            "",
            "η applies to a sample's oldest model token (environment tokens have no version); "
            "a group is dropped whole (`task_dropped_stale`) when one of its episodes is too "
            "old. Each cell: episodes of dropped groups / episodes of ended (trained or "
            "retired) groups (drop rate), then the mean / max lag (version trained against - "
            "the episode's oldest model-token version), from the run's `rewards` (watched "
            "live) and `events`. All buckets, and token-length buckets, are in agentic.json "
            "(`drops_async`).",
            "",
            drops_md(drops, ["turns", "tool latency s", "episode wall s"]),
            "Commands (one private nats-server for all runs, a distinct run_id each):",
            "",
            "```",
            *[d["cmd"] for d in data],
            "```",
            "",
        ]
    )
    (out_dir / "agentic.md").write_text(md)
    (out_dir / "agentic.json").write_text(
        json.dumps(
            {
                "header": header,
                "steps": args.steps,
                "seeds": args.seeds,
                "latencies": {k: LATENCIES[k] for k in args.latency},
                "target": f"{TARGET_FRAC} x the sync run's final reward (last {K} steps)",
                "warm_start": {
                    str(s): {"eval_t1": w[0], "eval_greedy": w[1]} for s, w in warm.items()
                },
                "summary": summary,
                "drops_async": drops,
                "total_s": total_s,
                "runs": data,
            },
            indent=1,
        )
    )
    print(md)
    print(f"wrote {out_dir / 'agentic.md'}, .json, .png; run dirs under {tmp}")
    return 0 if all(r.res.ok for r in runs) else 1


def speedups(
    runs: list[Run],
    targets: dict[tuple[str, int], float],
    latencies: list[str],
    seeds: list[int],
    modes: list[Mode],
) -> tuple[dict[str, Any], list[list[str]]]:
    """Per latency and async mode: sync/async wall and time-to-target ratios per seed, their
    medians, and the mean held-out eval of both."""
    by = {(r.latency, r.seed, r.mode.name): r for r in runs}
    summary: dict[str, Any] = {}
    rows = []
    for lat in latencies:
        for m in modes:
            if m.sync:
                continue
            wall_x, ttt_x, per_seed = [], [], []
            ev_s, ev_a = [], []
            for seed in seeds:
                s, a = by.get((lat, seed, "sync")), by.get((lat, seed, m.name))
                if not (s and a and s.res.ok and a.res.ok):
                    continue
                tgt = targets.get((lat, seed))
                ts = time_to_target(s.res, tgt, K) if tgt is not None else None
                ta = time_to_target(a.res, tgt, K) if tgt is not None else None
                wx = s.res.wall_s / a.res.wall_s
                tx = ts / ta if ts and ta else None
                wall_x.append(wx)
                if tx is not None:
                    ttt_x.append(tx)
                ev_s += [s.eval_t1] if s.eval_t1 is not None else []
                ev_a += [a.eval_t1] if a.eval_t1 is not None else []
                per_seed.append(
                    {
                        "seed": seed,
                        "samples_per_s_x": wx,
                        "t_to_target_x": tx,
                        "sync_t_to_target_s": ts,
                        "async_t_to_target_s": ta,
                    }
                )
            key = f"{lat}, {m.name}"
            summary[key] = {
                "per_seed": per_seed,
                "samples_per_s_x_median": median(wall_x) if wall_x else None,
                "t_to_target_x_median": median(ttt_x) if ttt_x else None,
                "eval_t1_sync_mean": mean(ev_s),
                "eval_t1_async_mean": mean(ev_a),
            }
            rows.append(
                [
                    lat,
                    m.name,
                    " / ".join(f"{x['samples_per_s_x']:.2f}" for x in per_seed),
                    _f(summary[key]["samples_per_s_x_median"], ".2f"),
                    " / ".join(_f(x["t_to_target_x"], ".2f") for x in per_seed),
                    _f(summary[key]["t_to_target_x_median"], ".2f"),
                    f"{mean(ev_s):.3f} / {mean(ev_a):.3f}",
                ]
            )
    return summary, rows


if __name__ == "__main__":
    sys.exit(main())
