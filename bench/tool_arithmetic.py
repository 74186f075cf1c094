"""An agent learning to use a tool, against the same model without it: the built-in tiny model
on a*b+c (2-digit a and b) with the `calc` tool (`examples/tool_arithmetic.yaml`), and the
same task, warm start and reward in one generation without the tool
(`examples/tool_arithmetic_no_tool.yaml`).

    python bench/tool_arithmetic.py                  # seed 0: both runs, ~5 minutes on 2 cores
    python bench/tool_arithmetic.py --seeds 0 1 2    # interleaved: tool, no tool, per seed

What it does: builds (or finds cached) the warm-started model of each seed first, so the runs'
wall times leave it out; then, per seed, runs both configs with `areal run` on one private
nats-server, one after the other. From each run's `metrics.jsonl` it reads, per step, the
training reward, `tool_ok_frac` (episodes that called the tool and whose every call ran) and
`tool_call_frac` (episodes that called it), and prints a table of their means over the first
and the last 5 steps with the RL loop's wall time (the trainer's `wall_s`) and the whole
run's. Writes tool_arithmetic.{md,json,png} to the results dir (bench/_common.py).

Nothing here is tuned to a result: the numbers are whatever the runs produced.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, RESULTS_DIR, machine_header, md_table  # noqa: E402
from _rl import RunResult, run_areal, show_cmd  # noqa: E402

CONFIGS = {  # from the repository root, where the runs start
    "calc tool": Path("examples/tool_arithmetic.yaml"),
    "no tool": Path("examples/tool_arithmetic_no_tool.yaml"),
}
PNG = RESULTS_DIR / "tool_arithmetic.png"  # docs/img/ holds the one the docs show
STEP_KEYS = (  # what the JSON keeps of each step record
    "step",
    "wall_s",
    "reward_mean",
    "tool_ok_frac",
    "tool_call_frac",
    "tool_error_frac",
    "turns_mean",
    "masked_token_frac",
    "truncated_frac",
    "staleness_max",
)
COLORS = {"calc tool": "tab:blue", "no tool": "tab:red"}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _col(res: RunResult, key: str) -> list[float]:
    return [float(r.get(key, 0.0)) for r in res.records]


def warm_model(config: Path, seed: int, overrides: list[str]) -> tuple[str, float]:
    """The run's warm-started model dir (built now when not cached) and the seconds it took."""
    from areal.config import load_settings
    from areal.launch.worker import resolve_model_path

    t0 = time.perf_counter()
    path = resolve_model_path(load_settings(REPO_ROOT / config, [*overrides, f"seed={seed}"]))
    return path, time.perf_counter() - t0


def _plot(runs: list[tuple[str, int, RunResult]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from areal.monitor.plots import rolling_mean

    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    seeds = sorted({seed for _, seed, _ in runs})
    styles = ["-", "--", ":", "-."]
    for name, seed, res in runs:
        if not res.records:
            continue
        steps = [int(r["step"]) for r in res.records]
        style = {"color": COLORS[name], "ls": styles[seeds.index(seed) % len(styles)]}
        label = f"{name}, seed {seed}"
        ax_r.plot(steps, rolling_mean(_col(res, "reward_mean"), 5), label=label, **style)
        ax_t.plot(steps, rolling_mean(_col(res, "tool_ok_frac"), 5), label=label, **style)
    ax_r.set_title("training reward (rolling mean of 5 steps)")
    ax_t.set_title("episodes whose tool call ran (rolling mean of 5 steps)")
    for ax in (ax_r, ax_t):
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle("built-in tiny model on a*b+c, with and without the calc tool (2-core CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--timeout-min", type=float, default=20.0, help="hang guard per run")
    ap.add_argument("--png", type=Path, default=PNG)
    args = ap.parse_args()

    from areal.bus.embedded import EmbeddedNats

    builds = []
    for seed in args.seeds:  # both configs share the task, so one warm model per seed
        path, secs = warm_model(CONFIGS["calc tool"], seed, args.overrides)
        builds.append(f"seed {seed}: {Path(path).name} ({secs:.0f} s, cached afterwards)")
    header = machine_header({"warm start": "; ".join(builds)})
    runs: list[tuple[str, int, RunResult]] = []
    tmp = Path(tempfile.mkdtemp(prefix="areal-tool-arith-"))
    with EmbeddedNats(store_dir=tmp / "nats") as server:
        for seed in args.seeds:
            for name, config in CONFIGS.items():
                tag = name.replace(" ", "-")
                res = run_areal(
                    name,
                    config,
                    tmp / f"{tag}-s{seed}",
                    server.url,
                    f"tool-arith-{tag}-s{seed}",
                    [*args.overrides, f"seed={seed}"],
                    timeout_s=args.timeout_min * 60,
                )
                runs.append((name, seed, res))
                print(f"{name}, seed {seed}: exit {res.rc}, {len(res.records)} steps")
    rows, data = [], []
    for name, seed, res in runs:
        reward, ok, called = (
            _col(res, k) for k in ("reward_mean", "tool_ok_frac", "tool_call_frac")
        )
        row = {
            "config": name,
            "seed": seed,
            "steps": len(res.records),
            "reward_first5": _mean(reward[:5]),
            "reward_last5": _mean(reward[-5:]),
            "tool_ok_first5": _mean(ok[:5]),
            "tool_ok_last5": _mean(ok[-5:]),
            "tool_call_first5": _mean(called[:5]),
            "tool_call_last5": _mean(called[-5:]),
            "rl_wall_s": res.summary.get("wall_s") if res.summary else None,
            "process_wall_s": res.process_wall_s,
            "rc": res.rc,
            "cmd": show_cmd(res.cmd),
        }
        slim = [{k: r[k] for k in STEP_KEYS if k in r} for r in res.records]
        data.append({**row, "steps_records": slim, "summary": res.summary})
        rows.append(
            [
                name,
                seed,
                row["steps"],
                f"{row['reward_first5']:.3f} → {row['reward_last5']:.3f}",
                f"{row['tool_ok_first5']:.2f} → {row['tool_ok_last5']:.2f}",
                f"{row['tool_call_first5']:.2f} → {row['tool_call_last5']:.2f}",
                "-" if row["rl_wall_s"] is None else f"{row['rl_wall_s']:.0f}",
                f"{row['process_wall_s']:.0f}",
            ]
        )
    table = md_table(
        [
            "config",
            "seed",
            "steps",
            "reward, first 5 → last 5 steps",
            "tool call ran",
            "tool called",
            "RL loop (s)",
            "whole run (s)",
        ],
        rows,
    )
    md = "\n".join(
        [
            "# Tool use: the tiny model with and without the calc tool",
            "",
            header,
            *[f"- run: `{r['cmd']}`" for r in data],
            "",
            table,
            "",
        ]
    )
    RESULTS_DIR.mkdir(exist_ok=True)
    stem = RESULTS_DIR / "tool_arithmetic"
    stem.with_suffix(".md").write_text(md)
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1))
    _plot(runs, args.png)
    print(md)
    print(f"wrote {stem}.md, {stem}.json, {args.png}; the runs' dirs are under {tmp}")
    return 0 if all(res.rc == 0 for _, _, res in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
