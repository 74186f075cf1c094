"""RunState folding: step records, heartbeats, events, dead letters -> what top shows."""

from __future__ import annotations

import pytest

from areal.monitor.state import LIVE_S, RunState
from schemas import DeadLetter, Event, MetricRecord
from tests.factories import make_sample


def step(n: int, wall_s: float, **kw) -> MetricRecord:
    values = {
        "step": n,
        "version": n,
        "wall_s": wall_s,
        "reward_mean": 0.1 * n,
        "samples": 64,
        "tokens": 128,
        "staleness_hist": {"0": 32, "1": 32},
        "interrupted_frac": 0.25,
        "weights_publish_s": 0.02,
        "trainer_idle_frac": 0.4,
        **kw,
    }
    return MetricRecord(
        role="trainer", worker_id="trainer-0", type="step", time=1000 + wall_s, values=values
    )


def beat(wid: str, t: float, role: str = "rollout", **values) -> MetricRecord:
    return MetricRecord(role=role, worker_id=wid, type="heartbeat", time=t, values=values)


def test_step_records_fold_idempotently_and_in_any_order():
    st = RunState()
    for rec in (step(2, 2.0), step(1, 1.0), step(2, 2.0), step(3, 3.0)):
        st.fold(rec)
    assert [r["step"] for r in st.step_records()] == [1, 2, 3]
    assert st.version == 3
    assert st.reward_series() == pytest.approx([0.1, 0.2, 0.3])
    # 3 steps of 32 samples at lag 0 and 32 at lag 1, counted once each (the replayed step 2 too)
    assert st.staleness_totals() == {0: 96, 1: 96}


def test_step_rate_and_trainer_throughput_come_from_wall_clock_of_the_steps():
    st = RunState()
    for n in range(1, 5):  # steps at wall 0.5, 1.0, 1.5, 2.0 s
        st.fold(step(n, 0.5 * n))
    # 3 intervals over 1.5 s -> 2 steps/s; 3 steps * 64 samples / 1.5 s = 128 samples/s
    assert st.step_rate() == pytest.approx(2.0)
    samples_s, tokens_s = st.throughput(now=2000.0)["trainer"]
    assert samples_s == pytest.approx(128.0)
    assert tokens_s == pytest.approx(256.0)


def test_single_step_has_no_rate():
    st = RunState()
    st.fold(step(1, 1.0))
    assert st.step_rate() is None
    assert "trainer" not in st.throughput(now=2000.0)


def test_heartbeats_give_live_workers_rates_and_idle():
    st = RunState()
    # rollout-0: 100 samples / 300 tokens per 2 s heartbeat, 30% busy
    for i in range(5):
        st.fold(beat("rollout-0", 100.0 + 2 * i, samples=100 * i, tokens=300 * i, busy_frac=0.3))
    st.fold(beat("rollout-1", 50.0, samples=5, busy_frac=0.9))  # went quiet long ago
    st.fold(beat("trainer-0", 108.0, role="trainer", busy_frac=0.75, version=7))
    now = 108.5
    live = st.live_workers(now)
    assert [w.worker_id for w in live["rollout"]] == ["rollout-0"]
    assert [w.worker_id for w in live["trainer"]] == ["trainer-0"]
    assert st.throughput(now)["rollout"] == pytest.approx((50.0, 150.0))  # 400 / 8 s, 1200 / 8 s
    assert st.idle(now) == pytest.approx({"rollout": 0.7, "trainer": 0.25})
    assert st.version == 7
    assert "rollout-1" in [w.worker_id for w in st.workers_by_role(now, within_s=120)["rollout"]]
    assert st.live_workers(108.0 + LIVE_S + 0.1) == {}


def test_older_heartbeat_never_replaces_a_newer_one():
    st = RunState()
    st.fold(beat("rollout-0", 10.0, busy_frac=0.5, version=3))
    st.fold(beat("rollout-0", 8.0, busy_frac=0.1, version=2))  # replayed late
    assert st.workers["rollout-0"].values["version"] == 3


def test_trainer_idle_falls_back_to_the_step_record():
    st = RunState()
    st.fold(step(1, 1.0, trainer_idle_frac=0.4))
    assert st.idle(now=5000.0) == {"trainer": 0.4}


