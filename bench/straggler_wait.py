"""Async η=1 with and without the straggler wait (`algo.straggler_wait_s`), interleaved.

The workload and core split of `bench/async_vs_sync.py`'s `async-η1-int-ffd` mode (the long-
tailed running sums on the `small` preset, rollout on core 0, trainer and the rest on core 1),
run `--repeats` times with `straggler_wait_s=0` (a batch takes the B oldest complete groups and
leaves older tasks still generating behind; they arrive stale and are dropped) and with the
default wait (a batch waits for them). Per run: trainer wall time, time to two rolling-10-step
rewards, final reward (last 10 steps), held-out eval reward of the final policy, groups dropped
stale, trained and generated tokens (generated counts the dropped groups' too), and the mean
answer length trained on.

    python bench/straggler_wait.py [--seed 1] [--repeats 2] [--targets 0.25,0.29]

Writes <out>/straggler_wait<tag>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench/_common.py, bench/_rl.py, the repo

from _common import RESULTS_DIR, machine_header, md_table  # noqa: E402
from _rl import (  # noqa: E402
    LONG_WORKLOAD,
    code_state,
    cpu_load,
    eval_final,
    mean,
    pin_pid,
    pin_roles,
    prewarm,
    run_areal,
    runs_dir,
    time_to_target,
)
from async_vs_sync import CONFIG, ROLLOUT_CORE, TRAINER_CORE, build_modes  # noqa: E402

HEADER = [
    "straggler_wait_s",
    "repeat",
    "wall s",
    "t→{0} s",
    "t→{1} s",
    "final reward",
    "eval reward",
    "dropped stale",
    "trained tokens",
    "generated tokens",
    "mean answer len",
    "load before",
]


def generated_tokens(out: Path) -> int | None:
    """Output tokens the rollout published (trained or not), from its `rollout_stopped` line."""
    log = out / "logs" / "rollout-0.log"
    found = re.findall(r"rollout_stopped.*?\btokens=(\d+)", log.read_text()) if log.exists() else []
    return int(found[-1]) if found else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--waits", default="0,30", help="comma list of straggler_wait_s values")
    ap.add_argument("--targets", default="0.25,0.29", help="two rolling-10-step rewards")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    ap.add_argument("--runs-dir", type=Path, default=None, help="keep run dirs here")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    waits = [float(w) for w in args.waits.split(",")]
    targets = [float(t) for t in args.targets.split(",")][:2]
    mode = next(m for m in build_modes(False) if m.name == "async-η1-int-ffd")
    base = [*mode.overrides, f"seed={args.seed}", f"train.total_steps={args.steps}"]
    header = machine_header(
        {
            "workload": f"async-η1-int-ffd of bench/async_vs_sync.py: {' '.join(LONG_WORKLOAD)}, "
            f"B=16, G=8, {args.steps} steps, seed {args.seed}; rollout -> core 0, trainer, "
            "controller, reward, launcher and nats-server -> core 1",
            "code": code_state(),
        }
    )
    print(header, flush=True)
    prewarm(CONFIG, [*LONG_WORKLOAD, f"seed={args.seed}"])
    from areal.bus.embedded import EmbeddedNats

    rows, raw = [], []
    with (
        runs_dir(args.runs_dir, prefix="areal-bench-straggler-") as tmp,
        EmbeddedNats(store_dir=Path(tmp) / "nats") as server,
    ):
        for rep in range(args.repeats):
            for w in waits:  # interleaved: each repeat runs every setting once
                ov = [*base, f"algo.straggler_wait_s={w:g}"]
                run_id = f"straggler-w{w:g}-r{rep}-{int(time.time())}"
                out = Path(tmp) / run_id
                load = cpu_load()
                pin_pid(server.proc.pid, TRAINER_CORE)
                pinned = [*ov, *pin_roles(ROLLOUT_CORE, TRAINER_CORE, TRAINER_CORE)]
                r = run_areal(run_id, CONFIG, out, server.url, run_id, pinned)
                ev = eval_final(r, CONFIG, ov)
                s = json.loads((out / "summary.json").read_text())
                ttt = [time_to_target(r, t) for t in targets]
                rec = {
                    "straggler_wait_s": w,
                    "repeat": rep,
                    "wall_s": r.wall_s,
                    "t_to_targets": ttt,
                    "final_reward": mean(r.rewards()[-10:]),
                    "eval_reward": ev,
                    "dropped_stale": s["dropped_stale"],
                    "trained_tokens": s["tokens"],
                    "generated_tokens": generated_tokens(out),
                    "answer_len": s["tokens"] / max(1, s["samples"]),
                    "load": load,
                }
                print(rec, flush=True)
                raw.append(rec)
                rows.append(
                    [
                        f"{w:g}",
                        rep,
                        f"{r.wall_s:.1f}",
                        *(f"{t:.1f}" if t is not None else "-" for t in ttt),
                        f"{rec['final_reward']:.3f}",
                        f"{ev:.3f}" if ev is not None else "-",
                        s["dropped_stale"],
                        s["tokens"],
                        rec["generated_tokens"] if rec["generated_tokens"] is not None else "-",
                        f"{rec['answer_len']:.1f}",
                        load.split(" / ")[0],
                    ]
                )
    head = [h.format(*targets) for h in HEADER]
    text = f"# Straggler wait, async η=1\n\n{header}\n\n{md_table(head, rows)}\n"
    cmd = "python bench/straggler_wait.py " + " ".join(sys.argv[1:])
    text += f"\nCommand: `{cmd.strip()}`\n"
    args.out.mkdir(parents=True, exist_ok=True)
    md = args.out / f"straggler_wait{args.tag}.md"
    md.write_text(text)
    (args.out / f"straggler_wait{args.tag}.json").write_text(json.dumps(raw, indent=1))
    print("\n" + text + f"\nwrote {md}")


if __name__ == "__main__":
    main()
