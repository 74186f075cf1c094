"""Staleness across turns: are long episodes dropped more often than short ones? (issue 43)

An episode can span several policy versions: its first turn is generated, it waits on a tool
while the trainer moves on, and its next turn is generated under newer weights. The trainer
applies η to a sample's oldest **model** token (`areal.core.intake.model_versions`;
environment tokens have version -1 and age nothing) and drops a whole group
(`task_dropped_stale`) whose oldest model token is older than `version - η`. The risk: long
episodes (many turns, slow tools) are exactly the ones whose first token is old, so a
staleness filter could silently train on short episodes only. What stands against it: a batch
takes the B oldest complete groups and waits up to `algo.straggler_wait_s` (default 30 s) for
an older task still generating (`areal.core.intake`), so a slow episode's group is trained
before it can go stale, unless it outlasts the wait.

The workload: `examples/tool_arithmetic.yaml` (the tiny model, the calc tool, 2 turns), async
(interruptible) at η = 1, every tool call waiting a heavy-tailed simulated latency (lognormal,
median 0.607 s, sigma 1, mean 1 s, capped at 25 s: agentic.py's `heavy`), so episodes range from
one quick turn to two turns around a 10-25 s wait. Conditions (seeds interleaved):
- wait-30: `algo.straggler_wait_s=30` (the default);
- wait-0: `algo.straggler_wait_s=0`, the trainer never waits for an older open task (the
  oldest B complete groups, whatever is still generating): the unguarded filter, for contrast.

From each run, the bench watches every scored episode on the run's `rewards` subject (a core
subscription: nothing consumed) and the `task_*` events, and joins them with the step records'
`task_seqs`: for every episode of an ended group, its turns, tool latency, wall time (received
by the rollout -> finished), tokens, oldest/newest model-token version, and outcome (trained or
dropped_stale) with its lag (version trained against, or retired at, - its oldest model token's
version). It reports the drop rate bucketed by turns, tool latency, episode wall time and
tokens, and per group by the group's slowest episode, with each run's wall time and samples/s
(what the wait costs).

    python bench/episode_staleness.py                  # seed 0, both conditions, 40 steps
    python bench/episode_staleness.py --seeds 0 1 --steps 30

Writes episode_staleness.{md,json} to the results dir (bench/_common.py: outside the checkout
unless `AREAL_BENCH_RESULTS=bench/results`; `--results DIR` wins); `--out DIR`: the run dirs
(default: a new temp dir, kept).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

from _common import RESULTS_DIR, machine_header, md_table  # noqa: E402
from _rl import (  # noqa: E402
    code_note,
    code_state,
    cpu_load,
    mean,
    prewarm,
    run_areal,
    show_cmd,
    top_other_processes,
)
from agentic import (  # noqa: E402
    COMMON,
    CONFIG,
    EpisodeWatch,
    _bucket_of,
    _f,
    drop_buckets,
    drops_md,
    episode_table,
    latency_override,
)

CONDITIONS = {"wait-30": ["algo.straggler_wait_s=30"], "wait-0": ["algo.straggler_wait_s=0"]}
ASYNC = ["algo.max_staleness=1", "rollout.interruptible=true"]
GROUP_EDGES = [0.0, 1.0, 2.0, 5.0, 10.0, 20.0]


def group_buckets(episodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Groups bucketed by their slowest episode's wall time: groups, dropped, drop rate."""
    groups: dict[str, dict[str, Any]] = {}
    for ep in episodes:
        g = groups.setdefault(ep["task_id"], {"slowest": 0.0, "dropped": False})
        g["slowest"] = max(g["slowest"], ep.get("gen_s") or 0.0)
        g["dropped"] = g["dropped"] or ep["outcome"] == "dropped_stale"
    rows: dict[str, dict[str, Any]] = {}
    for g in groups.values():
        order, b = _bucket_of(g["slowest"], GROUP_EDGES)
        r = rows.setdefault(b, {"bucket": b, "order": order, "groups": 0, "dropped": 0})
        r["groups"] += 1
        r["dropped"] += g["dropped"]
    out = []
    for r in sorted(rows.values(), key=lambda r: r["order"]):
        r.pop("order")
        r["drop_rate"] = r["dropped"] / r["groups"]
        out.append(r)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--latency", default="heavy", help="a latency setting of agentic.py")
    ap.add_argument("--out", type=Path, help="run dirs (default: a new temp dir, kept)")
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help="where the report goes")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    tmp = args.out or Path(tempfile.mkdtemp(prefix="areal-episode-staleness-"))
    tmp.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        prewarm(CONFIG, [f"seed={seed}", *args.extra])

    from areal.bus.embedded import EmbeddedNats

    header = machine_header(
        {
            "workload": f"examples/tool_arithmetic.yaml, async η=1 interruptible, latency "
            f"{args.latency}, {args.steps} steps, seeds {args.seeds}, overrides "
            f"{list(COMMON)}" + (f", extra {args.extra}" if args.extra else ""),
            "busiest processes at start": top_other_processes(),
            "code": code_state(),
        }
    )
    print(header, flush=True)
    t_all = time.perf_counter()
    runs = []
    with EmbeddedNats(store_dir=tmp / "nats") as server:
        for seed in args.seeds:
            for cond, cond_ov in CONDITIONS.items():
                run_id = f"epstale-{cond}-s{seed}-{int(time.time())}"
                ov = [
                    *COMMON,
                    f"seed={seed}",
                    f"train.total_steps={args.steps}",
                    *latency_override(args.latency, seed),
                    *ASYNC,
                    *cond_ov,
                    *args.extra,
                ]
                print(f"\n[{cond} / seed {seed}] load {cpu_load()}", flush=True)
                watch = EpisodeWatch(server.url, run_id).start()
                res = run_areal(cond, CONFIG, tmp / run_id, server.url, run_id, ov)
                watch.stop()
                eps = episode_table(watch, res)
                dropped = sum(e["outcome"] == "dropped_stale" for e in eps)
                print(
                    f"  $ {show_cmd(res.cmd)}\n  -> rc {res.rc}, {len(res.records)} steps, wall "
                    f"{res.wall_s:.1f}s, episodes watched {len(watch.episodes)}, ended {len(eps)}, "
                    f"dropped {dropped}" + (f", watch error {watch.error}" if watch.error else ""),
                    flush=True,
                )
                runs.append((cond, seed, res, eps, len(watch.episodes), watch.error))
    total_s = time.perf_counter() - t_all

    run_rows, run_data = [], []
    for cond, seed, res, eps, watched, err in runs:
        dropped = sum(e["outcome"] == "dropped_stale" for e in eps)
        lags = [e["lag"] for e in eps if e["outcome"] == "trained" and e["lag"] is not None]
        sps = res.samples / res.wall_s if res.ok else float("nan")
        row = {
            "condition": cond,
            "seed": seed,
            "rc": res.rc,
            "steps": len(res.records),
            "wall_s": res.wall_s,
            "samples_per_s": sps,
            "final_reward": mean(res.rewards()[-10:]),
            "admitted": res.summary.get("admitted"),
            "dropped_stale_groups": res.summary.get("dropped_stale"),
            "episodes_watched": watched,
            "episodes_ended": len(eps),
            "episodes_dropped": dropped,
            "trained_lag_mean": mean(lags),
            "trained_lag_max": max(lags) if lags else None,
            "watch_error": err,
            "load_before": res.load_before,
            "cmd": show_cmd(res.cmd),
        }
        run_data.append(row)
        run_rows.append(
            [
                cond,
                seed,
                f"{res.wall_s:.1f}",
                f"{sps:.1f}",
                f"{row['final_reward']:.3f}",
                f"{row['dropped_stale_groups']}/{row['admitted']}",
                f"{dropped}/{len(eps)} ({dropped / max(1, len(eps)):.3f})",
                f"{row['trained_lag_mean']:.2f}/{_f(row['trained_lag_max'], 'd')}",
                f"{watched}",
                f"{res.load_before:.1f}",
            ]
        )
    per_cond = {
        cond: drop_buckets([e for c, _, _, eps, _, _ in runs if c == cond for e in eps])
        for cond in CONDITIONS
    }
    per_group = {
        cond: group_buckets([e for c, _, _, eps, _, _ in runs if c == cond for e in eps])
        for cond in CONDITIONS
    }
    group_rows = []
    labels = sorted(
        {r["bucket"] for rows in per_group.values() for r in rows},
        key=lambda b: _bucket_of(float(b.split(",")[0].strip("[(>= ")), GROUP_EDGES)[0],
    )
    for b in labels:
        cells = []
        for cond in CONDITIONS:
            r = next((r for r in per_group[cond] if r["bucket"] == b), None)
            cells.append(
                "" if r is None else f"{r['dropped']}/{r['groups']} ({r['drop_rate']:.3f})"
            )
        group_rows.append([b, *cells])
    md = "\n".join(
        [
            "# Staleness across turns: drop rate by episode length",
            "",
            header,
            code_note([r[2] for r in runs]),
            f"- total bench time {total_s / 60:.1f} min",
            "",
            "η applies to a sample's oldest model token; a group is dropped whole. The runs:",
            "",
            md_table(
                [
                    "condition",
                    "seed",
                    "wall s",
                    "samples/s",
                    "final reward",
                    "groups dropped/admitted",
                    "episodes dropped/ended",
                    "lag of trained episodes mean/max",
                    "episodes watched",
                    "load",
                ],
                run_rows,
            ),
            "",
            "Per episode (seeds pooled): each cell is episodes of dropped groups / episodes of "
            "ended groups (drop rate), then the mean / max lag (version trained against, or "
            "retired at, - the episode's oldest model-token version).",
            "",
            drops_md(per_cond, ["turns", "tool latency s", "episode wall s", "tokens"]),
            "Per group, by its slowest episode's wall time (s): dropped groups / groups (rate).",
            "",
            md_table(["slowest episode s", *CONDITIONS], group_rows),
            "",
            "Commands (one private nats-server, a distinct run_id each):",
            "",
            "```",
            *[r["cmd"] for r in run_data],
            "```",
            "",
        ]
    )
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "episode_staleness.md").write_text(md)
    (args.results / "episode_staleness.json").write_text(
        json.dumps(
            {
                "header": header,
                "runs": run_data,
                "drops_by_episode": per_cond,
                "drops_by_group": per_group,
                "total_s": total_s,
            },
            indent=1,
        )
    )
    print(md)
    print(f"wrote {args.results / 'episode_staleness.md'}, .json; run dirs under {tmp}")
    return 0 if all(r[2].ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
