"""Tables and the plot of bench/vs_trl.py: one summary row per system (medians over repeats),
one row per run, the areal/TRL ratios, and reward (rolling 10-step mean) against wall time.

`startup` maps `id(run)` -> start-up seconds (spawn -> trainer start) or None when unknown.
"""

from __future__ import annotations

import math
from pathlib import Path

from _common import md_table, median, median_missed_last
from _rl import RunResult, mean, rolling, time_to_target

SYSTEMS = ("areal", "trl")
LABEL = {"areal": "areal-bus", "trl": "TRL GRPOTrainer"}
COLOR = {"areal": "tab:blue", "trl": "tab:orange"}
Startup = dict[int, float | None]


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:.{nd}f}"


def _med(xs: list[float | None], nd: int = 1) -> str:
    """Median of the known values; `(k/n)` when only k of the n runs have one."""
    got = [x for x in xs if x is not None]
    if not got:
        return "n/r" if xs else "-"
    s = _f(median(got), nd)
    return s if len(got) == len(xs) else f"{s} ({len(got)}/{len(xs)})"


def _ttt(r: RunResult, t: float) -> float | None:
    return time_to_target(r, t) if r.ok else None


def ttt_median(rs: list[RunResult], t: float) -> float | None:
    """Median time to reward `t` over the runs that finished, a run that never reached it
    counting as slower than any that did (inf); None when that median is not reached."""
    return median_missed_last([_ttt(r, t) for r in rs if r.ok])


def _med_ttt(rs: list[RunResult], t: float) -> str:
    got = [_ttt(r, t) for r in rs if r.ok]
    m = ttt_median(rs, t)
    s = "n/r" if m is None else _f(m)
    n = sum(x is not None for x in got)
    return s if n == len(got) else f"{s} ({n}/{len(got)} reached)"


def paired_lines(runs: dict[str, list[RunResult]], t: float) -> list[str]:
    """Per repeat (seed): TRL's time to `t` / areal's, and who got there first."""
    pairs = list(zip(runs["areal"], runs["trl"], strict=False))
    if not pairs:
        return []
    ratios, wins = [], 0
    for a, b in pairs:
        ta, tb = _ttt(a, t), _ttt(b, t)
        wins += (math.inf if ta is None else ta) < (math.inf if tb is None else tb)
        if ta is None or tb is None:
            ratios.append("neither" if ta == tb else "areal n/r" if ta is None else "TRL n/r")
        else:
            ratios.append(f"{tb / ta:.2f}x")
    return [
        f"- per repeat, time to {t} (TRL's / areal's): {', '.join(ratios)}; "
        f"areal first in {wins} of {len(pairs)}"
    ]


def _metrics(r: RunResult, startup: Startup) -> dict[str, float | None]:
    ok, su = r.ok, startup.get(id(r))
    return {
        "startup": su,
        "first": su + float(r.records[0]["wall_s"]) if ok and su is not None else None,
        "wall": r.wall_s if ok else None,
        "sps": r.samples / r.wall_s if ok else None,
        "tps": r.tokens / r.wall_s if ok else None,
        "final": mean(r.rewards()[-10:]) if ok else None,
        "eval": r.eval_reward,
        "process": r.process_wall_s,
    }


def _header(thresholds: tuple[float, ...]) -> list[str]:
    return [
        "system",
        "start-up s",
        "1st step s",
        *[f"t→{t} s" for t in thresholds],
        "wall s",
        "samples/s",
        "gen tok/s",
        "final reward",
        "eval acc",
        "process s",
    ]


def summary_table(
    runs: dict[str, list[RunResult]], startup: Startup, thresholds: tuple[float, ...]
) -> str:
    rows = []
    for system in SYSTEMS:
        rs = runs[system]
        ms = [_metrics(r, startup) for r in rs]

        def col(key: str, nd: int = 1, ms: list = ms) -> str:
            return _med([m[key] for m in ms], nd)

        n_ok = sum(r.ok for r in rs)
        rows.append(
            [
                f"{LABEL[system]} ({n_ok}/{len(rs)} ok)",
                col("startup"),
                col("first"),
                *[_med_ttt(rs, t) for t in thresholds],
                col("wall"),
                col("sps", 0),
                col("tps", 0),
                col("final", 3),
                col("eval", 3),
                col("process"),
            ]
        )
    return md_table(_header(thresholds), rows)


