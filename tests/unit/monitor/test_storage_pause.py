"""`areal top` shows a storage pause (issue 42): from the trainer's `storage_full` /
`write_failed` event until its `storage_recovered`, in whichever order a replay folds them."""

from __future__ import annotations

from areal.monitor.state import RunState
from areal.monitor.top import run_panel, storage_line
from schemas import Event
from tests.unit.monitor.test_top import text_of

SINCE = 1000.0


def full(since: float = SINCE, worker: str = "trainer-0") -> Event:
    detail = {
        "what": "checkpoint",
        "path": "/runs/r/checkpoint",
        "needs_bytes": 12 * 2**20,
        "free_bytes": 0,
        "error": "OSError: [Errno 28] No space left on device",
        "since": since,
    }
    return Event(type="storage_full", role="trainer", worker_id=worker, time=since, detail=detail)


def recovered(since: float = SINCE, paused_s: float = 7.5, worker: str = "trainer-0") -> Event:
    detail = {
        "kind": "storage_full",
        "what": "checkpoint",
        "path": "/runs/r/checkpoint",
        "paused_s": paused_s,
        "retries": 3,
        "since": since,
    }
    return Event(
        type="storage_recovered",
        role="trainer",
        worker_id=worker,
        time=since + paused_s,
        detail=detail,
    )


def test_a_storage_pause_shows_until_it_is_recovered():
    st = RunState(run_id="r")
    assert st.storage_pause() is None and storage_line(st, SINCE) is None
    st.fold(full())
    assert st.storage_pause()["path"] == "/runs/r/checkpoint"
    line = storage_line(st, now=SINCE + 42)
    assert line == (
        "paused: storage full at /runs/r/checkpoint, needs 12.0 MB, free 0.0 MB, since 42s "
        "(checkpoint)"
    )
    panel = text_of(run_panel(st, SINCE + 42))
    assert "[paused]" in panel and "paused: storage full at /runs/r/checkpoint" in panel
    st.fold(recovered())
    assert st.storage_pause() is None
    assert storage_line(st, SINCE + 50) == "last storage pause: 7.5 s at /runs/r/checkpoint"
    assert "[running]" in text_of(run_panel(st, SINCE + 50))


def test_folding_is_idempotent_and_order_tolerant():
    a, b = RunState(), RunState()
    for ev in (full(), recovered(), full()):  # a replayed start after the recovery
        a.fold(ev)
    for ev in (recovered(), full()):  # the recovery replayed first
        b.fold(ev)
    for st in (a, b):
        assert st.storage_pause() is None
        assert st.last_storage_recovery()["paused_s"] == 7.5


def test_a_new_pause_after_a_recovery_shows_again():
    st = RunState()
    st.fold(full())
    st.fold(recovered())
    st.fold(full(since=SINCE + 100))
    assert st.storage_pause()["since"] == SINCE + 100
    st.fold(recovered(since=SINCE + 100, paused_s=2.0))
    assert st.storage_pause() is None and st.last_storage_recovery()["paused_s"] == 2.0
