"""User scorers for the reward-service tests (importable by the spawned pool processes)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def picky(completion: str, answer: str) -> float:
    """1 if right; raises on 'boom'; hangs on 'hang'; kills its own process on 'crash'."""
    if completion == "boom":
        raise ValueError("scorer exploded")
    if completion == "crash":
        os._exit(3)
    if completion == "hang":
        time.sleep(60)
    return float(completion.strip() == answer.strip())


def slow(completion: str, answer: str) -> float:
    """1 if right, after 0.8 s of 'work' (well within a 2 s per-sample timeout)."""
    time.sleep(0.8)
    return float(completion.strip() == answer.strip())


def stubborn(completion: str, answer: str) -> float:
    """Retries its work on any Exception (3 tries); the work hangs on 'hang'."""
    for _ in range(3):
        try:
            if completion == "hang":
                time.sleep(60)
            return float(completion.strip() == answer.strip())
        except Exception:
            continue
    return 0.5


def deaf(completion: str, answer: str) -> float:
    """Catches everything, even the timeout (a bare except), then answers anyway on 'hang'."""
    if completion == "hang":
        try:
            time.sleep(60)
        except BaseException:  # noqa: BLE001 - the misbehaviour under test
            return 1.0
    return float(completion.strip() == answer.strip())


def unstoppable(completion: str, answer: str) -> float:
    """Blocks SIGALRM (its timeout cannot interrupt it), then hangs on 'hang' (only killing its
    process ends it); on 'hang-once:PATH' hangs only if the file PATH does not exist yet, after
    creating it, and else scores 1 at once."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    if completion.startswith("hang-once:"):
        marker = Path(completion.removeprefix("hang-once:"))
        if marker.exists():
            return 1.0
        marker.touch()
        completion = "hang"
    if completion == "hang":
        time.sleep(60)
    return float(completion.strip() == answer.strip())


def exits(completion: str, answer: str) -> float:
    """Exits on 'exit', as a scorer built on argparse or click does on input it rejects."""
    if completion == "exit":
        raise SystemExit(2)
    return float(completion.strip() == answer.strip())


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message")


def unprintable(completion: str, answer: str) -> float:
    """Raises, on 'bad', an exception whose message cannot be formatted."""
    if completion == "bad":
        raise _Unprintable()
    return float(completion.strip() == answer.strip())


def slow_or_crash(completion: str, answer: str) -> float:
    """Kills its process on 'crash' (a segfaulting C extension, an OOM kill); else 1 s of work."""
    if completion == "crash":
        os._exit(139)
    time.sleep(1.0)
    return float(completion.strip() == answer.strip())


def tool_use_reward(completion: str, answer: str, episode: dict) -> float:
    """Sees the episode: 1.0 when the answer is right and came after a tool call that worked."""
    used = any(c["error"] is None for c in episode["tool_calls"])
    last = episode["turns"][-1]
    return float(used and last["role"] == "model" and last["text"].strip() == answer)
