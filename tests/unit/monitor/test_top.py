"""`areal top` rendering: every panel from a RunState, as plain text, plus the small glyph helpers."""

from __future__ import annotations

import io

from rich.console import Console, Group

from areal.monitor.state import RunState
from areal.monitor.top import PANEL_TITLES, bar, batch_line, dashboard, render_panels, sparkline
from schemas import MetricRecord
from tests.unit.monitor.test_state import beat, step


def text_of(renderable, width: int = 120) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, no_color=True, force_terminal=False).print(renderable)
    return buf.getvalue()


def test_sparkline_scales_between_min_and_max():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"  # 0.5 * 7 = 3.5 rounds to index 4
    assert sparkline([2.0, 2.0]) == "▅▅"  # flat: mid level
    assert sparkline([]) == ""
    assert len(sparkline(list(range(100)), width=10)) == 10
    assert bar(0.25, 8) == "██······" and bar(2.0, 4) == "████"


def test_every_panel_renders_from_an_empty_state():
    out = text_of(Group(*render_panels(RunState(run_id="r"), now=0.0)))
    for title in PANEL_TITLES:
        assert title in out
    assert "\x1b[" not in out


def test_panels_show_real_numbers():
    st = RunState(run_id="demo")
    for n in range(1, 4):
        st.fold(
            step(
                n,
                float(n),
                staleness_hist={"0": 60, "2": 4},
                behav_kl_k3=0.0123,
                behav_ess=0.875,
                behav_imp_weight_masked_frac=0.01,
                clipfrac=0.05,
            )
        )
    st.fold(
        beat("rollout-0", 1003.0, samples=10, tokens=20, busy_frac=0.2, version=2, inflight_tasks=3)
    )
    st.fold(
        MetricRecord(
            role="controller",
            worker_id="controller-0",
            type="admission",
            time=1003.0,
            values={"admitted": 24, "outstanding": 24, "capacity": 40},
        )
    )
    st.set_queues({"prompts": {"messages": 5, "ack_pending": 2, "pending": 3, "redelivered": 0}})
    out = text_of(Group(*render_panels(st, now=1003.5)))
    assert "run demo  [running]" in out
    assert "policy version 3" in out
    assert "step rate 1/s" in out
    assert "rollout-0" in out and "controller-0" in out and "inflight_tasks=3" in out
    assert "lag  2" in out and "12" in out  # 3 steps x 4 samples at lag 2
    assert "behav KL k3 0.0123  ESS 0.875  capped 0.01  clipped 0.05" in out
    assert "capacity 40" in out
    assert "prompts" in out
    assert "rollout  " in out and "80%" in out  # idle = 1 - 0.2
    assert "last batch" not in out  # these steps carry no batch timings


def test_the_idle_panel_says_where_the_last_batch_spent_its_time():
    st = RunState(run_id="demo")
    st.fold(step(1, 1.0, gen_span_s=4.9, tail_s=3.0, ready_age_s=0.25))
    out = text_of(Group(*render_panels(st, now=2.0)))
    assert (
        "last batch: generated in 4.90 s, its slowest answers 3.00 s of it, then waited 0.25 s "
        "for the trainer"
    ) in " ".join(out.replace("│", " ").split())
    assert batch_line({"gen_span_s": 1.0}) == "last batch: generated in 1.00 s"
    assert batch_line({"wait_s": 1.0}) is None and batch_line(None) is None


def test_live_layout_renders():
    st = RunState(run_id="r")
    st.fold(step(1, 1.0))
    assert "Reward" in text_of(dashboard(st, now=1001.0), width=160)


def test_a_worker_the_watchdog_named_frozen_shows_as_frozen_until_it_beats_again():
    from schemas import Event

    st = RunState(run_id="r")
    st.fold(beat("rollout-0", 1000.0, busy_frac=0.5))
    st.fold(beat("trainer-0", 1000.0, busy_frac=0.5))
    frozen = Event(
        type="worker_frozen",
        role="launcher",
        worker_id="launcher",
        time=1031.0,
        detail={"worker_id": "rollout-0", "role": "rollout", "silent_s": 31.0, "pid": 7},
    )
    st.fold(frozen)
    assert "launcher" not in st.workers  # the launcher is no worker
    assert st.workers["rollout-0"].last_seen == 1000.0  # a report is no sign of life
    out = text_of(Group(*render_panels(st, now=1032.0)))
    [row] = [ln for ln in out.splitlines() if "rollout-0" in ln and "ago" in ln]
    assert "FROZEN" in row
    st.fold(beat("rollout-0", 1040.0, busy_frac=0.5))  # its restart's first heartbeat
    out = text_of(Group(*render_panels(st, now=1041.0)))
    assert "FROZEN" not in out


def test_the_run_panel_says_running_after_a_resume_of_a_finished_run():
    from schemas import Event

    st = RunState(run_id="r", kv={"trainer": {"step": 8, "done": True}})
    st.fold(Event(type="run_finished", role="trainer", worker_id="trainer-0", time=1.0))
    assert "[finished]" in text_of(render_panels(st, 2.0)[0])
    st.fold(Event(type="run_started", role="launcher", worker_id="launcher", time=2.0))
    assert "[running]" in text_of(render_panels(st, 3.0)[0])


def test_the_finished_line_names_the_run_its_last_step_and_reward():
    from areal.monitor.top import finished_line

    st = RunState(run_id="r1", finished={"steps": 8, "final_reward": 0.875, "wall_s": 42.0})
    assert finished_line(st) == (
        "top: run r1 finished at step 8, final reward 0.875, 42.0 s of training; "
        "its NATS server is gone"
    )
