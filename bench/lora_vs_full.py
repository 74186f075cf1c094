"""LoRA beside the full fine-tune on SmolLM2-135M: held-out accuracy against wall time, in one
sitting on one machine.

    python bench/lora_vs_full.py                      # 2 runs, 40 minutes each at most
    python bench/lora_vs_full.py --budget-min 10 --set train.total_steps=8   # a short look

Runs `examples/smollm2_gsm.yaml` (full fine-tune) and `examples/smollm2_gsm_lora.yaml` (the
same run with `train.lora`: r 16 on q/k/v/o, its own learning rate) one after the other through
`bench/real_model.py`'s `measure` (a private nats-server each, greedy held-out rounds at every
K-th version while training goes on), with the same `--set`s and the same budget. Writes
lora_vs_full.md/.json/.png to the results dir: per arm the accuracy at each evaluated version
with its wall time, steps, seconds per step, weight-publish time per step and the trainer's
checkpoint time, and both curves in one plot.

Nothing here is tuned to a result: the numbers are whatever the runs produced.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, RESULTS_DIR, machine_header, md_table  # noqa: E402
from real_model import eval_table, measure, train_line  # noqa: E402

ARMS = {
    "full fine-tune": REPO_ROOT / "examples" / "smollm2_gsm.yaml",
    "LoRA r16 q/k/v/o": REPO_ROOT / "examples" / "smollm2_gsm_lora.yaml",
}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summary_row(arm: str, m: dict) -> list[object]:
    steps = m["steps"]
    evals = [r for r in m["eval"] if r["wall_s"] is not None]
    last = evals[-1] if evals else None
    wall = float(steps[-1]["wall_s"]) if steps else float("nan")
    return [
        arm,
        len(steps),
        f"{wall:.0f}",
        f"{wall / len(steps):.1f}" if steps else "-",
        f"{_mean([float(r['train_s']) for r in steps]):.2f}",
        f"{_mean([float(r['weights_publish_s']) for r in steps]):.3f}",
        f"{_mean([float(r['checkpoint_s']) for r in steps]):.2f}",
        f"{evals[0]['accuracy']:.3f}" if evals else "-",
        f"{last['accuracy']:.3f} (v{last['version']})" if last else "-",
        f"{max(r['accuracy'] for r in evals):.3f}" if evals else "-",
    ]


HEADER = [
    "arm",
    "steps",
    "wall s",
    "s / step",
    "train s / step",
    "publish s / step",
    "checkpoint s / step",
    "held-out v0",
    "held-out last",
    "held-out best",
]


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (arm, m), color in zip(results.items(), ("tab:orange", "tab:green"), strict=False):
        pts = [(r["wall_s"] / 60, r["accuracy"]) for r in m["eval"] if r["wall_s"] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, lw=2, label=arm)
    ax.set_xlabel("wall time (min)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    ax.set_title("SmolLM2-135M: LoRA beside the full fine-tune (2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--budget-min", type=float, default=40.0, help="wall-clock cap of each run")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--name", default="lora_vs_full", help="results file stem")
    args = ap.parse_args()

    header = machine_header({"arms": "; ".join(f"{a}: {c.name}" for a, c in ARMS.items())})
    print(header, flush=True)
    results = {}
    for arm, config in ARMS.items():
        print(f"\n[{arm}] {config.name}", flush=True)
        results[arm] = measure(
            config, args.budget_min, args.overrides, f"lora-vs-full-{config.stem}"
        )
        print(train_line(results[arm]), flush=True)
    sections = []
    for arm, m in results.items():
        sections += [
            f"## {arm}",
            "",
            f"- run: `{m['cmd']}`",
            train_line(m),
            "",
            eval_table(m["eval"]),
            "",
        ]
    md = "\n".join(
        [
            "# LoRA beside the full fine-tune: SmolLM2-135M-Instruct, asynchronous RL on CPU",
            "",
            header,
            "",
            md_table(HEADER, [summary_row(arm, m) for arm, m in results.items()]),
            "",
            *sections,
        ]
    )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = RESULTS_DIR / args.name
    stem.with_suffix(".md").write_text(md)
    stem.with_suffix(".json").write_text(
        json.dumps(
            {a: {k: v for k, v in m.items() if k != "log_tail"} for a, m in results.items()},
            indent=1,
        )
    )
    plot(results, stem.with_suffix(".png"))
    print(md)
    failed = [a for a, m in results.items() if not m["eval"]]
    for a in failed:
        print(
            f"{a}: no evaluation round; launcher log tail:\n{results[a]['log_tail']}",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
