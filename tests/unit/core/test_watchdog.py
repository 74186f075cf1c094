"""The watchdog's decisions (`areal.core.watchdog`): heartbeats, starts, stops and steps in,
`Frozen` / `Recovered` out, on a clock the test drives. The numbers are worked by hand in the
comments."""

from __future__ import annotations

import pytest

from areal.core.watchdog import Frozen, Recovered, Watchdog, WatchdogPolicy

POLICY = WatchdogPolicy(frozen_after_s=10.0, startup_s=60.0, blind_after_s=3.0)


def beats(dog: Watchdog, t0: float, t1: float, *wids: str, every: float = 2.0) -> list[Frozen]:
    """`wids` beat every `every` s from t0 up to t1 (inclusive); the dog ticks after each round.
    Returns every Frozen found meanwhile."""
    found, t = [], t0
    while t <= t1 + 1e-9:
        for wid in wids:
            dog.beat(wid, wid.rsplit("-", 1)[0], t, pid=hash(wid) % 1000, host="h1")
        found += dog.tick(t)
        t += every
    return found


def test_a_silent_worker_is_frozen_exactly_at_the_bound() -> None:
    dog = Watchdog(POLICY)
    dog.beat("rollout-0", "rollout", 0.0, pid=11, host="h1")
    assert beats(dog, 0.0, 8.0, "trainer-0") == []  # rollout-0 silent 8 s < 10
    dog.beat("trainer-0", "trainer", 9.5)
    assert dog.tick(9.99) == []  # 9.99 s < 10
    # 10 s of silence, the others heard: the bound itself counts
    assert dog.tick(10.0) == [Frozen("rollout-0", "rollout", 10.0, True, 11, "h1")]
    assert dog.frozen() == ["rollout-0"]
    # reported once, however long it stays silent
    assert beats(dog, 10.0, 30.0, "trainer-0") == []


def test_a_worker_with_no_heartbeat_yet_is_judged_from_its_start_against_startup_s() -> None:
    dog = Watchdog(POLICY)
    dog.started("trainer-0", "trainer", 0.0, pid=7)
    assert beats(dog, 0.0, 58.0, "controller-0") == []  # loading its model: 58 s < 60
    dog.beat("controller-0", "controller", 59.0)
    [frozen] = dog.tick(60.0)  # 60 s since its start, no heartbeat: startup_s reached
    assert frozen == Frozen("trainer-0", "trainer", 60.0, False, 7, None)
    # once it has beaten, the shorter bound applies: silent 10 s after its first beat
    dog.beat("trainer-0", "trainer", 61.0, pid=7)
    assert dog.frozen() == []
    assert beats(dog, 61.0, 69.0, "controller-0") == []  # 8 s after its beat
    dog.beat("controller-0", "controller", 70.0)
    assert [f.worker_id for f in dog.tick(71.0)] == ["trainer-0"]  # 71 - 61 = 10 s


