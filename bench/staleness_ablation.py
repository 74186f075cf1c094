"""Staleness ablation (issue 3): a miniature of AReaL's table 2 on the built-in task.

Runs `examples/arithmetic.yaml` (1-2 digit addition, tiny warm-started Qwen2, B=16, G=8) for
`algo.max_staleness` η in {0, 1, 4, 16} x `algo.decoupled` in {true, false}: 8 whole `areal run`
jobs with the same seed and the same `train.total_steps` (so the same number of trained
samples). η = 0 also sets `rollout.interruptible=false`, so it is truly synchronous RL.

Per run: final reward (mean of the last 10 steps), reward of the first 10 steps, trainer wall
time (trainer start -> last step), samples/s (trained samples / wall), max staleness observed
(sample staleness = lag of its oldest token), groups dropped as stale, mean fraction of tokens
masked by the behaviour-importance-weight cap, mean PPO clip fraction.

    python bench/staleness_ablation.py [--quick] [--steps N] [--out DIR]

Writes <out>/staleness_ablation.md, .png (reward vs step and vs wall time) and .json (per-step
curves). No core pinning here: every run gets the whole machine as `areal run` starts it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench/_common.py, bench/_rl.py, the repo

from _common import REPO_ROOT, RESULTS_DIR, machine_header, md_table  # noqa: E402
from _rl import (  # noqa: E402
    RunResult,
    code_note,
    code_state,
    cpu_load,
    eval_final,
    eval_model,
    mean,
    prewarm,
    rolling,
    run_areal,
    runs_dir,
    show_cmd,
    top_other_processes,
)

CONFIG = REPO_ROOT / "examples" / "arithmetic.yaml"
ETAS = (0, 1, 4, 16)


def mode_overrides(eta: int, decoupled: bool, steps: int, seed: int) -> list[str]:
    o = [
        f"seed={seed}",
        f"train.total_steps={steps}",
        f"algo.max_staleness={eta}",
        f"algo.decoupled={'true' if decoupled else 'false'}",
    ]
    if eta == 0:
        o.append("rollout.interruptible=false")
    return o


def label(eta: int, decoupled: bool) -> str:
    return f"η={eta} {'decoupled' if decoupled else 'standard PPO'}"


def row(eta: int, decoupled: bool, r: RunResult) -> list[object]:
    if not r.ok:
        return [eta, "yes" if decoupled else "no", f"FAILED (rc {r.rc})", *["-"] * 9]
    rw = r.rewards()
    return [
        eta,
        "yes" if decoupled else "no",
        f"{mean(rw[-10:]):.3f}",
        f"{r.eval_reward:.3f}" if r.eval_reward is not None else "-",
        f"{mean(rw[:10]):.3f}",
        f"{r.wall_s:.1f}",
        f"{r.samples / r.wall_s:.0f}",
        max(int(x["staleness_max"]) for x in r.records),
        int(r.last("dropped_stale", 0)),
        f"{r.mean_of('behav_imp_weight_masked_frac'):.4f}",
        f"{r.mean_of('clipfrac'):.3f}",
        f"{r.mean_of('trainer_idle_frac'):.2f}",
    ]


HEADER = [
    "η",
    "decoupled",
    "final reward (last 10)",
    "eval reward (final policy)",
    "first 10",
    "wall s",
    "samples/s",
    "max staleness seen",
    "dropped stale",
    "imp-weight masked frac",
    "clipfrac",
    "trainer idle",
]


def plot(results: dict[tuple[int, bool], RunResult], path: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {0: "black", 1: "tab:blue", 4: "tab:orange", 16: "tab:red"}
    for (eta, dec), r in results.items():
        if not r.records:
            continue
        y = rolling(r.rewards(), 10)
        style = dict(color=colors.get(eta, "gray"), ls="-" if dec else "--", lw=1.4)
        axes[0].plot([x["step"] for x in r.records], y, label=label(eta, dec), **style)
        axes[1].plot([x["wall_s"] for x in r.records], y, **style)
    axes[0].set_xlabel("trainer step")
    axes[1].set_xlabel("trainer wall time (s)")
    for ax in axes:
        ax.set_ylabel("reward (rolling mean, 10 steps)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2)
    fig.suptitle(
        f"Staleness ablation, synthetic:arithmetic, {steps} steps "
        "(solid: decoupled PPO, dashed: standard PPO)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="40 steps (smoke test)")
    ap.add_argument("--steps", type=int, help="train.total_steps per run (default 150)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="results dir")
    ap.add_argument("--runs-dir", type=Path, help="keep run dirs here (default: a temp dir)")
    ap.add_argument("--etas", type=str, help="comma list, e.g. 0,4 (default 0,1,4,16)")
    args = ap.parse_args()
    steps = args.steps or (40 if args.quick else 150)
    etas = [int(x) for x in args.etas.split(",")] if args.etas else list(ETAS)
    modes = [(eta, dec) for eta in etas for dec in (True, False)]

    from areal.bus.embedded import EmbeddedNats

    header = machine_header(
        {
            "workload": f"{CONFIG.relative_to(REPO_ROOT)} (synthetic:arithmetic, B=16, G=8), "
            f"{steps} steps = {steps * 128} trained samples per run, seed {args.seed}",
            "cores": "no pinning: each run's workers share all CPUs (torch 1 thread per worker)",
            "busiest processes at start": top_other_processes(),
            "code": code_state(),
        }
    )
    print(header, flush=True)
    model = prewarm(CONFIG, [f"seed={args.seed}"])
    warm_line = (
        f"- warm-start model (step 0): {model}, eval reward "
        f"{eval_model(model, CONFIG, [f'seed={args.seed}']):.3f}"
    )
    print(warm_line, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[int, bool], RunResult] = {}
    cmds: list[str] = []
    t_all = time.perf_counter()
    with (
        runs_dir(args.runs_dir, prefix="areal-bench-abl-") as tmp,
        EmbeddedNats(store_dir=Path(tmp) / "nats") as server,
    ):
        for eta, dec in modes:
            run_id = f"abl-e{eta}-{'dec' if dec else 'std'}-{int(time.time())}"
            ov = mode_overrides(eta, dec, steps, args.seed)
            print(f"\n[{label(eta, dec)}] load {cpu_load()}", flush=True)
            r = run_areal(label(eta, dec), CONFIG, Path(tmp) / run_id, server.url, run_id, ov)
            r.eval_reward = eval_final(r, CONFIG, ov)
            cmds.append(show_cmd(r.cmd))
            print(f"  $ {cmds[-1]}")
            print(f"  -> {md_table(HEADER, [row(eta, dec, r)]).splitlines()[-1]}", flush=True)
            results[(eta, dec)] = r
    total_s = time.perf_counter() - t_all

    table = md_table(HEADER, [row(eta, dec, results[(eta, dec)]) for eta, dec in modes])
    loads = ", ".join(
        f"{label(e, d)}: {r.load_before:.1f}->{r.load_after:.1f}" for (e, d), r in results.items()
    )
    png = args.out / "staleness_ablation.png"
    plot(results, png, steps)
    curves = {
        label(e, d): [
            {k: x.get(k) for k in ("step", "wall_s", "reward_mean", "staleness_max")}
            for x in r.records
        ]
        for (e, d), r in results.items()
    }
    (args.out / "staleness_ablation.json").write_text(json.dumps(curves))
    md = "\n".join(
        [
            "# Staleness ablation (η x decoupled PPO)",
            "",
            header,
            warm_line,
            code_note(list(results.values())),
            f"- total bench time: {total_s / 60:.1f} min; 1-min load before->after each run: "
            f"{loads}",
            "",
            table,
            "",
            "Columns: final reward = mean reward_mean of the last 10 steps; eval reward = mean "
            "reward of the final policy on 512 fixed held-out tasks sampled at the training "
            "temperature (same tasks for every mode); wall s = trainer "
            "wall time to the last step; samples/s = trained samples / wall s; max staleness "
            "seen = max over steps of `staleness_max` (policy versions between a sample's "
            "oldest token and the trained version); dropped stale = groups dropped by the "
            "intake check; imp-weight masked frac / clipfrac / trainer idle = means over steps.",
            "",
            f"![reward curves]({png.name})",
            "",
            "Commands (one private nats-server for all runs, a distinct run_id each):",
            "",
            "```",
            *cmds,
            "```",
            "",
        ]
    )
    (args.out / "staleness_ablation.md").write_text(md)
    print("\n" + table)
    print(f"\ntotal {total_s / 60:.1f} min; wrote {args.out / 'staleness_ablation.md'}, {png}")
    return 0 if all(r.ok for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
