"""Rollout scheduling core: tasks, handles, weight offers, gating and switching."""

from __future__ import annotations

from areal.core.scheduling import Joined, Request, Scheduler, SchedulerPolicy

INTERRUPTIBLE = SchedulerPolicy(interruptible=True)
DRAIN = SchedulerPolicy(interruptible=False)


def test_new_then_adopted_keeps_both_handles() -> None:
    s: Scheduler[str, str] = Scheduler(INTERRUPTIBLE)
    assert s.on_task("t0", 3, 0, "lease-a") is Joined.NEW
    assert [r.key for r in s.queue] == ["t0/0", "t0/1", "t0/2"]
    assert s.on_task("t0", 3, 0, "lease-b") is Joined.ADOPTED  # a redelivery: nothing queued
    assert len(s.queue) == 3
    # handles come back once, after all G = 3 indices are published (a repeat counts once)
    assert s.sample_published("t0", 0) == []
    assert s.sample_published("t0", 0) == []
    assert s.sample_published("t0", 2) == []
    assert s.sample_published("t0", 1) == ["lease-a", "lease-b"]
    assert not s.is_active("t0")
    assert s.sample_published("t0", 1) == []  # unknown now: nothing to ack twice


def test_fail_all_hands_every_handle_back() -> None:
    s: Scheduler[str, str] = Scheduler(INTERRUPTIBLE)
    s.on_task("t0", 2, 0, "a")
    s.on_task("t1", 2, 0, "b")
    s.on_task("t1", 2, 0, "c")
    assert s.task_failed("t0") == ["a"]
    assert [r.task_id for r in s.queue] == ["t1", "t1"]
    assert s.fail_all() == ["b", "c"]
    assert not s.queue and not s.tasks


def test_weight_offers_older_ignored() -> None:
    s: Scheduler[str, str] = Scheduler(INTERRUPTIBLE, version=2)
    assert not s.offer_weights(2, "w2")  # not newer than loaded
    assert s.offer_weights(4, "w4")
    assert not s.offer_weights(3, "w3")  # older than pending
    assert s.known_version == 4
    assert s.switch_at_boundary(0.0) == (4, "w4")
    assert (s.version, s.pending) == (4, None)


def test_take_requests_waits_for_the_admission_version() -> None:
    s: Scheduler[str, str] = Scheduler(INTERRUPTIBLE)
    s.on_task("t0", 1, 0, "a")
    s.on_task("t1", 2, 1, "b")
    assert s.take_requests(0.0) == [Request("t0", 0, 0)]
    assert s.take_requests(0.0) == []  # t1 needs v1: none known
    assert s.needed_version() == 1
    s.offer_weights(1, "w1")
    assert s.needed_version() is None
    # interruptible: v1 is switched to at this boundary, so t1 may start now (max_n = 1)
    assert s.take_requests(1.0, max_n=1) == [Request("t1", 0, 1)]
    assert s.switch_at_boundary(1.0) == (1, "w1")
    assert s.take_requests(1.0) == [Request("t1", 1, 1)]


def test_drain_mode_switches_between_batches_only() -> None:
    s: Scheduler[str, str] = Scheduler(DRAIN)
    s.on_task("t0", 1, 0, "a")
    s.offer_weights(1, "w1")
    assert s.take_requests(0.0) == []  # an update is pending: nothing new starts
    assert s.switch_at_boundary(0.0) is None  # never mid-batch
    assert s.switch_between_batches(0.0) == (1, "w1")
    assert s.take_requests(0.0) == [Request("t0", 0, 0)]
    assert s.switch_between_batches(0.0) is None  # nothing pending


def test_interrupt_min_interval_rate_limits_switches() -> None:
    s: Scheduler[str, str] = Scheduler(SchedulerPolicy(True, interrupt_min_interval_s=10.0))
    s.offer_weights(1, "w1")
    assert s.switch_at_boundary(100.0) == (1, "w1")  # last switch at 100
    s.offer_weights(2, "w2")
    s.on_task("t0", 1, 2, "a")
    # at 105 (5 s < 10 s since the last switch): no switch, and v2's task may not start
    assert s.take_requests(105.0) == []
    assert s.switch_at_boundary(105.0) is None
    # at 110 (10 s since): allowed
    assert s.take_requests(110.0) == [Request("t0", 0, 2)]
    assert s.switch_at_boundary(110.0) == (2, "w2")


def test_a_failed_switch_at_a_boundary_is_pending_again() -> None:
    s: Scheduler[str, str] = Scheduler(INTERRUPTIBLE)
    s.on_task("t0", 2, 1, "h")
    assert s.offer_weights(1, "w1")
    assert len(s.take_requests(0.0)) == 2  # v1's requests start: the switch is at this boundary
    assert s.switch_at_boundary(0.0) == (1, "w1")  # ... and the engine's load fails
    assert s.fail_all() == ["h"]  # the rollout hands the batch back
    s.switch_failed((1, "w1"), engine_version=0)
    assert (s.version, s.pending, s.known_version) == (0, (1, "w1"), 1)
    assert not s.offer_weights(1, "w1")  # no second download: it is still here
    s.on_task("t0", 2, 1, "h2")  # the task comes back
    assert s.switch_between_batches(1.0) == (1, "w1")  # the retry
    assert (s.version, s.pending) == (1, None)
    assert [r.key for r in s.take_requests(1.0)] == ["t0/0", "t0/1"]


