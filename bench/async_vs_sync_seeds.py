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
- η bound: the sync run's own per-step times replayed on a two-stage pipeline bounded as the
  async mode is (`replay_bound`): the rollout generates batch k+1 once batch k is generated and
  the trainer has finished batch k-η; the trainer trains batch k once it is generated. With each
  step as long as it was in the sync run, it is what that η can give at best: below the ceiling
  whenever step times vary, since at small η a long batch on one side stalls the other
  (a table of its own gives each seed's bound at η = 1, 2, 4 and 8, whichever modes ran);
- async wait: the share of the async run's wall time its trainer waited for a batch;
- async ms/tok: the async trainer's time per trained token over the sync trainer's (above 1:
  it trains slower while the rollout and the other processes run beside it);
- waited steps, and the batch tail (`tail_s`: how long a batch's slowest answers held it after
  half its tasks were done) in those steps against all of the run's steps: whether the waits
  come from long tails ("-" for curves written before the bench kept `tail_s`).

Last, the learning curves averaged over the seeds: per step, the mean reward of the fastest sync
runs and of each async mode's runs, and their mean trainer wall time. On those mean curves the
same rule (target: 90% of the sync curve's last-10-step mean; time to target: wall time of the
first step from 10 on whose rolling 10-step mean reaches it) gives one time to target per mode,
with the seed noise in each crossing averaged out rather than taken a median of; a bootstrap
over seeds (seeds drawn with replacement, 2000 draws) gives its 90% interval.

    python bench/async_vs_sync_seeds.py bench/results/async_vs_sync_s*.md
"""

from __future__ import annotations

import argparse
import json
import math
import random
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


BOUND_ETAS = (1, 2, 4, 8)
WAITED_S = 0.05  # a step whose trainer waited longer than this for its batch "waited"


def throughput(
    curves: dict[str, list[dict]], sync: str, mode: str
) -> tuple[float, float, float | None, list[str]] | None:
    """`mode` against `sync` (see the module doc): its trained tokens/s ratio, the ceiling, the
    η bound (None for a mode name without η) and the table cells; None without the per-step
    timings in the curves."""
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
    eta = eta_of(mode)
    bound = replay_bound(*sync_step_times(s), eta) if eta is not None else None
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
        bound,
        [
            f"{speed:.2f}x",
            f"{ceiling:.2f}x",
            f"{bound:.2f}x" if bound is not None else "-",
            f"{speed / ceiling:.0%}",
            f"{tot(a, 'wait_s') / a_wall:.0%}",
            f"{(a_train / a_tok) / (s_train / s_tok):.2f}",
            f"{len(waited)} of {len(a)}",
            tail,
        ],
    )


def replay_bound(gen: list[float], train: list[float], eta: int) -> float:
    """Sum of the steps' times over the makespan of the η-bounded two-stage pipeline (module
    doc, "η bound"): 1.0 at η = 0 (each batch generated after the last step), at most the
    ceiling (sum over the slower stage's sum) at any η."""
    if len(gen) != len(train) or not gen:
        raise ValueError("one generation and one training time per step")
    gen_end: list[float] = []
    train_end: list[float] = []
    for k, (g, t) in enumerate(zip(gen, train, strict=True)):
        start = gen_end[k - 1] if k else 0.0
        if k - eta - 1 >= 0:
            start = max(start, train_end[k - eta - 1])  # the weights it must be generated with
        gen_end.append(start + g)
        train_end.append(max(gen_end[k], train_end[k - 1] if k else 0.0) + t)
    return (sum(gen) + sum(train)) / train_end[-1]


def sync_step_times(recs: list[dict]) -> tuple[list[float], list[float]]:
    """A sync run's per-step (rest, train) times: its trainer's `train_s`, and the rest of the
    step's wall time (the rollout, the reward and the hops: what the trainer waited for)."""
    walls = [0.0, *(float(r["wall_s"]) for r in recs)]
    train = [float(r["train_s"]) for r in recs]
    rest = [max(0.0, walls[i + 1] - walls[i] - train[i]) for i in range(len(recs))]
    return rest, train


def eta_of(mode: str) -> int | None:
    m = re.search(r"η(\d+)", mode)
    return int(m.group(1)) if m else None


def rolling(xs: list[float], k: int = 10) -> list[float]:
    return [statistics.mean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def mean_curve(runs: list[list[dict]]) -> tuple[list[float], list[float]]:
    """Per step over the runs' common steps: (mean reward, mean trainer wall time)."""
    n = min(len(r) for r in runs)
    reward = [statistics.mean(float(r[i]["reward_mean"]) for r in runs) for i in range(n)]
    wall = [statistics.mean(float(r[i]["wall_s"]) for r in runs) for i in range(n)]
    return reward, wall


def mean_curve_ttt(
    sync_runs: list[list[dict]], runs: list[list[dict]], k: int = 10
) -> tuple[float, float | None, float | None, int | None, int | None]:
    """On the seed-mean curves: (target, sync time to it, `runs`' time to it, and the steps)."""
    s_reward, s_wall = mean_curve(sync_runs)
    target = 0.9 * statistics.mean(s_reward[-k:])

    def cross(reward: list[float], wall: list[float]) -> tuple[float | None, int | None]:
        for i, m in enumerate(rolling(reward, k)):
            if m >= target and i + 1 >= k:
                return wall[i], i + 1
        return None, None

    s_t, s_step = cross(s_reward, s_wall)
    a_t, a_step = cross(*mean_curve(runs))
    return target, s_t, a_t, s_step, a_step


def bootstrap_ratio(
    sync_runs: list[list[dict]], runs: list[list[dict]], draws: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """90% interval of the seed-mean time-to-target ratio, seeds drawn with replacement (the
    sync and async runs of one seed stay together)."""
    rng, n, out = random.Random(seed), len(runs), []
    for _ in range(draws):
        pick = [rng.randrange(n) for _ in range(n)]
        _, s_t, a_t, _, _ = mean_curve_ttt([sync_runs[i] for i in pick], [runs[i] for i in pick])
        out.append(s_t / a_t if s_t and a_t else 0.0)  # not reached: counts as no gain
    out.sort()
    return out[int(0.05 * draws)], out[int(0.95 * draws) - 1]


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
    bounds: dict[str, list[float]] = {}
    eta_bounds: list[tuple[str, str, list[float]]] = []  # seed, sync: ceiling, η bounds
    paired: dict[str, tuple[list[list[dict]], list[list[dict]]]] = {}  # mode -> sync, async runs
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
        if (recs := curves.get(sname)) and all(k in recs[-1] for k in ("wall_s", "train_s")):
            rest, train = sync_step_times(recs)
            ceiling = (sum(rest) + sum(train)) / max(sum(rest), sum(train))
            eta_bounds.append(
                (
                    seed_of(path),
                    sname,
                    [ceiling, *(replay_bound(rest, train, e) for e in BOUND_ETAS)],
                )
            )
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
            if (
                curves.get(sname)
                and curves.get(name)
                and all("reward_mean" in r for r in [*curves[sname], *curves[name]])
            ):
                pair = paired.setdefault(name, ([], []))
                pair[0].append(curves[sname])
                pair[1].append(curves[name])
            if (flow := throughput(curves, sname, name)) is not None:
                speed, ceiling, bound, cells = flow
                flows.append([seed_of(path), sname, name, *cells])
                speeds.setdefault(name, []).append(speed)
                ceilings.setdefault(name, []).append(ceiling)
                if bound is not None:
                    bounds.setdefault(name, []).append(bound)
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
        cols = ["seed", "fastest sync", "async mode", "trained tok/s", "ceiling", "η bound"]
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
                + (
                    f"; its η bound {statistics.median(bd):.2f}x ({min(bd):.2f}x-{max(bd):.2f}x)"
                    if (bd := bounds.get(name))
                    else ""
                )
            )
    if eta_bounds:
        print()
        print("What overlap could give at each η, the fastest sync run's steps replayed:")
        print()
        cols = ["seed", "fastest sync", "ceiling", *(f"η = {e}" for e in BOUND_ETAS)]
        print(md_table(cols, [[a, b, *(f"{x:.2f}x" for x in xs)] for a, b, xs in eta_bounds]))
        print()
        for i, e in enumerate(BOUND_ETAS):
            xs = [r[2][1 + i] for r in eta_bounds]
            print(
                f"- η = {e}: at best {statistics.median(xs):.2f}x (median; "
                f"{min(xs):.2f}x-{max(xs):.2f}x, {sum(x >= 1.8 for x in xs)} of {len(xs)} seeds "
                "at 1.8x or more)"
            )
    if paired:
        print()
        rows = []
        for name, (sync_runs, runs) in paired.items():
            target, s_t, a_t, s_step, a_step = mean_curve_ttt(sync_runs, runs)
            ratio = f"**{s_t / a_t:.2f}x**" if s_t and a_t else "n/a"
            ci = bootstrap_ratio(sync_runs, runs) if len(runs) > 1 else None
            rows.append(
                [
                    name,
                    str(len(runs)),
                    f"{target:.3f}",
                    f"{s_t:.1f} (step {s_step})" if s_t else "not reached",
                    f"{a_t:.1f} (step {a_step})" if a_t else "not reached",
                    ratio,
                    f"{ci[0]:.2f}x-{ci[1]:.2f}x" if ci else "-",
                ]
            )
        cols = ["async mode", "seeds", "target", "sync t→target s", "async t→target s"]
        cols += ["time-to-target", "90% interval (bootstrap over seeds)"]
        print("Seed-mean learning curves (mean reward and mean wall time per step):")
        print()
        print(md_table(cols, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
