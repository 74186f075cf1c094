"""Score a batch of samples in one process, each under its own timeout (a per-item SIGALRM).

This is what a reward worker's pool process runs for one pool call. It is synchronous and must
run in the main thread of its process (where a `ProcessPoolExecutor` worker runs its tasks):
Python delivers signals only there.

Invariants:
- Each item gets its own `timeout_s` budget, from the moment its scorer is called: a batch of
  samples that each finish within the timeout is never timed out as a whole.
- An item's outcome is `(reward, error, seconds)`: a scorer that returns within `timeout_s`
  gives its reward as a float and error None; one that raises an `Exception` gives reward 0 and
  `"Type: message"`; one still running after `timeout_s` is interrupted and gives reward 0 and
  `"timeout after Xs"` (so does one that returns after `timeout_s` all the same). The other
  items of the batch are scored all the same.
- The interrupt is an `ItemTimeout`, a `BaseException`, so a scorer's own `except Exception`
  (the code sandbox has one) cannot swallow it; a scorer that swallows it anyway is still
  reported as timed out.
- The SIGALRM handler and the real-time interval timer (ITIMER_REAL) in force before an item are
  restored after it (a timer that was running is re-armed with the time it has left, or at
  once if that ran out during the item).
- Not interruptible here: a scorer that blocks SIGALRM or sits in C code that never returns to
  the interpreter. The caller bounds the whole call with an outer deadline for those.
"""

from __future__ import annotations

import inspect
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from areal.rewards.registry import RewardFn, get_reward_fn

Scored = tuple[float, str | None, float]  # reward, error, seconds spent on the item
# completion, answer[, episode]: the episode (prompt, turns, tool calls, metadata) goes to a
# reward function that takes an `episode` keyword (`takes_episode`)
Item = tuple[str, str] | tuple[str, str, dict[str, Any]]


class ItemTimeout(BaseException):
    """Raised inside a scorer when its item's time is up (a BaseException: see the module)."""


def timeout_error(timeout_s: float) -> str:
    """The `error` of a sample whose scorer ran out of time (the same text wherever it is caught)."""
    return f"timeout after {timeout_s}s"


def score_items(fn_name: str, items: list[Item], timeout_s: float) -> list[Scored]:
    """Score each (completion, answer) with the reward fn `fn_name`, each within `timeout_s`.

    Returns one outcome per item, in order; never raises for a scorer's error or timeout.
    """
    fn = get_reward_fn(fn_name)
    return [score_item(fn, it[0], it[1], timeout_s, *it[2:]) for it in items]


def takes_episode(fn: RewardFn) -> bool:
    """Whether `fn` takes the episode: an `episode` parameter, or `**kwargs`."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: (completion, answer) only
        return False
    return any(p.name == "episode" or p.kind is p.VAR_KEYWORD for p in params)


def score_item(
    fn: RewardFn,
    completion: str,
    answer: str,
    timeout_s: float,
    episode: dict[str, Any] | None = None,
) -> Scored:
    """One item under its own alarm; the previous SIGALRM handler and timer are restored after.

    Off the main thread (no signals there) the item runs without an alarm.
    """
    call = (
        (lambda: fn(completion, answer, episode=episode))  # type: ignore[call-arg]
        if episode is not None and takes_episode(fn)
        else (lambda: fn(completion, answer))
    )
    if threading.current_thread() is not threading.main_thread():
        return _call_scorer(call, timeout_s, _NoAlarm())
    alarm = _Alarm()
    prev_handler = signal.signal(signal.SIGALRM, alarm.fire)
    try:
        return _call_scorer(call, timeout_s, alarm)
    finally:  # stop our timer before the old handler is back (SIGALRM's default: terminate)
        signal.setitimer(signal.ITIMER_REAL, 0)  # ours, disarmed: a pending one is a no-op
        signal.signal(signal.SIGALRM, prev_handler)
        alarm.restore_prev_timer()


class _NoAlarm:
    def arm(self, timeout_s: float) -> None:
        pass

    def disarm(self) -> bool:
        return False


class _Alarm:
    """A one-shot SIGALRM timer: `fire` raises `ItemTimeout` at most once, and only while armed."""

    def __init__(self) -> None:
        self.armed = False
        self.fired = False
        self._prev_timer: tuple[float, float] = (0.0, 0.0)
        self._t0 = time.perf_counter()

    def arm(self, timeout_s: float) -> None:
        self._t0 = time.perf_counter()
        self.armed = True
        self._prev_timer = signal.setitimer(signal.ITIMER_REAL, timeout_s)

    def fire(self, signum: int, frame: FrameType | None) -> None:
        if self.armed:
            self.armed, self.fired = False, True
            raise ItemTimeout

    def disarm(self) -> bool:
        """Stop raising; True if the alarm went off (the item timed out)."""
        self.armed = False
        return self.fired

    def restore_prev_timer(self) -> None:
        """Re-arm the timer that ran before `arm`, with the time it has left (if it ran)."""
        prev_delay_s, prev_interval_s = self._prev_timer
        if prev_delay_s > 0:
            left_s = max(1e-6, prev_delay_s - (time.perf_counter() - self._t0))
            signal.setitimer(signal.ITIMER_REAL, left_s, prev_interval_s)


def describe_error(e: BaseException) -> str:
    """`Type: message`, even for an exception whose message cannot be formatted (its
    `__str__` raising would fail the whole batch instead of this one item)."""
    try:
        return f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001 - any failure of the user's __str__
        return f"{type(e).__name__}: <its message could not be formatted>"


def _call_scorer(call: Callable[[], Any], timeout_s: float, alarm: _Alarm | _NoAlarm) -> Scored:
    # `ItemTimeout` can be raised at any point after `arm()` until `disarm()` has run (fire()
    # disarms too, so at most once): both run inside the outer `try`, whose `except` catches a
    # raise from anywhere, including from the inner `finally` itself.
    t0 = time.perf_counter()
    timed_out = False
    try:
        try:
            alarm.arm(timeout_s)
            reward, error = float(call()), None
        # the user's scorer failed: reward 0, reason kept. `SystemExit` too (a scorer built on
        # argparse or click exits on input it does not like): raised on, it would end the
        # reward worker, and every replica the group is redelivered to
        except (Exception, SystemExit) as e:
            reward, error = 0.0, describe_error(e)
        finally:
            timed_out = alarm.disarm()
    except ItemTimeout:
        timed_out = True
    seconds = time.perf_counter() - t0
    # Also a timeout: a scorer that caught ItemTimeout itself and went on, or one that returned
    # late because the alarm could not interrupt it (SIGALRM blocked, a long C call).
    if timed_out or seconds > timeout_s:
        reward, error = 0.0, timeout_error(timeout_s)
    return reward, error, seconds
