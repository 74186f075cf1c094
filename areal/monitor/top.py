"""`areal top`: a live terminal dashboard of one run, attachable at any time.

Rendering is a pure function of a RunState and a clock (`render_panels`), so `--once`, the live
view and the tests draw the same panels. `--once` collects for a few seconds (history +
heartbeats), prints every panel once as plain text (no ANSI when stdout is not a TTY) and exits.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from rich.console import Console, Group
from rich.layout import Layout
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from areal.bus.auth import NO_CREDENTIALS, Credentials
from areal.monitor.format import fmt_value
from areal.monitor.state import LIVE_S, ROLES, RunState

PANEL_TITLES = (
    "Run",
    "Throughput",
    "Idle",
    "Queues",
    "Workers",
    "Staleness",
    "Reward",
    "Interrupts & weights",
    "Dead letters",
)
SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    """Last `width` values as block characters, scaled between their min and max."""
    vals = values[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-12:
        return SPARK[len(SPARK) // 2] * len(vals)
    return "".join(SPARK[round((v - lo) / (hi - lo) * (len(SPARK) - 1))] for v in vals)


def bar(frac: float, width: int = 20) -> str:
    frac = min(1.0, max(0.0, frac))
    n = round(frac * width)
    return "█" * n + "·" * (width - n)


def _num(v: Any, unit: str = "") -> str:
    return "-" if v is None else f"{fmt_value(v)}{unit}"


_LEFT = ("stream", "role", "worker", "stage", "reason", "detail")


def _table(*cols: str) -> Table:
    t = Table(box=None, pad_edge=False, show_edge=False, expand=False)
    for c in cols:
        t.add_column(c, justify="left" if c in _LEFT else "right")
    return t


def _in_flight(st: RunState) -> str:
    """Admitted tasks not yet trained, dropped, filtered or rejected (from the KV run state)."""
    tr, ctrl = st.kv.get("trainer"), st.kv.get("controller")
    if not tr or not ctrl:
        return "-"
    ended = ("trained", "dropped_stale", "filtered", "rejected")
    done = sum(tr.get(k, 0) for k in ended)
    return str(ctrl.get("admitted", 0) - done)


def run_panel(st: RunState, now: float) -> Panel:
    last = st.last_step or {}
    tr, ctrl = st.kv.get("trainer", {}), st.kv.get("controller", {})
    rate = st.step_rate()
    pause = st.storage_pause()
    status = "finished" if st.is_finished() else "paused" if pause else "running"
    lines = [
        f"run {st.run_id}  [{status}]",
        f"policy version {st.version}   step {last.get('step', tr.get('step', 0))}",
        f"step rate {_num(rate, '/s')}" + (f" ({1 / rate:.2f} s/step)" if rate else ""),
        f"wall {_num(last.get('wall_s'), ' s')}",
        f"admitted {ctrl.get('admitted', st.admission.get('admitted', '-'))}  outstanding "
        f"{st.admission.get('outstanding', '-')}  capacity {st.admission.get('capacity', '-')}"
        f"  in flight {_in_flight(st)}",
        f"trained {tr.get('trained', '-')}  dropped_stale {tr.get('dropped_stale', last.get('dropped_stale', '-'))}"
        f"  filtered {tr.get('filtered', last.get('filtered', '-'))}"
        f"  rejected {tr.get('rejected', last.get('rejected', 0))}",
    ]
    if (line := storage_line(st, now)) is not None:
        lines.append(line)
    return Panel(Text("\n".join(lines)), title="Run")


def _mb(n: Any) -> str:
    return "?" if n is None else f"{float(n) / 2**20:.1f} MB"


def storage_line(st: RunState, now: float) -> str | None:
    """The storage pause under way ("paused: storage full at <path>, needs N MB, since Xs"), or
    the last one that ended, or None when there was none."""
    pause = st.storage_pause()
    if pause is not None:
        what = "storage full" if pause["kind"] == "storage_full" else "write failed"
        since = max(0.0, now - float(pause["since"]))
        return (
            f"paused: {what} at {pause.get('path')}, needs {_mb(pause.get('needs_bytes'))}, "
            f"free {_mb(pause.get('free_bytes'))}, since {since:.0f}s ({pause.get('what')})"
        )
    done = st.last_storage_recovery()
    if done is not None:
        return f"last storage pause: {float(done['paused_s']):.1f} s at {done.get('path')}"
    return None


def throughput_panel(st: RunState, now: float) -> Panel:
    t = _table("role", "samples/s", "tokens/s")
    tp = st.throughput(now)
    for role in ROLES:
        if role in tp:
            t.add_row(role, f"{tp[role][0]:.1f}", f"{tp[role][1]:.1f}")
    if not tp:
        t.add_row("-", "-", "-")
    return Panel(t, title="Throughput")


def idle_panel(st: RunState, now: float) -> Panel:
    idle = st.idle(now)
    lines = [
        f"{role:<8} {bar(idle[role], 16)} {idle[role]:.0%}"
        for role in ("rollout", "trainer", "reward", "controller")
        if role in idle
    ]
    if (batch := batch_line(st.last_step)) is not None:
        lines.append(batch)
    if (episodes := episode_line(st.last_step)) is not None:
        lines.append(episodes)
    return Panel(Text("\n".join(lines) or "no heartbeats yet"), title="Idle")


def episode_line(last: dict[str, Any] | None) -> str | None:
    """The last batch's episodes (turns, tool calls and their outcome, tool latency, the share
    of environment tokens), or None for single-turn batches."""
    if not last or (last.get("turns_mean") or 1.0) <= 1.0 and not last.get("masked_token_frac"):
        return None
    parts = [f"episodes: {last.get('turns_mean', 1.0):.2f} turns"]
    if last.get("tool_calls_mean") is not None:
        parts.append(f"{last['tool_calls_mean']:.2f} tool calls")
    if last.get("tool_call_frac") is not None:
        parts.append(f"called {last['tool_call_frac']:.0%}")
    if last.get("tool_ok_frac") is not None:
        parts.append(f"ok {last['tool_ok_frac']:.0%}")
    if last.get("tool_error_frac") is not None:
        parts.append(f"errors {last['tool_error_frac']:.0%}")
    if last.get("tool_s_mean") is not None:
        parts.append(f"tool {last['tool_s_mean']:.2f} s")
    parts.append(f"env tokens {last.get('masked_token_frac') or 0.0:.0%}")
    return ", ".join(parts)


def batch_line(last: dict[str, Any] | None) -> str | None:
    """Where the last step's batch spent its time (`BatchInfo`'s timings), or None."""
    if not last or last.get("gen_span_s") is None:
        return None
    line = f"last batch: generated in {last['gen_span_s']:.2f} s"
    if last.get("tail_s") is not None:
        line += f", its slowest answers {last['tail_s']:.2f} s of it"
    if (age := last.get("ready_age_s")) is not None:
        line += f", then waited {age:.2f} s for the trainer"
    return line


def queues_panel(st: RunState, now: float) -> Panel:
    t = _table("stream", "messages", "ack pending", "pending", "redelivered")
    for stream, q in st.queues.items():
        t.add_row(
            stream,
            str(q["messages"]),
            _num(q.get("ack_pending")),
            _num(q.get("pending")),
            _num(q.get("redelivered")),
        )
    return Panel(t, title="Queues")


def _worker_detail(values: dict[str, Any]) -> str:
    keys = (
        "inflight_tasks",
        "queued_seqs",
        "samples",
        "interrupts",
        "buffered_groups",
        "complete_groups",
        "held_leases",
        "step",
    )
    return " ".join(f"{k}={values[k]}" for k in keys if k in values)


def workers_panel(st: RunState, now: float) -> Panel:
    t = _table("role", "worker", "seen", "idle", "version", "detail")
    for role, workers in sorted(st.workers_by_role(now).items()):
        for w in workers:
            age = max(0.0, now - w.last_seen)
            seen = f"{age:.0f}s ago" + ("" if age <= LIVE_S else " (stale)")
            if w.frozen is not None:  # the watchdog named it (`worker_frozen`)
                seen += " FROZEN"
            idle = w.idle_frac
            t.add_row(
                role,
                w.worker_id,
                seen,
                "-" if idle is None else f"{idle:.0%}",
                _num(w.values.get("version")),
                _worker_detail(w.values),
            )
    live = {r: len(ws) for r, ws in st.live_workers(now).items()}
    caption = "live: " + (", ".join(f"{r} {n}" for r, n in sorted(live.items())) or "none")
    return Panel(Group(t, Text(caption)), title="Workers")


def staleness_panel(st: RunState, now: float) -> Panel:
    hist = st.staleness_totals()
    total = sum(hist.values()) or 1
    last = st.last_step or {}
    lines = [f"lag {lag:>2} {bar(n / total, 20)} {n}" for lag, n in hist.items()]
    lines.append(
        f"last step max {_num(last.get('staleness_max'))}  "
        f"dropped_stale {_num(last.get('dropped_stale'))}"
    )
    if "behav_kl_k3" in last:  # what the lag cost the last step (`areal.algo.loss` docstring)
        lines.append(
            f"behav KL k3 {_num(last.get('behav_kl_k3'))}  ESS {_num(last.get('behav_ess'))}  "
            f"capped {_num(last.get('behav_imp_weight_masked_frac'))}  "
            f"clipped {_num(last.get('clipfrac'))}"
        )
    return Panel(Text("\n".join(lines)), title="Staleness")


def reward_panel(st: RunState, now: float) -> Panel:
    rewards = st.reward_series()
    lines = [sparkline(rewards, 48) or "no steps yet"]
    if rewards:
        first, last5 = rewards[:5], rewards[-5:]
        lines.append(
            f"last {rewards[-1]:.3f}  first5 {sum(first) / len(first):.3f}  "
            f"last5 {sum(last5) / len(last5):.3f}  steps {len(rewards)}"
        )
    evals = st.eval_series()
    if evals:
        version, last = evals[-1]
        first = evals[0][1]
        lines.append(
            f"held-out {sparkline([r for _, r in evals], 24)} v{evals[0][0]} {first:.3f} -> "
            f"v{version} {last:.3f} ({len(evals)} rounds)"
        )
    return Panel(Text("\n".join(lines)), title="Reward")


def interrupts_panel(st: RunState, now: float) -> Panel:
    last_frac, mean_frac = st.interrupted_frac()
    wt = st.weight_times(now)
    last = st.last_step or {}
    lines = [
        f"interrupted frac last {_num(last_frac)}  mean {_num(mean_frac)}",
        f"reprefill tokens last step {_num(last.get('reprefill_tokens'))}",
        f"weights publish last {_num(wt['publish_last_s'], ' s')}  mean {_num(wt['publish_mean_s'], ' s')}",
        f"weights load (rollout, per load) {_num(wt['load_mean_s'], ' s')}",
    ]
    return Panel(Text("\n".join(lines)), title="Interrupts & weights")


def dlq_panel(st: RunState, now: float) -> Panel:
    counts = st.dlq_counts()
    if not counts:
        return Panel(Text("none"), title="Dead letters")
    t = _table("stage", "count", "reason")
    for stage, n in counts.items():
        t.add_row(stage, str(n), (st.dlq_reasons.get(stage) or "")[:60])
    return Panel(t, title="Dead letters")


PANELS = (
    run_panel,
    throughput_panel,
    idle_panel,
    queues_panel,
    workers_panel,
    staleness_panel,
    reward_panel,
    interrupts_panel,
    dlq_panel,
)


def render_panels(st: RunState, now: float) -> list[Panel]:
    return [make(st, now) for make in PANELS]


def dashboard(st: RunState, now: float) -> Layout:
    p = render_panels(st, now)
    root = Layout()
    root.split_column(
        Layout(name="a", size=9),
        Layout(name="b", ratio=1, minimum_size=8),
        Layout(name="c", size=10),
        Layout(name="d", size=7),
    )
    root["a"].split_row(Layout(p[0], ratio=2), Layout(p[1], ratio=1), Layout(p[2], ratio=1))
    root["b"].split_row(Layout(p[3], ratio=1), Layout(p[4], ratio=2))
    root["c"].split_row(Layout(p[5], ratio=1), Layout(p[6], ratio=2))
    root["d"].split_row(Layout(p[7], ratio=1), Layout(p[8], ratio=1))
    return root


async def run_top(
    url: str,
    run_id: str,
    *,
    once: bool,
    interval_s: float,
    collect_s: float,
    credentials: Credentials | None = None,
) -> int:
    from areal.bus.tap import TapClient
    from areal.monitor.live import attach, check_server, note, refresh, refresh_every

    client = await TapClient.connect(
        url, run_id, name="areal-top", note=note, credentials=credentials or NO_CREDENTIALS
    )
    try:
        await client.check_run()
        st = RunState()
        await attach(client, st)
        if once:
            await asyncio.sleep(collect_s)
            await refresh(client, st)
            tty = sys.stdout.isatty()
            console = Console(width=None if tty else 110, no_color=not tty, highlight=False)
            console.print(Group(*render_panels(st, time.time())))
            return 0
        poller = asyncio.create_task(refresh_every(client, st, interval_s))
        try:
            with Live(dashboard(st, time.time()), screen=True, auto_refresh=False) as live:
                while not (client.lost.is_set() and st.is_finished()):
                    await asyncio.sleep(interval_s)
                    if not st.is_finished():  # a run that ended may take its server along
                        check_server(client, "top")  # a dashboard of a vanished one would lie
                    live.update(dashboard(st, time.time()), refresh=True)
        finally:
            poller.cancel()
        note(finished_line(st))  # after the screen is restored: this line stays
        return 0
    finally:
        await client.close()


def finished_line(st: RunState) -> str:
    """What `top` says when the run it watched ended and its server went away with it."""
    s = st.finished or {}
    last = st.last_step or {}
    steps = s.get("steps", last.get("step", st.kv.get("trainer", {}).get("step", "?")))
    reward = s.get("final_reward")
    wall = s.get("wall_s")
    return (
        f"top: run {st.run_id} finished at step {steps}"
        + (f", final reward {reward:.3f}" if isinstance(reward, int | float) else "")
        + (f", {wall:.1f} s of training" if isinstance(wall, int | float) else "")
        + "; its NATS server is gone"
    )
