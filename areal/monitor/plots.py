"""`areal plot RUN_DIR`: PNG plots from a run's `metrics.jsonl` (matplotlib, Agg backend).

Plots: reward vs step and vs wall time (+ the held-out reward of `eval.jsonl`), the sample
staleness histogram over steps (stacked area), throughput per step, and idle fractions. The
rollout idle fraction needs heartbeats, which a run dir does not hold by default: save them
with `areal tap metrics.rollout.heartbeat --json --history -1 > RUN_DIR/heartbeats.jsonl`;
without that file the rollout curve is skipped with a note.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areal.monitor.writers import read_records

HEARTBEATS_FILE = "heartbeats.jsonl"


def _col(recs: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r.get(key) or 0.0) for r in recs]


def step_rates(recs: list[dict[str, Any]], key: str) -> list[float]:
    """Per-step throughput: the step's `key` / wall time since the previous step."""
    out, prev = [], 0.0
    for r in recs:
        wall = float(r.get("wall_s", 0.0))
        dt = wall - prev
        out.append(float(r.get(key, 0)) / dt if dt > 0 else 0.0)
        prev = wall
    return out


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def staleness_matrix(
    recs: list[dict[str, Any]], key: str = "staleness_hist"
) -> tuple[list[int], list[list[int]]]:
    """(lags, counts[lag][step]) from each record's lag -> count map."""
    lags = sorted({int(k) for r in recs for k in (r.get(key) or {})})
    rows = [[int((r.get(key) or {}).get(str(lag), 0)) for r in recs] for lag in lags]
    return lags, rows


def _rollout_idle(run_dir: Path) -> dict[str, tuple[list[float], list[float]]]:
    """worker -> (seconds since first heartbeat, idle frac) from RUN_DIR/heartbeats.jsonl."""
    path = run_dir / HEARTBEATS_FILE
    out: dict[str, tuple[list[float], list[float]]] = {}
    if not path.exists():
        return out
    rows = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("role") == "rollout" and "busy_frac" in (rec.get("values") or {}):
            rows.append(rec)
    t0 = min((r["time"] for r in rows), default=0.0)
    for r in sorted(rows, key=lambda r: r["time"]):
        ts, idle = out.setdefault(r["worker_id"], ([], []))
        ts.append(r["time"] - t0)
        idle.append(1.0 - float(r["values"]["busy_frac"]))
    return out


def read_eval_records(path: Path) -> list[dict[str, Any]]:
    """The evaluation rounds of `eval.jsonl` by round (a torn last line is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return sorted((r for r in out if "round" in r), key=lambda r: r["round"])


def _eval_points(
    evals: list[dict[str, Any]], recs: list[dict[str, Any]], *, by_wall: bool
) -> list[tuple[float, float]]:
    """(x, held-out reward) per round: x is the policy version (= the step that made it), or
    the wall time at which that step finished (0 for version 0)."""
    wall_of = {int(r["step"]): float(r["wall_s"]) for r in recs if "wall_s" in r}
    pts = []
    for r in evals:
        v = int(r["version"])
        x = (0.0 if v == 0 else wall_of.get(v)) if by_wall else float(v)
        if x is not None and r.get("eval_reward") is not None:
            pts.append((x, float(r["eval_reward"])))
    return pts


def plot_run(
    run_dir: str | Path, out_dir: str | Path | None = None
) -> tuple[list[Path], list[str]]:
    """Write the PNGs; returns (paths written, notes about what was skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise FileNotFoundError(f"{metrics} not found: pass the --out dir of an `areal run`")
    recs = sorted(read_records(metrics), key=lambda r: r.get("step", 0))
    if not recs:
        raise ValueError(f"{metrics} has no step records yet")
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    steps, wall = _col(recs, "step"), _col(recs, "wall_s")
    evals = read_eval_records(run_dir / "eval.jsonl")
    paths: list[Path] = []
    notes: list[str] = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    # reward vs step and vs wall time
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    reward = _col(recs, "reward_mean")
    smooth = rolling_mean(reward, max(1, len(reward) // 40))
    for ax, x, label in ((a1, steps, "step"), (a2, wall, "wall time (s)")):
        ax.plot(x, reward, color="tab:blue", alpha=0.3, linewidth=0.8, label="batch mean")
        ax.plot(x, smooth, color="tab:blue", linewidth=2, label="rolling mean")
        ev = _eval_points(evals, recs, by_wall=label != "step")
        if ev:
            ax.plot(
                [e[0] for e in ev],
                [e[1] for e in ev],
                "o-",
                color="tab:orange",
                label="held-out reward (eval rounds)",
            )
        ax.set_xlabel(label)
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
    a1.legend(loc="best")
    fig.suptitle(f"reward ({run_dir.name})")
    save(fig, "reward.png")

    # staleness histogram over steps: stacked area of sample counts per lag
    lags, rows = staleness_matrix(recs)
    fig, ax = plt.subplots(figsize=(8, 4))
    if lags:
        ax.stackplot(steps, rows, labels=[f"lag {lag}" for lag in lags], alpha=0.85)
        ax.legend(loc="upper left", fontsize=8, ncol=min(len(lags), 6))
    dropped = _col(recs, "dropped_stale")
    if any(dropped):
        ax2 = ax.twinx()
        ax2.plot(steps, dropped, "k--", label="dropped stale (total)")
        ax2.set_ylabel("groups dropped (run total)")
    ax.set_xlabel("step")
    ax.set_ylabel("samples trained")
    ax.set_title("sample staleness (policy versions behind) per step")
    save(fig, "staleness.png")

    # throughput per step
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, step_rates(recs, "samples"), label="samples/s", color="tab:green")
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s")
    ax3 = ax.twinx()
    ax3.plot(steps, step_rates(recs, "tokens"), label="tokens/s", color="tab:purple")
    ax3.set_ylabel("generated tokens/s")
    fig.legend(loc="upper right")
    ax.set_title("trainer throughput per step")
    ax.grid(alpha=0.3)
    save(fig, "throughput.png")

    # idle fractions
    fig, ax = plt.subplots(figsize=(8, 4))
    if any(r.get("trainer_idle_frac") is not None for r in recs):
        ax.plot(wall, _col(recs, "trainer_idle_frac"), label="trainer idle (cumulative)")
    rollout = _rollout_idle(run_dir)
    for wid, (ts, idle) in rollout.items():
        ax.plot(ts, idle, label=f"{wid} idle (cumulative)")
    if not rollout:
        notes.append(
            f"rollout idle skipped: no {HEARTBEATS_FILE} in {run_dir} (save heartbeats "
            f"with `areal tap metrics.rollout.heartbeat --json --history -1 > "
            f"{run_dir / HEARTBEATS_FILE}` while the run is live)"
        )
    ax.set_xlabel("wall time (s)" + (" (rollout: since its first heartbeat)" if rollout else ""))
    ax.set_ylabel("idle fraction (1 - busy)")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    ax.set_title("idle fraction")
    save(fig, "idle.png")
    return paths, notes
