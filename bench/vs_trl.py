"""areal-bus vs TRL's GRPOTrainer on the same model, data, reward and hyper-parameters (issue 17).

Both systems start from the same warm-started model dir (`prewarm`), draw the same tasks in the
same order (item k of the controller's task source is task k; TRL with `shuffle_dataset=False`
and a dataset of exactly `B * total_steps` prompts rendered by areal's `PromptBuilder`), score
with the same reward function (`get_reward_fn(settings.reward_fn_name())`, wrapped for TRL) and
are evaluated the same way: the final model on 512 fixed held-out tasks at the rollout
temperature (`eval_final` / `eval_model`). Each run is a whole process (`areal run ...`, or
`python bench/_trl_grpo.py ...` for TRL), so start-up is timed the same way. Repeats are
interleaved (areal, TRL, TRL, areal, ...) so drifting load hits both alike.

Settings mapping (areal `RunSettings` -> `GRPOConfig`, in `_trl_grpo.grpo_kwargs`):
- B x G: `algo.batch_size` x `algo.group_size` -> `num_generations=G`,
  `per_device_train_batch_size = B*G / n_minibatches` completions,
  `steps_per_generation = train.n_minibatches`, `gradient_accumulation_steps=1`,
  `num_iterations=1`, `max_steps = total_steps * n_minibatches`. So one TRL generation batch is
  B prompts x G completions (one areal step) and is cut into `n_minibatches` slices with one
  AdamW step each, like areal's minibatches. (`num_iterations=2` would instead take two steps
  over the *whole* batch, PPO epochs, which is not what `n_minibatches` does.) TRL then keeps
  the generation-time log-probs as `old_per_token_logps` for the PPO ratio of the second slice,
  as areal recomputes `prox_logp`. A "step" in the table and the plot is one such batch for both.
- sampling: `rollout.max_new_tokens` -> `max_completion_length`, `temperature`, `top_p`,
  `top_k=0`; stop ids = areal's `stop_token_ids` (set as the model's generation eos).
- objective: `beta=0.0` (no KL term, no reference model; areal has none), `epsilon` /
  `epsilon_high` = `algo.eps_clip_low` / `eps_clip_high`, `scale_rewards="group"` for
  `algo.advantage: grpo` ("none" for dr_grpo), `loss_type="dapo"` (token sum / active tokens,
  as areal's loss).
- optimizer: `optim="adamw_torch"`, `learning_rate = train.lr`, `lr_scheduler_type="constant"`
  (areal has no schedule; TRL's default is linear decay), `warmup_steps=0`,
  `weight_decay = train.weight_decay`, `max_grad_norm = train.grad_clip`, fp32
  (`bf16=False`: GRPOConfig defaults to bf16), `gradient_checkpointing=False` (its default
  is True), `seed = seed`, `use_cpu`.
- threads: TRL is one process with `--trl-threads` torch threads (default 1, like each areal
  worker); areal runs rollout and trainer as separate processes, one thread each, so it may
  use two cores where TRL uses one. That is the architecture under test, not a setting.
Differences that remain: areal's decoupled PPO (proximal policy, importance-weight cap 5) and
asynchrony (η = `algo.max_staleness`) vs TRL's synchronous on-policy loop; TRL's group std is
Bessel-corrected (areal's is the population std: advantages differ by sqrt(G/(G-1)), 1.07 at
G=8) with eps 1e-4 instead of areal's; TRL shuffles a generation batch before slicing it,
areal's minibatches are contiguous; TRL's "dapo" divides a slice's token sum by the generation
batch's tokens / n_minibatches, areal by the minibatch's own tokens (equal on average).

Workloads (`--workload`): `quickstart` = examples/arithmetic.yaml as is (tiny model, 1-2 digit
addition, B=16, G=8, T=1.5, lr 3e-4, 2 minibatches, 150 steps, max_new_tokens 6); `long` =
`_rl.LONG_WORKLOAD`, the long-generation one of bench/async_vs_sync.py (small preset,
`synthetic:running_sum` with up to 12 terms and a long tail, label-smoothed warm start,
max_new_tokens 96, the quickstart's T=1.5 and lr 3e-4, 60 steps), where sampling dominates and
TRL's padded batch generation waits for its longest completion.

With `--paired-seeds`, repeat r runs both systems with seed `--seed`+r: TRL with one seed is
deterministic (its repeats give one eval, a single draw of its seed-to-seed spread), so paired
seeds are what compares the two systems' accuracy. The report gives each system's mean eval
over repeats with its standard error, and the paired difference with its standard error.

Per system (median over repeats): start-up (process spawn -> trainer start; for areal the
trainer start is the metrics file's last write minus the last step's `wall_s`), trainer wall
time to each reward threshold (rolling 10-step mean), trainer wall time, samples/s, final
reward (last 10 steps), held-out accuracy of the final model.

    python bench/vs_trl.py [--quick] [--workload quickstart|long|both] [--repeats N]
                           [--paired-seeds]

Writes <out>/vs_trl{,_long}.md, .png (reward vs wall time) and .json (per-step curves).
Needs `pip install trl` (tested with trl 1.16.0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench/_common.py, bench/_rl.py, the repo

from _common import REPO_ROOT, RESULTS_DIR, machine_header  # noqa: E402
from _rl import (  # noqa: E402
    LONG_WORKLOAD,
    RunResult,
    code_note,
    code_state,
    cpu_load,
    eval_final,
    eval_model,
    mean,
    prewarm,
    run_areal,
    runs_dir,
    show_cmd,
    time_to_target,
    top_other_processes,
    warm_line,
)
from _vs_trl_report import (  # noqa: E402
    SYSTEMS,
    eval_lines,
    plot,
    run_table,
    summary_lines,
    summary_table,
)

CONFIG = REPO_ROOT / "examples" / "arithmetic.yaml"
EVAL_N = 512  # held-out tasks per eval (`eval_final` / `eval_model`'s default)


@dataclass(frozen=True)
class Workload:
    name: str
    tag: str  # output file suffix
    overrides: tuple[str, ...]
    steps: int
    quick_steps: int
    thresholds: tuple[float, ...]
    title: str


WORKLOADS = {
    "quickstart": Workload(
        name="quickstart",
        tag="",
        overrides=(),
        steps=150,
        quick_steps=12,
        thresholds=(0.4, 0.5, 0.6, 0.65),
        title="quickstart: examples/arithmetic.yaml (tiny model, synthetic:arithmetic)",
    ),
    "long": Workload(
        name="long",
        tag="_long",
        overrides=LONG_WORKLOAD,
        steps=60,
        quick_steps=6,
        thresholds=(0.28, 0.3, 0.32),
        title="long generation: small preset, synthetic:running_sum (long-tailed lengths)",
    ),
}


def trl_cmd(overrides: list[str], model: str, out_dir: Path, t0: float, threads: int) -> list[str]:
    cmd = [sys.executable, str(_HERE / "_trl_grpo.py"), str(CONFIG), "--model", model]
    cmd += ["--out", str(out_dir), "--t0", f"{t0:.6f}", "--threads", str(threads)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def run_trl(
    name: str, overrides: list[str], model: str, out_dir: Path, threads: int, timeout_s: float
) -> RunResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        **{k: str(threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    code, load_before = code_state(), os.getloadavg()[0]
    t0 = time.time()
    cmd = trl_cmd(overrides, model, out_dir, t0, threads)
    log = out_dir.with_name(out_dir.name + ".log")
    with open(log, "wb") as f:
        try:
            rc = subprocess.run(
                cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    res = RunResult(name, out_dir, cmd, rc, time.time() - t0, code=code)
    res.load_before, res.load_after = load_before, os.getloadavg()[0]
    metrics = out_dir / "metrics.jsonl"
    if metrics.exists():
        res.records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    if (out_dir / "summary.json").exists():
        res.summary = json.loads((out_dir / "summary.json").read_text())
    if rc != 0:
        tail = log.read_text(errors="replace")[-2000:]
        print(f"  !! {name}: TRL run exited {rc}; log tail:\n{tail}", file=sys.stderr)
    return res


def areal_startup_s(res: RunResult, t_spawn: float) -> float | None:
    """Spawn -> trainer start: the trainer appends each step's record right after computing
    its `wall_s`, so its start is the file's last write minus the last `wall_s`."""
    metrics = res.out_dir / "metrics.jsonl"
    if not res.records or not metrics.exists():
        return None
    return metrics.stat().st_mtime - float(res.records[-1]["wall_s"]) - t_spawn


