"""Pool `bench/async_vs_sync.py` runs over seeds: time to target and accuracy, per seed and overall.

One seed's time to target is the crossing time of a slowly rising, noisy reward curve, so one
seed says little (2.63x and 1.34x for seeds 0 and 1 at `93d1fad`). This reads the `.md` report
each seed's run wrote (`--tag _sN`), takes per seed the fastest synchronous mode (least wall
time, as the bench's own headline does) and each async mode in it, and prints per seed: the
sync mode, its time to the seed's target, each async mode's, their ratio, the samples/s ratio
and the eval difference; then per async mode the median and the range of the ratios over seeds
and the mean eval difference with its standard error.

Where the per-step curves the bench writes beside each report (`.json`) are there, the ratio is
also split into its two factors: how much faster each step ran before the target (seconds per
step, sync over async) and how many steps each run took to get there (sync over async). The
first is what the system changes; the second is mostly how the two runs' rewards happened to
move (a rolling mean of noisy steps crossing a slowly rising target).

From the same curves, a second table sets each async run's throughput against what overlap
could give at best, over the whole run:
- trained tok/s: trained tokens (prompt + output) per second of trainer wall time, async over
  the fastest sync; unlike samples/s, it does not move with how long a run's answers are;
- ceiling: the sync run's wall time over its slower role's (its trainer's summed `train_s`, or
  the rest of the wall time, when the trainer waited for the rollout and the reward): what a
  perfect overlap of the two roles' work would give, with each role as fast as it was alone;
- async wait: the share of the async run's wall time its trainer waited for a batch;
- async ms/tok: the async trainer's time per trained token over the sync trainer's (above 1:
  it trains slower while the rollout and the other processes run beside it);
- waited steps, and the batch tail (`tail_s`: how long a batch's slowest answers held it after
  half its tasks were done) in those steps against all of the run's steps: whether the waits
  come from long tails ("-" for curves written before the bench kept `tail_s`).

    python bench/async_vs_sync_seeds.py bench/results/async_vs_sync_s*.md
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

from _common import md_table  # noqa: E402


def read_table(path: Path) -> dict[str, dict[str, str]]:
    """The report's mode table: mode name -> column -> cell."""
    lines = path.read_text().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("| mode |")), None)
    if start is None:
        raise SystemExit(f"{path}: no '| mode |' table (not an async_vs_sync report?)")
    cols = [c.strip() for c in lines[start].strip("|").split("|")]
    rows: dict[str, dict[str, str]] = {}
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = dict(zip(cols, cells, strict=True))
    return rows


def seed_of(path: Path) -> str:
    m = re.search(r"--seed (\d+)", path.read_text())
    return m.group(1) if m else path.stem


def step_at(curves: dict[str, list[dict]], mode: str, t: float | None) -> int | None:
    """The step whose trainer wall time is the mode's time to target (`t`, as the report
    rounds it): the step at which the rolling mean reached the target."""
    recs = curves.get(mode) or []
    if t is None or not recs:
        return None
    return int(min(recs, key=lambda r: abs(float(r["wall_s"]) - t))["step"])


WAITED_S = 0.05  # a step whose trainer waited longer than this for its batch "waited"


def throughput(
    curves: dict[str, list[dict]], sync: str, mode: str
) -> tuple[float, float, list[str]] | None:
    """`mode` against `sync` (see the module doc): its trained tokens/s ratio, the ceiling and
    the table cells; None without the per-step timings in the curves."""
    s, a = curves.get(sync) or [], curves.get(mode) or []
    keys = ("wall_s", "train_s", "wait_s", "train_tokens")
    if not s or not a or any(k not in r for r in (s[-1], a[-1]) for k in keys):
        return None

    def tot(recs: list[dict], key: str) -> float:
        return sum(float(r[key]) for r in recs)

    s_wall, a_wall = float(s[-1]["wall_s"]), float(a[-1]["wall_s"])
    s_train, a_train = tot(s, "train_s"), tot(a, "train_s")
    s_tok, a_tok = tot(s, "train_tokens"), tot(a, "train_tokens")
    if min(s_wall, a_wall, s_train, a_train, s_tok, a_tok) <= 0:
        return None
    ceiling = s_wall / max(s_train, s_wall - s_train)
    speed = (a_tok / a_wall) / (s_tok / s_wall)
    waited = [r for r in a if float(r["wait_s"]) > WAITED_S]
    tails = [float(r["tail_s"]) for r in a if r.get("tail_s") is not None]
    waited_tails = [float(r["tail_s"]) for r in waited if r.get("tail_s") is not None]
    tail = (
        f"{statistics.mean(waited_tails):.2f} / {statistics.mean(tails):.2f}"
        if waited_tails and tails
        else "-"
    )
    return (
        speed,
        ceiling,
        [
            f"{speed:.2f}x",
            f"{ceiling:.2f}x",
            f"{speed / ceiling:.0%}",
            f"{tot(a, 'wait_s') / a_wall:.0%}",
            f"{(a_train / a_tok) / (s_train / s_tok):.2f}",
            f"{len(waited)} of {len(a)}",
            tail,
        ],
    )


