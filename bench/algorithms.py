"""The algorithm registry side by side: every `algo.loss` x `algo.advantage` entry on the
quickstart and on running sums, and the staleness ablation for GRPO and GSPO.

Two parts, whole `areal run` jobs on one private nats-server, the same steps (so the same
number of trained samples) in every run of a task:
- grid: `algo.loss` in {ppo, gspo} x `algo.advantage` in {grpo, dr_grpo, rloo, reinforce_pp} on
  `examples/arithmetic.yaml` (the quickstart) and `examples/running_sum.yaml`, at each
  example's own η;
- staleness: η in {0, 1, 4, 16} x loss in {ppo, gspo} (advantage grpo) on the quickstart
  (η = 0 with `rollout.interruptible=false`: truly synchronous).
Every run is repeated for each `--seeds` seed (seeds outermost: a partial sitting holds whole
seeds).

Per run: time to target (trainer wall time at the first step whose 10-step rolling mean reward
reaches the task's target: 90% of the mean final reward of the ppo x grpo runs of that task,
the default recipe), final reward (mean of the last 10 steps) and held-out accuracy of the final
policy (`eval_final`: 512 fixed tasks at the run's temperature, the same tasks in every run).
The table shows the mean over seeds and each seed's value.

    python bench/algorithms.py [--seeds 0,1] [--part grid,staleness] [--quick] [--out DIR]

Runs that finished in `<out>/algorithms_runs.jsonl` are not run again (a sitting can be resumed,
a failed run is retried; start a new sitting with --fresh). Writes <out>/algorithms.md, .json, .png
(and keeps the sitting's header in <out>/algorithms_sitting.json).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench/_common.py, bench/_rl.py, the repo

from _common import REPO_ROOT, RESULTS_DIR, machine_header, md_table  # noqa: E402
from _rl import (  # noqa: E402
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

LOSSES = ("ppo", "gspo")
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
ETAS = (0, 1, 4, 16)
TASKS = {  # name -> (example, train.total_steps)
    "quickstart": (REPO_ROOT / "examples" / "arithmetic.yaml", 100),
    "running_sum": (REPO_ROOT / "examples" / "running_sum.yaml", 60),
}
QUICK_STEPS = 12
TARGET_FRAC = 0.9  # of the default recipe's mean final reward
ROLL = 10  # steps of the rolling mean that time to target and final reward read


@dataclass(frozen=True)
class Spec:
    part: str  # grid | staleness
    task: str
    loss: str
    advantage: str
    eta: int | None  # None: the example's own
    seed: int

    @property
    def key(self) -> str:
        eta = "" if self.eta is None else f"-e{self.eta}"
        return f"{self.part}-{self.task}-{self.loss}-{self.advantage}{eta}-s{self.seed}"

    def overrides(self, steps: int) -> list[str]:
        o = [
            f"seed={self.seed}",
            f"train.total_steps={steps}",
            f"algo.loss={self.loss}",
            f"algo.advantage={self.advantage}",
        ]
        if self.eta is not None:
            o.append(f"algo.max_staleness={self.eta}")
            if self.eta == 0:
                o.append("rollout.interruptible=false")
        return o


@dataclass
class Outcome:
    """What the report needs of one finished run (one line of algorithms_runs.jsonl)."""

    key: str
    spec: dict
    ok: bool
    rc: int
    cmd: str
    code: str
    load_before: float
    load_after: float
    wall_s: float
    rewards: list[float]
    wall_at_step: list[float]
    eval_reward: float | None

    def final(self) -> float:
        return mean(self.rewards[-ROLL:]) if self.rewards else math.nan

    def time_to(self, target: float) -> float | None:
        for i, m in enumerate(rolling(self.rewards, ROLL)):
            if i + 1 >= ROLL and m >= target:
                return self.wall_at_step[i]
        return None


def plan(parts: list[str], seeds: list[int]) -> list[Spec]:
    specs = []
    for seed in seeds:
        if "grid" in parts:
            for task in TASKS:
                for loss in LOSSES:
                    for adv in ADVANTAGES:
                        specs.append(Spec("grid", task, loss, adv, None, seed))
        if "staleness" in parts:
            for loss in LOSSES:
                for eta in ETAS:
                    specs.append(Spec("staleness", "quickstart", loss, "grpo", eta, seed))
    return specs


def run_one(spec: Spec, steps: int, tmp: Path, nats_url: str) -> Outcome:
    config = TASKS[spec.task][0]
    ov = spec.overrides(steps)
    run_id = f"alg-{spec.key}-{int(time.time())}"
    r = run_areal(spec.key, config, tmp / run_id, nats_url, run_id, ov)
    ev = eval_final(r, config, ov) if r.ok else None
    return Outcome(
        key=spec.key,
        spec=asdict(spec),
        ok=r.ok,
        rc=r.rc,
        cmd=show_cmd(r.cmd),
        code=r.code,
        load_before=r.load_before,
        load_after=r.load_after,
        wall_s=r.wall_s if r.ok else math.nan,
        rewards=r.rewards(),
        wall_at_step=[float(x["wall_s"]) for x in r.records],
        eval_reward=ev,
    )


def targets(outcomes: dict[str, Outcome]) -> dict[str, float]:
    """Per task: TARGET_FRAC of the mean final reward of its ppo x grpo grid runs."""
    out = {}
    for task in TASKS:
        finals = [
            o.final()
            for o in outcomes.values()
            if o.ok and o.spec["task"] == task and o.spec["loss"] == "ppo"
            if o.spec["advantage"] == "grpo" and o.spec["part"] == "grid"
        ]
        if finals:
            out[task] = TARGET_FRAC * mean(finals)
    return out


def _cell(values: list[float | None], fmt: str) -> str:
    """Mean over seeds, then each seed's value; '-' for a seed that never got there."""
    got = [v for v in values if v is not None and not math.isnan(v)]
    each = "/".join("-" if v is None or math.isnan(v) else format(v, fmt) for v in values)
    if not got:
        return f"- ({each})" if len(values) > 1 else "-"
    head = format(mean(got), fmt) + (
        "" if len(got) == len(values) else f" [{len(got)} of {len(values)}]"
    )
    return f"{head} ({each})" if len(values) > 1 else head


