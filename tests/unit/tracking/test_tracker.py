"""`areal.tracking.Tracker`: records reach every tracker in order, on its own thread; a tracker
that fails warns once and is switched off; a slow one drops and counts, never blocks; close is
bounded. Fake backends stand in for the libraries (the real ones: test_backends.py, e2e)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from structlog.testing import capture_logs

from areal.tracking import Record, Tracker
from areal.tracking.tracker import eval_record, scalars, step_record

CONFIG = {"run_id": "t", "algo": {"batch_size": 4}}


class Fake:
    def __init__(self, name: str = "fake", *, fail_in: str | None = None, fail_at: int = 0):
        self.name, self.fail_in, self.fail_at = name, fail_in, fail_at
        self.configs: list[dict] = []
        self.records: list[Record] = []
        self.closed = False
        self.gate = threading.Event()
        self.gate.set()  # clear it to hold the tracker's thread in log()
        self.threads: set[str] = set()

    def open(self, config: dict[str, Any]) -> None:
        self.threads.add(threading.current_thread().name)
        if self.fail_in == "open":
            raise ConnectionError("http://127.0.0.1:1 is not reachable")
        self.configs.append(config)

    def log(self, rec: Record) -> None:
        self.gate.wait()
        if self.fail_in == "log" and len(self.records) >= self.fail_at:
            raise OSError("disk full")
        self.records.append(rec)

    def close(self) -> None:
        self.closed = True

    def fix(self, error: BaseException) -> str:
        return "do the thing"


def step(n: int) -> dict:
    return {"step": n, "reward_mean": 0.5, "loss": 1.0, "staleness_hist": {"0": 3, "1": 1}}


def events(logs: list[dict], name: str) -> list[dict]:
    return [e for e in logs if e["event"] == name]


def test_records_reach_every_tracker_with_the_config_once_then_close():
    a, b = Fake("a"), Fake("b")
    t = Tracker([a, b], config=CONFIG)
    t.start()
    for n in (1, 2, 3):
        t.log_step(step(n))
    t.log_eval({"round": 0, "version": 2, "eval_reward": 0.75, "n": 4, "time": 1e9})
    stats = t.close(timeout_s=10)
    for f in (a, b):
        assert f.configs == [CONFIG] and f.closed
        assert [r.step for r in f.records] == [1, 2, 3, 2]
        assert f.threads == {f"areal-tracker-{f.name}"}  # never the caller's thread
    assert a.records[0] == Record(
        "train/step",
        1,
        {
            "train/reward_mean": 0.5,
            "train/loss": 1.0,
            "train/staleness_hist/0": 3.0,
            "train/staleness_hist/1": 1.0,
        },
    )
    # eval rounds sit on their own axis, the policy version; eval_reward -> eval/reward
    assert a.records[3] == Record(
        "eval/version", 2, {"eval/round": 0.0, "eval/reward": 0.75, "eval/n": 4.0}
    )
    assert stats["a"].logged == 4 and stats["a"].dropped == 0 and stats["a"].error is None


@pytest.mark.parametrize("where", ["open", "log"])
def test_a_failing_tracker_warns_once_and_the_others_go_on(where: str):
    bad, good = Fake("bad", fail_in=where, fail_at=1), Fake("good")
    t = Tracker([bad, good], config=CONFIG)
    with capture_logs() as logs:
        t.start()
        for n in range(1, 21):
            t.log_step(step(n))  # never raises, whatever the tracker does
        stats = t.close(timeout_s=10)
    failed = events(logs, "tracker_failed")
    assert len(failed) == 1, failed
    assert failed[0]["tracker"] == "bad" and failed[0]["log_level"] == "warning"
    assert "do the thing" in failed[0]["fix"] and "training goes on" in failed[0]["fix"]
    assert len(good.records) == 20 and good.closed
    logged = 0 if where == "open" else 1
    assert len(bad.records) == logged and not bad.closed
    assert stats["bad"].logged == logged
    assert stats["bad"].dropped == 20 - logged  # every record it never wrote is counted
    assert stats["bad"].error is not None
    assert events(logs, "tracking_closed")


def test_a_slow_tracker_drops_and_counts_past_its_queue_and_never_blocks_the_caller():
    slow = Fake("slow")
    slow.gate.clear()  # its thread hangs in log() until the gate opens
    t = Tracker([slow], config=CONFIG, queue_size=3)
    with capture_logs() as logs:
        t.start()
        for n in range(1, 11):
            t.log_step(step(n))  # returns at once although nothing is written
        slow.gate.set()
        stats = t.close(timeout_s=10)
    # 3 waited in the queue, and the thread may have taken one before (held in log()): the
    # rest were dropped, and close() waited for room for its end marker, dropping none
    assert len(slow.records) + stats["slow"].dropped == 10
    assert len(slow.records) in (3, 4) and slow.closed
    assert stats["slow"].logged == len(slow.records)
    full = events(logs, "tracker_queue_full")
    assert len(full) == 1 and full[0]["tracker"] == "slow" and full[0]["queue_size"] == 3


def test_close_gives_up_on_a_hung_tracker_and_says_so():
    hung = Fake("hung")
    hung.gate.clear()
    t = Tracker([hung], config=CONFIG, close_timeout_s=0.2)
    with capture_logs() as logs:
        t.start()
        t.log_step(step(1))
        t.log_step(step(2))
        stats = t.close()  # tracking.close_timeout_s
    assert stats["hung"].abandoned and not hung.closed
    assert stats["hung"].dropped == 1  # step 2 still queued; step 1 is inside log()
    (ev,) = events(logs, "tracker_abandoned")
    assert ev["tracker"] == "hung" and "close_timeout_s" in ev["fix"]
    hung.gate.set()


def test_nothing_is_logged_after_close_and_close_twice_is_harmless():
    f = Fake()
    t = Tracker([f], config=CONFIG)
    t.start()
    t.log_step(step(1))
    t.close()
    t.log_step(step(2))
    assert t.close()["fake"].logged == 1
    assert [r.step for r in f.records] == [1]


def test_a_record_without_its_axis_is_skipped_with_a_warning():
    f = Fake()
    t = Tracker([f], config=CONFIG)
    t.start()
    with capture_logs() as logs:
        t.log_step({"loss": 1.0})  # no step
    t.close()
    assert f.records == [] and events(logs, "tracker_record_skipped")


def test_scalars_flatten_and_keep_only_numbers():
    rec = {"step": 3, "loss": 0.25, "done": True, "name": "x", "hist": {"0": 2, "b": False}}
    assert scalars(rec, skip=("step",)) == {"loss": 0.25, "done": 1.0, "hist/0": 2.0}
    assert step_record(rec).values == {
        "train/loss": 0.25,
        "train/done": 1.0,
        "train/hist/0": 2.0,
    }
    assert eval_record({"round": 1, "version": 4, "eval_reward": 1, "time": 5.0}) == Record(
        "eval/version", 4, {"eval/round": 1.0, "eval/reward": 1.0}
    )