def run_table(
    runs: dict[str, list[RunResult]], startup: Startup, thresholds: tuple[float, ...]
) -> str:
    rows = []
    for system in SYSTEMS:
        for r in runs[system]:
            m = _metrics(r, startup)
            if not r.ok:
                rows.append([r.name, f"FAILED (rc {r.rc})", *["-"] * (len(thresholds) + 7)])
                continue
            rows.append(
                [
                    r.name,
                    _f(m["startup"]),
                    _f(m["first"]),
                    *[_f(_ttt(r, t)) if _ttt(r, t) is not None else "n/r" for t in thresholds],
                    _f(m["wall"]),
                    _f(m["sps"], 0),
                    _f(m["tps"], 0),
                    _f(m["final"], 3),
                    _f(m["eval"], 3),
                    _f(m["process"]),
                ]
            )
    return md_table(["run", *_header(thresholds)[1:]], rows)


def summary_lines(
    runs: dict[str, list[RunResult]], startup: Startup, thresholds: tuple[float, ...]
) -> list[str]:
    """Medians side by side; `areal Nx` = TRL's time / areal's (or areal's rate / TRL's):
    above 1 areal is faster."""

    def med(system: str, fn) -> float | None:
        xs = [fn(r) for r in runs[system] if r.ok]
        xs = [x for x in xs if x is not None]
        return median(xs) if xs else None

    out = []
    for t in thresholds:  # a run that never got there counts as slower than any that did
        a, b = (ttt_median(runs[system], t) for system in SYSTEMS)
        if a and b:
            out.append(f"- time to reward {t}: areal {a:.1f} s, TRL {b:.1f} s: areal {b / a:.2f}x")
    if thresholds:
        out += paired_lines(runs, thresholds[-1])
    a = med("areal", lambda r: r.samples / r.wall_s)
    b = med("trl", lambda r: r.samples / r.wall_s)
    if a and b:
        out.append(f"- samples/s: areal {a:.0f}, TRL {b:.0f}: areal {a / b:.2f}x")
    for key, what in (("startup", "start-up"), ("first", "spawn -> first step")):
        a, b = (med(system, lambda r, k=key: _metrics(r, startup)[k]) for system in SYSTEMS)
        if a and b:
            out.append(f"- {what}: areal {a:.1f} s, TRL {b:.1f} s")
    return out


def eval_lines(runs: dict[str, list[RunResult]], n_tasks: int) -> list[str]:
    """Held-out accuracy: each system's mean over repeats with its standard error (the spread
    over repeats / sqrt(n); with one repeat, or repeats that all agree, the binomial SE of one
    eval of `n_tasks` tasks instead), and the difference, paired by repeat (seed) when every
    repeat of both has an eval, with its standard error."""
    import math

    evals = {s: [r.eval_reward for r in runs[s] if r.ok] for s in SYSTEMS}
    if any(not xs or any(x is None for x in xs) for xs in evals.values()):
        return []

    def se(xs: list[float]) -> float:
        n, m = len(xs), sum(xs) / len(xs)
        spread = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n) if n > 1 else 0.0
        return spread or math.sqrt(max(m * (1 - m), 1e-12) / n_tasks)

    out = []
    for s_ in SYSTEMS:
        xs = evals[s_]
        out.append(
            f"- eval {LABEL[s_]}: mean {sum(xs) / len(xs):.3f} ± {se(xs):.3f} (SE, n={len(xs)})"
        )
    a, b = evals["areal"], evals["trl"]
    if len(a) == len(b):
        diffs = [x - y for x, y in zip(a, b, strict=True)]
        d, e = (
            sum(diffs) / len(diffs),
            se(diffs) if len(set(diffs)) > 1 else math.hypot(se(a), se(b)),
        )
        verdict = "within" if abs(d) <= e else "not within"
        out.append(
            f"- eval difference areal - TRL, paired by repeat: {d:+.3f} ± {e:.3f} (SE): "
            f"{verdict} one standard error"
        )
    return out


def plot(
    runs: dict[str, list[RunResult]],
    startup: Startup,
    thresholds: tuple[float, ...],
    path: Path,
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for system in SYSTEMS:
        for i, r in enumerate(runs[system]):
            if not r.records:
                continue
            y = rolling(r.rewards(), 10)
            wall = [float(x["wall_s"]) for x in r.records]
            su = startup.get(id(r)) or 0.0
            style = dict(color=COLOR[system], lw=1.3, alpha=1.0 if i == 0 else 0.55)
            lab = LABEL[system] if i == 0 else None
            axes[0].plot(wall, y, label=lab, **style)
            axes[1].plot([w + su for w in wall], y, label=lab, **style)
    for ax in axes:
        for t in thresholds:
            ax.axhline(t, color="gray", lw=0.6, ls=":")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_xlabel("trainer wall time (s)")
    axes[1].set_xlabel("time since process start (s, incl. start-up)")
    axes[0].set_ylabel("reward (rolling mean, 10 steps)")
    fig.suptitle(f"{title}\none line per repeat; dotted: reward thresholds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