def run_workload(wl: Workload, args: argparse.Namespace, server_url: str, tmp: str) -> int:
    steps = args.steps or (wl.quick_steps if args.quick else wl.steps)
    repeats = args.repeats or (1 if args.quick else 3)
    seeds = [args.seed + rep if args.paired_seeds else args.seed for rep in range(repeats)]
    ov = [*wl.overrides, f"seed={args.seed}", f"train.total_steps={steps}", *args.extra]

    def ov_of(rep: int) -> list[str]:
        return [*wl.overrides, f"seed={seeds[rep]}", f"train.total_steps={steps}", *args.extra]

    header = machine_header(
        {
            "workload": f"{wl.title}; base config {CONFIG.relative_to(REPO_ROOT)}, overrides "
            f"{' '.join(ov)}",
            "repeats": f"{repeats} per system, interleaved (areal first on even repeats)",
            "seeds": f"repeat r runs both systems with seed {args.seed}+r (paired: its own "
            "warm start, task order and sampling), so eval compares over seeds"
            if args.paired_seeds
            else f"{args.seed} for every run (TRL is then deterministic: its repeats agree)",
            "threads": f"areal: as `areal run` starts it (1 torch thread per worker, no "
            f"pinning); TRL: one process, {args.trl_threads} torch thread(s)",
            "busiest processes at start": top_other_processes(),
            "code": code_state(),
        }
    )
    print(header, flush=True)
    models = {seed: prewarm(CONFIG, ov_of(rep)) for rep, seed in enumerate(seeds)}  # untimed
    model = models[seeds[0]]
    warm = warm_line(model, CONFIG, ov)
    print(warm, flush=True)
    import trl

    runs: dict[str, list[RunResult]] = {s: [] for s in SYSTEMS}
    startup: dict[int, float | None] = {}  # id(RunResult) -> start-up s
    cmds: list[str] = []
    t_all = time.perf_counter()
    for rep in range(repeats):
        order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        for system in order:
            name = f"{system}-{rep}"
            run_id = f"vstrl{wl.tag.replace('_', '-')}-{rep}-{int(time.time())}"
            out = Path(tmp) / f"{run_id}-{system}"
            print(f"\n[{wl.name} {name}] seed {seeds[rep]}, load {cpu_load()}", flush=True)
            rov = ov_of(rep)
            if system == "areal":
                t_spawn = time.time()
                r = run_areal(name, CONFIG, out, server_url, run_id, rov, timeout_s=args.timeout)
                startup[id(r)] = areal_startup_s(r, t_spawn)
                r.eval_reward = eval_final(r, CONFIG, rov)
                shown = show_cmd(r.cmd)
            else:
                model_r = models[seeds[rep]]
                r = run_trl(name, rov, model_r, out, args.trl_threads, args.timeout)
                startup[id(r)] = r.summary.get("startup_s")
                final = out / "final"
                r.eval_reward = eval_model(final, CONFIG, rov) if final.is_dir() else None
                shown = " ".join(["python", *r.cmd[1:]])
            if rep == 0:
                cmds.append(shown)
            runs[system].append(r)
            su = startup[id(r)]
            print(
                f"  -> rc {r.rc}, start-up {su if su is None else round(su, 1)} s, trainer wall "
                f"{r.wall_s:.1f} s, {r.samples / max(r.wall_s, 1e-9):.0f} samples/s, final "
                f"{mean(r.rewards()[-10:]):.3f}, eval {r.eval_reward}, "
                + ", ".join(f"t→{t}: {time_to_target(r, t)}" for t in wl.thresholds),
                flush=True,
            )
    total_s = time.perf_counter() - t_all

    summary = summary_table(runs, startup, wl.thresholds)
    per_run = run_table(runs, startup, wl.thresholds)
    png = args.out / f"vs_trl{wl.tag}.png"
    plot(runs, startup, wl.thresholds, png, f"areal-bus vs TRL GRPOTrainer, {wl.title}")
    curves = {
        r.name: {
            "startup_s": startup[id(r)],
            "eval": r.eval_reward,
            "records": [
                {k: x.get(k) for k in ("step", "wall_s", "reward_mean", "samples", "tokens")}
                for x in r.records
            ],
        }
        for rs in runs.values()
        for r in rs
    }
    (args.out / f"vs_trl{wl.tag}.json").write_text(json.dumps(curves))
    loads = ", ".join(
        f"{r.name}: {r.load_before:.1f}->{r.load_after:.1f}" for rs in runs.values() for r in rs
    )
    md = "\n".join(
        [
            f"# areal-bus vs TRL ({wl.name})",
            "",
            header,
            f"- TRL {trl.__version__} (`trl.GRPOTrainer`, bench/_trl_grpo.py); settings mapping "
            "in bench/vs_trl.py's docstring",
            warm,
            code_note([r for rs in runs.values() for r in rs]),
            f"- total bench time: {total_s / 60:.1f} min; 1-min load before->after each run: "
            f"{loads}",
            "",
            summary,
            "",
            *summary_lines(runs, startup, wl.thresholds),
            *eval_lines(runs, EVAL_N),
            "",
            "Per run:",
            "",
            per_run,
            "",
            "Columns: start-up = process spawn -> trainer start (imports, model load, workers / "
            "trainer build; areal's trainer starts before its rollout worker is ready, so its "
            "first step also waits for the rollout's start-up); 1st step = spawn -> first step "
            "done (comparable for both); t→x = trainer wall time (from trainer start) when the rolling "
            "10-step mean reward first reaches x (add start-up for time from launch); wall = "
            "trainer start -> last step; samples/s = trained samples / wall; final reward = mean "
            "of the last 10 steps; eval = final model on 512 fixed held-out tasks at the rollout "
            "temperature (same tasks for both); process = the whole process (incl. saving the "
            "final model and shutdown). Medians over repeats; `n/r` = not reached by a repeat; "
            "a repeat that never reached x counts as slower than any that did (`k/n reached`).",
            "",
            f"![reward vs wall time]({png.name})",
            "",
            "Commands (areal: one private nats-server for all runs, a distinct run_id each):",
            "",
            "```",
            *cmds,
            "```",
            "",
        ]
    )
    (args.out / f"vs_trl{wl.tag}.md").write_text(md)
    lines = [*summary_lines(runs, startup, wl.thresholds), *eval_lines(runs, EVAL_N)]
    print("\n" + summary + "\n\n" + "\n".join(lines))
    print(f"\nwrote {args.out / f'vs_trl{wl.tag}.md'}, {png}", flush=True)
    return 0 if all(r.ok for rs in runs.values() for r in rs) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few steps, 1 repeat (smoke test)")
    ap.add_argument("--workload", choices=["quickstart", "long", "both"], default="both")
    ap.add_argument("--repeats", type=int, help="runs per system (default 3, --quick 1)")
    ap.add_argument("--steps", type=int, help="train.total_steps (default: per workload)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--paired-seeds",
        action="store_true",
        help="repeat r runs both systems with seed+r (each seed builds its warm start once, "
        "untimed): eval accuracy is then compared over seeds, not one seed's draw",
    )
    ap.add_argument("--trl-threads", type=int, default=1, help="TRL's torch threads")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="results dir")
    ap.add_argument("--runs-dir", type=Path, help="keep run dirs here (default: a temp dir)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra override")
    args = ap.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        print("bench/vs_trl.py needs TRL: pip install trl", file=sys.stderr)
        return 2
    from areal.bus.embedded import EmbeddedNats

    args.out.mkdir(parents=True, exist_ok=True)
    names = ["quickstart", "long"] if args.workload == "both" else [args.workload]
    rc = 0
    with (
        runs_dir(args.runs_dir, prefix="areal-bench-trl-") as tmp,
        EmbeddedNats(store_dir=Path(tmp) / "nats") as server,
    ):
        for n in names:
            rc |= run_workload(WORKLOADS[n], args, server.url, tmp)
    return rc


if __name__ == "__main__":
    sys.exit(main())
