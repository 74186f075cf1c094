"""Prometheus gauges from a RunState, through a real registry and the text exposition format."""

from __future__ import annotations

from prometheus_client import generate_latest

from areal.monitor.exporter import families, make_registry
from areal.monitor.state import RunState
from tests.unit.monitor.test_state import beat, step


def test_gauges_in_exposition_text():
    st = RunState()
    st.fold(step(1, 1.0, dropped_stale=2, staleness_max=1))
    st.fold(step(2, 2.0, dropped_stale=3, staleness_max=1, reward_mean=0.75))
    st.fold(beat("rollout-0", 2000.0, samples=0, tokens=0, busy_frac=0.25))
    st.fold(beat("rollout-0", 2002.0, samples=20, tokens=60, busy_frac=0.25))
    st.set_queues(
        {
            "prompts": {"messages": 4, "ack_pending": 1, "pending": 3},
            "dlq": {"messages": 1, "subjects": {"areal.r.dlq.rewards": 1}},
        }
    )
    registry, collector = make_registry()
    collector.snapshot = families(st, now=2002.5)
    text = generate_latest(registry).decode()
    for line in (
        "areal_policy_version 2.0",
        "areal_train_step 2.0",
        "areal_reward_mean 0.75",
        "areal_staleness_max 1.0",
        "areal_dropped_stale_total 3.0",
        'areal_samples_per_second{role="rollout"} 10.0',  # 20 samples in 2 s
        'areal_samples_per_second{role="trainer"} 64.0',
        'areal_busy_fraction{role="rollout",worker="rollout-0"} 0.25',
        'areal_queue_depth{stream="prompts"} 4.0',
        'areal_ack_pending{stream="prompts"} 1.0',
        'areal_dlq_messages{stage="rewards"} 1.0',
        'areal_live_workers{role="rollout"} 1.0',
        'areal_staleness_samples{lag="0"} 64.0',
    ):
        assert line in text, line


def test_gone_workers_are_not_exported():
    st = RunState()
    st.fold(beat("rollout-0", 100.0, busy_frac=0.5))
    registry, collector = make_registry()
    collector.snapshot = families(st, now=1000.0)
    assert "rollout-0" not in generate_latest(registry).decode()