def test_a_worker_that_comes_back_is_recovered_at_the_next_new_step() -> None:
    dog = Watchdog(POLICY)
    # steps every 2 s up to t=4; rollout-0's last beat at t=4, then nothing
    for t in (0.0, 2.0, 4.0):
        dog.beat("rollout-0", "rollout", t)
        dog.beat("trainer-0", "trainer", t)
        assert dog.step(int(t // 2) + 1, t) == []  # steps 1, 2, 3 at t = 0, 2, 4
    assert beats(dog, 6.0, 12.0, "trainer-0") == []  # silent 8 s at t=12
    dog.beat("trainer-0", "trainer", 14.0)
    assert [f.silent_s for f in dog.tick(14.0)] == [10.0]  # 14 - 4
    beats(dog, 16.0, 24.0, "trainer-0")
    dog.beat("rollout-0", "rollout", 25.0)  # back (SIGCONT, or its restart's first beat)
    assert dog.frozen() == []
    # the first new step after it is back closes the episode: out from its last beat (t=4) to
    # its return (t=25): 21 s; the run had no new step from t=4 (step 3) to t=27: 23 s
    assert dog.step(4, 27.0) == [Recovered("rollout-0", "rollout", down_s=21.0, held_s=23.0)]
    assert dog.step(5, 28.0) == []  # closed once


def test_held_s_counts_the_steps_made_between_the_freeze_and_its_report() -> None:
    dog = Watchdog(POLICY)
    dog.beat("rollout-0", "rollout", 0.0)
    dog.beat("rollout-1", "rollout", 0.0)
    dog.step(1, 1.0)  # the last step before the freeze (rollout-0's last beat at t=0)
    for t in (2.0, 4.0, 6.0, 8.0):
        dog.beat("rollout-1", "rollout", t)
        assert dog.tick(t) == []
        if t == 6.0:
            dog.step(2, 6.0)  # rollout-1 carries on: gap 5 s
        if t == 8.0:
            dog.step(3, 8.0)  # gap 2 s
    dog.beat("rollout-1", "rollout", 10.0)
    assert [f.worker_id for f in dog.tick(10.0)] == ["rollout-0"]
    dog.beat("rollout-0", "rollout", 12.0)
    # gaps since the freeze: 1->6 (5 s), 6->8 (2 s), 8->13 (5 s): the longest is 5
    assert dog.step(4, 13.0) == [Recovered("rollout-0", "rollout", down_s=12.0, held_s=5.0)]


def test_a_step_redone_after_a_trainer_restart_is_not_progress() -> None:
    dog = Watchdog(POLICY)
    dog.beat("trainer-0", "trainer", 0.0)
    dog.beat("rollout-0", "rollout", 0.0)
    dog.step(5, 0.0)
    beats(dog, 2.0, 8.0, "rollout-0")
    dog.beat("rollout-0", "rollout", 10.0)
    assert [f.worker_id for f in dog.tick(10.0)] == ["trainer-0"]
    dog.stopped("trainer-0", 10.5)  # killed
    dog.started("trainer-0", "trainer", 11.0, pid=99)  # restarted from its checkpoint (step 3)
    dog.beat("trainer-0", "trainer", 20.0, pid=99)
    assert dog.step(4, 21.0) == []  # redone
    assert dog.step(5, 22.0) == []  # redone
    # down: t=0 (last beat) -> t=20 (the restart's first beat); held: step 5 at t=0 -> step 6
    assert dog.step(6, 23.0) == [Recovered("trainer-0", "trainer", down_s=20.0, held_s=23.0)]


def test_an_outage_of_the_bus_names_nobody_and_is_not_silence() -> None:
    dog = Watchdog(POLICY)
    assert beats(dog, 0.0, 4.0, "rollout-0", "trainer-0") == []
    # the server is away from t=4 to t=100: nobody beats, the dog keeps ticking
    for t in range(5, 101):
        assert dog.tick(float(t)) == [], t
    assert dog.blind(100.0)
    # everyone back at t=101 but rollout-0, which is slow to reconnect: its silence excludes
    # the gap (4 -> 101, 97 s), so it is 0 s at t=101 and 10 s at t=111
    assert beats(dog, 101.0, 109.0, "trainer-0") == []
    dog.beat("trainer-0", "trainer", 110.0)
    assert dog.tick(110.0) == []  # 9 s of heard silence
    dog.beat("trainer-0", "trainer", 111.0)
    assert [f.silent_s for f in dog.tick(111.0)] == [pytest.approx(10.0)]


def test_a_dog_that_never_heard_anyone_judges_no_one() -> None:
    dog = Watchdog(POLICY)
    dog.started("controller-0", "controller", 0.0)
    assert dog.tick(1000.0) == [] and dog.blind(1000.0)


def test_the_observer_stalling_is_not_the_workers_silence() -> None:
    dog = Watchdog(POLICY)
    beats(dog, 0.0, 4.0, "rollout-0", "trainer-0")
    # the launcher itself was busy (stopping a trainer group) from t=4 to t=30: the beats
    # queued meanwhile arrive together at t=30
    dog.beat("trainer-0", "trainer", 30.0)
    dog.beat("rollout-0", "rollout", 30.0)
    assert dog.tick(30.0) == []
    assert beats(dog, 32.0, 38.0, "trainer-0", "rollout-0") == []


def test_a_stopped_worker_is_not_judged_and_late_beats_of_it_change_nothing() -> None:
    dog = Watchdog(POLICY)
    dog.started("reward-0", "reward", 0.0, pid=5)
    dog.beat("reward-0", "reward", 1.0, pid=5)
    dog.stopped("reward-0", 2.0, pid=5)
    dog.beat("reward-0", "reward", 2.5, pid=5)  # its last beat, delivered after its exit
    assert beats(dog, 3.0, 40.0, "trainer-0") == []
    # a stop of an earlier incarnation does not stop the current one
    dog.started("reward-0", "reward", 41.0, pid=6)
    dog.beat("reward-0", "reward", 42.0, pid=6)
    dog.stopped("reward-0", 42.5, pid=5)
    assert beats(dog, 43.0, 51.0, "trainer-0") == []  # 51 - 42 = 9 s
    dog.beat("trainer-0", "trainer", 52.0)
    assert [f.worker_id for f in dog.tick(52.0)] == ["reward-0"]  # 52 - 42 = 10 s


def test_a_worker_joined_from_elsewhere_is_judged_from_its_first_beat() -> None:
    dog = Watchdog(POLICY)
    dog.beat("rollout-gpu7", "rollout", 0.0, pid=321, host="gpu7")
    beats(dog, 0.0, 8.0, "trainer-0")
    dog.beat("trainer-0", "trainer", 10.0)
    assert dog.tick(10.0) == [Frozen("rollout-gpu7", "rollout", 10.0, True, 321, "gpu7")]
    # it said it stopped (a `worker_stopped` event) before going silent: not frozen
    dog2 = Watchdog(POLICY)
    dog2.beat("rollout-gpu7", "rollout", 0.0, pid=321)
    dog2.stopped("rollout-gpu7", 1.0, pid=321)
    assert beats(dog2, 2.0, 30.0, "trainer-0") == []


def test_the_clock_never_goes_back() -> None:
    dog = Watchdog(POLICY)
    dog.tick(5.0)
    with pytest.raises(ValueError, match="went back"):
        dog.beat("rollout-0", "rollout", 4.0)


def test_a_start_is_never_judged_sooner_than_a_silence() -> None:
    # startup_s below frozen_after_s: the start gets frozen_after_s (a start is no quicker
    # than a heartbeat period)
    dog = Watchdog(WatchdogPolicy(frozen_after_s=30.0, startup_s=10.0, blind_after_s=3.0))
    dog.started("rollout-0", "rollout", 0.0)
    assert beats(dog, 0.0, 28.0, "trainer-0") == []  # 28 s: past startup_s, short of 30
    dog.beat("trainer-0", "trainer", 30.0)
    assert [f.silent_s for f in dog.tick(30.0)] == [30.0]