def num(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:  # "n/r", "-", "FAILED ..."
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path, help="async_vs_sync*.md, one per seed")
    args = ap.parse_args()
    per_seed, ratios, evals, per_step, steps = [], {}, {}, {}, {}
    flows: list[list[str]] = []
    speeds: dict[str, list[float]] = {}
    ceilings: dict[str, list[float]] = {}
    for path in args.reports:
        table = read_table(path)
        curves_path = path.with_suffix(".json")
        curves = json.loads(curves_path.read_text()) if curves_path.exists() else {}
        syncs = {n: r for n, r in table.items() if n.startswith("sync") and num(r["wall s"])}
        if not syncs:
            print(f"{path}: no finished sync mode; skipped")
            continue
        sname, s = min(syncs.items(), key=lambda kv: float(kv[1]["wall s"]))
        s_ttt, s_eval, s_sps = num(s["t→target s"]), num(s["eval reward"]), num(s["samples/s"])
        s_step = step_at(curves, sname, s_ttt)
        for name, r in table.items():
            if name.startswith("sync") or num(r["wall s"]) is None:
                continue
            a_ttt, a_eval, a_sps = num(r["t→target s"]), num(r["eval reward"]), num(r["samples/s"])
            ratio = s_ttt / a_ttt if s_ttt and a_ttt else None
            d_eval = a_eval - s_eval if a_eval is not None and s_eval is not None else None
            if ratio is not None:
                ratios.setdefault(name, []).append(ratio)
            if d_eval is not None:
                evals.setdefault(name, []).append(d_eval)
            if (flow := throughput(curves, sname, name)) is not None:
                speed, ceiling, cells = flow
                flows.append([seed_of(path), sname, name, *cells])
                speeds.setdefault(name, []).append(speed)
                ceilings.setdefault(name, []).append(ceiling)
            a_step = step_at(curves, name, a_ttt)
            split = "n/a"
            if ratio is not None and s_step and a_step:
                n_ratio = s_step / a_step
                speed = ratio / n_ratio  # (s_ttt / s_step) / (a_ttt / a_step)
                per_step.setdefault(name, []).append(speed)
                steps.setdefault(name, []).append(n_ratio)
                split = f"{speed:.2f}x x {n_ratio:.2f} ({s_step}/{a_step} steps)"
            per_seed.append(
                [
                    seed_of(path),
                    f"{sname}, {s['wall s']} s",
                    s["t→target s"],
                    s["eval reward"],
                    name,
                    r["t→target s"],
                    f"**{ratio:.2f}x**" if ratio else "n/a",
                    split,
                    f"{a_sps / s_sps:.2f}x" if a_sps and s_sps else "n/a",
                    r["eval reward"],
                    f"{d_eval:+.3f}" if d_eval is not None else "n/a",
                ]
            )
    header = [
        "seed",
        "fastest sync",
        "sync t→target s",
        "sync eval",
        "async mode",
        "async t→target s",
        "time-to-target",
        "= per step x steps",
        "samples/s",
        "async eval",
        "eval diff",
    ]
    print(md_table(header, per_seed))
    print()
    for name, rs in ratios.items():
        ev = evals.get(name, [])
        se = f" ± {statistics.stdev(ev) / math.sqrt(len(ev)):.3f}" if len(ev) > 1 else ""
        diff = f"{statistics.mean(ev):+.3f}{se} (mean ± SE)" if ev else "n/a"
        seeds = f"{len(rs)} seed{'s' if len(rs) > 1 else ''}"
        print(
            f"- {name} over {seeds}: time to target {statistics.median(rs):.2f}x "
            f"(median; {min(rs):.2f}x-{max(rs):.2f}x, {sum(r >= 1.8 for r in rs)} of {len(rs)} "
            f"at 1.8x or more); eval difference async - sync {diff}"
        )
        if per_step.get(name):
            sp, st = per_step[name], steps[name]
            print(
                f"  - split over {len(sp)} seeds: per step {statistics.median(sp):.2f}x "
                f"(median; {min(sp):.2f}x-{max(sp):.2f}x) x steps to target sync/async "
                f"{statistics.median(st):.2f} (median; {min(st):.2f}-{max(st):.2f})"
            )
    if flows:
        print()
        cols = ["seed", "fastest sync", "async mode", "trained tok/s", "ceiling"]
        cols += ["of the ceiling", "async wait", "async ms/tok", "waited steps"]
        cols += ["tail s: waited / all steps"]
        print(md_table(cols, flows))
        print()
        for name, sp in speeds.items():
            ce = ceilings[name]
            print(
                f"- {name}: trained tokens/s {statistics.median(sp):.2f}x the fastest sync "
                f"(median; {min(sp):.2f}x-{max(sp):.2f}x) against an overlap ceiling of "
                f"{statistics.median(ce):.2f}x (median; {min(ce):.2f}x-{max(ce):.2f}x)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