def table(rows_of: list[tuple[str, list[Outcome]]], target: dict[str, float]) -> str:
    header = ["run", "time to target s", "final reward (last 10)", "held-out accuracy", "wall s"]
    rows = []
    for label, outs in rows_of:
        task = outs[0].spec["task"]
        t = target.get(task)
        rows.append(
            [
                label,
                _cell([o.time_to(t) if (o.ok and t is not None) else None for o in outs], ".1f"),
                _cell([o.final() if o.ok else None for o in outs], ".3f"),
                _cell([o.eval_reward for o in outs], ".3f"),
                _cell([o.wall_s if o.ok else None for o in outs], ".0f"),
            ]
        )
    return md_table(header, rows)


def grouped(outcomes: dict[str, Outcome], specs: list[Spec], part: str, task: str | None = None):
    """[(label, outcomes over seeds)] for one part (and task), in plan order."""
    by: dict[str, list[Outcome]] = {}
    for s in specs:
        if s.part != part or (task is not None and s.task != task) or s.key not in outcomes:
            continue
        label = f"{s.loss} x {s.advantage}" if part == "grid" else f"{s.loss}, η={s.eta}"
        by.setdefault(label, []).append(outcomes[s.key])
    return list(by.items())


def plot(outcomes: dict[str, Outcome], path: Path, seed: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = dict(zip(ADVANTAGES, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=True))
    eta_colors = dict(zip(ETAS, ("black", "tab:blue", "tab:orange", "tab:red"), strict=True))
    for o in outcomes.values():
        s = o.spec
        if not o.ok or s["seed"] != seed:
            continue
        style = dict(ls="-" if s["loss"] == "ppo" else "--", lw=1.3)
        y = rolling(o.rewards, ROLL)
        if s["part"] == "grid":
            ax = axes[0 if s["task"] == "quickstart" else 1]
            ax.plot(
                o.wall_at_step,
                y,
                color=colors[s["advantage"]],
                **style,
                label=f"{s['loss']} x {s['advantage']}",
            )
        else:
            axes[2].plot(
                o.wall_at_step,
                y,
                color=eta_colors[s["eta"]],
                **style,
                label=f"{s['loss']} η={s['eta']}",
            )
    for ax, title in zip(
        axes, ("quickstart", "running sums", "staleness (quickstart)"), strict=True
    ):
        ax.set_title(title)
        ax.set_xlabel("trainer wall time (s)")
        ax.set_ylabel(f"reward (rolling mean, {ROLL} steps)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"Loss x advantage entries, seed {seed} (solid: ppo, dashed: gspo)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_done(path: Path) -> dict[str, Outcome]:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                o = Outcome(**json.loads(line))
                if o.ok:  # a failed run is run again
                    done[o.key] = o
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1", help="comma list (default 0,1)")
    ap.add_argument("--part", default="grid,staleness", help="grid, staleness or both")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per run (smoke)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="results dir")
    ap.add_argument("--runs-dir", type=Path, help="keep run dirs here (default: a temp dir)")
    ap.add_argument("--fresh", action="store_true", help="forget the runs of an earlier sitting")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    parts = args.part.split(",")
    specs = plan(parts, seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "algorithms_runs.jsonl"
    if args.fresh:
        log_path.unlink(missing_ok=True)
    outcomes = load_done(log_path)

    from areal.bus.embedded import EmbeddedNats

    steps_of = {t: (QUICK_STEPS if args.quick else s) for t, (_, s) in TASKS.items()}
    header = machine_header(
        {
            "workload": "; ".join(
                f"{t}: {c.relative_to(REPO_ROOT)}, {steps_of[t]} steps"
                for t, (c, _) in TASKS.items()
            )
            + f"; seeds {seeds}",
            "busiest processes at start": top_other_processes(),
            "code": code_state(),
        }
    )
    # the sitting's header and start are the first invocation's; a resume only adds runs
    sitting_path = args.out / "algorithms_sitting.json"
    if outcomes and sitting_path.exists():
        sitting = json.loads(sitting_path.read_text())
    else:
        sitting = {"header": header, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        sitting_path.write_text(json.dumps(sitting))
    header = sitting["header"]
    print(header, flush=True)
    warm = []  # the starting point: the warm-start model's held-out accuracy, per task and seed
    for task, (config, _) in TASKS.items():
        model = prewarm(config, ["seed=0"])
        accs = [eval_model(model, config, [f"seed={seed}"]) for seed in seeds]
        warm.append(f"{task} {'/'.join(f'{a:.3f}' for a in accs)}")
        print(f"warm start {task}: {model}, held-out {warm[-1]}", flush=True)
    t_all = time.perf_counter()
    todo = [s for s in specs if s.key not in outcomes]
    print(f"{len(specs)} runs, {len(specs) - len(todo)} already done", flush=True)
    with (
        runs_dir(args.runs_dir, prefix="areal-bench-alg-") as tmp,
        EmbeddedNats(store_dir=Path(tmp) / "nats") as server,
    ):
        for i, spec in enumerate(todo, 1):
            print(f"\n[{i}/{len(todo)}] {spec.key}, load {cpu_load()}", flush=True)
            o = run_one(spec, steps_of[spec.task], Path(tmp), server.url)
            outcomes[o.key] = o
            with log_path.open("a") as f:
                f.write(json.dumps(asdict(o)) + "\n")
            print(
                f"  rc {o.rc}, final {o.final():.3f}, eval {o.eval_reward}, wall {o.wall_s:.0f} s",
                flush=True,
            )
    total_s = time.perf_counter() - t_all

    target = targets(outcomes)
    sections = []
    for task in TASKS:
        rows = grouped(outcomes, specs, "grid", task)
        if rows:
            t = target.get(task)
            sections += [
                f"## {task} (`{TASKS[task][0].relative_to(REPO_ROOT)}`, target "
                + (f"{t:.3f})" if t is not None else "none: no ppo x grpo run)"),
                "",
                table(rows, target),
                "",
            ]
    rows = grouped(outcomes, specs, "staleness")
    if rows:
        sections += ["## Staleness (quickstart, advantage grpo)", "", table(rows, target), ""]
    png = args.out / "algorithms.png"
    if any(o.ok for o in outcomes.values()):
        plot(outcomes, png, seeds[0])
    loads = [o.load_before for o in outcomes.values()] + [o.load_after for o in outcomes.values()]
    codes = sorted({o.code for o in outcomes.values()})
    md = "\n".join(
        [
            "# Loss x advantage entries and staleness",
            "",
            header,
            f"- code the runs started from: {'; '.join(codes)}",
            f"- warm start (step 0), held-out accuracy per seed: {'; '.join(warm)}",
            f"- sitting from {sitting['started']} to "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({len(todo)} runs in the "
            f"last invocation, {total_s / 60:.1f} min); 1-min load over the runs "
            f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f}",
            "",
            "Cells: mean over seeds (each seed's value in brackets; '[k of n]' when only k seeds "
            f"reached the target). Time to target: trainer wall s at the first step whose "
            f"{ROLL}-step rolling mean reward reaches {TARGET_FRAC:.0%} of the ppo x grpo runs' "
            "mean final reward on that task. Final reward: mean of the last 10 steps. Held-out "
            "accuracy: the final policy's mean reward on 512 fixed tasks at the run's "
            "temperature.",
            "",
            *sections,
            f"![reward curves]({png.name})",
            "",
            "Commands (one private nats-server for all runs, a distinct run_id each):",
            "",
            "```",
            *[outcomes[s.key].cmd for s in specs if s.key in outcomes],
            "```",
            "",
        ]
    )
    (args.out / "algorithms.md").write_text(md)
    (args.out / "algorithms.json").write_text(
        json.dumps({k: asdict(o) for k, o in outcomes.items()})
    )
    print("\n" + "\n".join(sections))
    print(f"wrote {args.out / 'algorithms.md'}")
    return 0 if all(o.ok for o in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