def test_observed_traffic_gives_reward_rate_and_worker_ids():
    from schemas import ScoredGroup, ScoredSample

    st = RunState(observing_since=100.0)
    sample = make_sample(n=4)  # 4 output tokens, worker "w"
    one = ScoredSample(sample=sample, reward=1.0, reward_worker_id="reward-0")
    for i in range(5):  # group messages of 2 samples each
        st.fold(ScoredGroup(scored=[one, one]), 100.0 + 0.4 * i)
    # 10 scored samples in the 2 s observed so far
    assert st.throughput(now=102.0)["reward"] == pytest.approx((5.0, 20.0))
    assert [w.worker_id for w in st.live_workers(102.0)["reward"]] == ["reward-0"]
    st.fold(sample)  # no receive time: not counted as traffic
    assert "rollout" not in st.activity


def test_events_and_dead_letters():
    st = RunState()
    st.fold(Event(type="task_dropped_stale", role="trainer", worker_id="trainer-0", time=5.0))
    st.fold(
        Event(
            type="run_finished",
            role="trainer",
            worker_id="trainer-0",
            time=6.0,
            detail={"steps": 8},
        )
    )
    st.fold(
        DeadLetter(stage="trajectories", reason="payload is not msgpack", subject="s", payload=b"x")
    )
    assert st.events == {"task_dropped_stale": 1, "run_finished": 1}
    assert st.finished == {"steps": 8}
    assert st.dlq_counts() == {"trajectories": 1}
    # the stream's per-subject counts win when they know more (e.g. before history replay ends)
    st.set_queues(
        {
            "dlq": {
                "messages": 4,
                "subjects": {"areal.r.dlq.trajectories": 3, "areal.r.dlq.rewards": 1},
            }
        }
    )
    assert st.dlq_counts() == {"rewards": 1, "trajectories": 3}


def test_weight_times_and_interrupted_fraction():
    st = RunState()
    st.fold(step(1, 1.0, weights_publish_s=0.02, interrupted_frac=0.5))
    st.fold(step(2, 2.0, weights_publish_s=0.04, interrupted_frac=0.0))
    st.fold(beat("rollout-0", 2000.0, weight_load_s=0.3, weight_loads=3, busy_frac=0.5))
    wt = st.weight_times(now=2000.0)
    assert wt["publish_last_s"] == pytest.approx(0.04)
    assert wt["publish_mean_s"] == pytest.approx(0.03)
    assert wt["load_mean_s"] == pytest.approx(0.1)
    assert st.interrupted_frac() == pytest.approx((0.0, 0.25))


def test_admission_keeps_the_latest_record():
    st = RunState()
    st.fold(
        MetricRecord(
            role="controller",
            worker_id="controller-0",
            type="admission",
            time=2.0,
            values={"admitted": 16, "outstanding": 16, "capacity": 40},
        )
    )
    st.fold(
        MetricRecord(
            role="controller",
            worker_id="controller-0",
            type="admission",
            time=1.0,
            values={"admitted": 8, "outstanding": 8, "capacity": 40},
        )
    )
    assert st.admission["admitted"] == 16
    assert "controller-0" in st.workers


def test_a_launch_after_the_run_finished_reopens_it():
    # issue 44: `--resume` of a finished run (a larger total_steps); the trainer's `done` in
    # KV stays the earlier launch's until its restored trainer resets it
    st = RunState()
    st.kv = {"trainer": {"step": 8, "done": True}}
    finished = Event(type="run_finished", role="trainer", worker_id="trainer-0", time=6.0)
    st.fold(finished)
    assert st.is_finished()
    st.fold(Event(type="run_started", role="launcher", worker_id="launcher", time=7.0))
    assert not st.is_finished() and st.finished is None
    assert "launcher" not in st.workers  # the launcher is no worker
    st.fold(finished.model_copy(update={"time": 9.0}))  # the extended run ends too
    assert st.is_finished()
    # a run that finished with no launch event on record (an older launcher): its KV says so
    old = RunState(kv={"trainer": {"done": True}})
    assert old.is_finished()