def test_a_failed_switch_between_batches_starts_nothing_on_the_old_weights() -> None:
    s: Scheduler[str, str] = Scheduler(DRAIN)
    s.on_task("t0", 1, 0, "a")
    s.on_task("t1", 1, 1, "b")
    s.offer_weights(1, "w1")
    assert s.switch_between_batches(0.0) == (1, "w1")  # the engine's load fails
    s.switch_failed((1, "w1"), engine_version=0)
    assert s.take_requests(0.0) == []  # drain mode, v1 pending again: nothing starts
    assert s.needed_version() is None  # v1 is here: no fetch
    assert s.switch_between_batches(2.0) == (1, "w1")  # the retry, when the caller's pause ends
    assert s.take_requests(2.0) == [Request("t0", 0, 0), Request("t1", 0, 1)]


def test_a_failed_switch_yields_to_a_newer_update() -> None:
    s: Scheduler[str, str] = Scheduler(INTERRUPTIBLE, version=3)
    s.offer_weights(4, "w4")
    assert s.switch_at_boundary(0.0) == (4, "w4")
    assert s.offer_weights(5, "w5")  # fetched while v4 was loading
    s.switch_failed((4, "w4"), engine_version=3)
    assert (s.version, s.pending) == (3, (5, "w5"))  # v4 is not loaded again: v5 is newer
    s.on_task("t0", 1, 4, "a")
    assert s.take_requests(1.0) == [Request("t0", 0, 4)]  # with v5 switched to at this boundary
    assert s.switch_at_boundary(1.0) == (5, "w5")


def test_a_switch_that_failed_after_the_engine_took_the_weights_is_not_retried() -> None:
    # e.g. vLLM reloaded and relabelled, then failed to resume: the engine holds v1
    s: Scheduler[str, str] = Scheduler(INTERRUPTIBLE)
    s.offer_weights(1, "w1")
    assert s.switch_at_boundary(0.0) == (1, "w1")
    s.switch_failed((1, "w1"), engine_version=1)
    assert (s.version, s.pending) == (1, None)


NEEDED_FIRST = SchedulerPolicy(interruptible=True, needed_first=True, max_staleness=1)


def test_needed_first_holds_the_next_batch_until_the_needed_one_is_generated() -> None:
    # η = 1: at v1 the trainer's next batch is the one admitted at v0 (t0); t1 (admitted at v1)
    # waits while a sample of t0 is still generating here, even a published-later one
    s: Scheduler[str, str] = Scheduler(NEEDED_FIRST)
    s.on_task("t0", 2, 0, "a")
    assert s.take_requests(0.0) == [Request("t0", 0, 0), Request("t0", 1, 0)]
    s.offer_weights(1, "w1")
    s.on_task("t1", 2, 1, "b")
    assert s.needed_limit(1) == 0
    assert s.take_requests(1.0) == []  # v1 is switched to here, but t0 is still generating
    assert s.switch_at_boundary(1.0) == (1, "w1")
    s.sample_generated("t0", 1)
    assert s.take_requests(2.0) == []  # t0/0 still generates
    s.sample_generated("t0", 0)  # generated, not yet published: the hold ends all the same
    assert s.needed_limit(1) is None
    assert s.take_requests(3.0) == [Request("t1", 0, 1), Request("t1", 1, 1)]


def test_needed_first_starts_needed_requests_queued_behind_later_ones() -> None:
    # a needed task queued after a later one (e.g. redelivered) is picked out of the queue, so
    # the hold can never wait on a request it holds itself
    s: Scheduler[str, str] = Scheduler(NEEDED_FIRST, version=2)
    s.on_task("late", 1, 2, "a")
    s.on_task("old", 2, 1, "b")
    assert s.take_requests(0.0, max_n=1) == [Request("old", 0, 1)]
    assert s.take_requests(0.0) == [Request("old", 1, 1)]
    assert [r.key for r in s.queue] == ["late/0"]
    s.sample_generated("old", 0)
    s.sample_generated("old", 1)
    assert s.take_requests(0.0) == [Request("late", 0, 2)]


def test_needed_first_ends_when_a_needed_task_fails_or_is_off() -> None:
    s: Scheduler[str, str] = Scheduler(NEEDED_FIRST, version=1)
    s.on_task("t0", 1, 0, "a")
    s.on_task("t1", 1, 1, "b")
    assert s.take_requests(0.0) == [Request("t0", 0, 0)]
    assert s.take_requests(0.0) == []
    assert s.task_failed("t0") == ["a"]  # handed back: nothing of it generates here any more
    assert s.take_requests(0.0) == [Request("t1", 0, 1)]
    # off (the default), or at η = 0 where every admitted task is the next batch: queue order
    for policy in (INTERRUPTIBLE, SchedulerPolicy(True, needed_first=True, max_staleness=0)):
        s = Scheduler(policy, version=1)
        s.on_task("t0", 1, 0, "a")
        s.on_task("t1", 1, 1, "b")
        assert s.take_requests(0.0, max_n=1) == [Request("t0", 0, 0)]
        assert s.take_requests(0.0) == [Request("t1", 0, 1)]
