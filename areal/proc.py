"""Process hygiene: child processes that die with their parent, SIGKILL included.

Invariants:
- `die_with_parent(sig)` (Linux) asks the kernel to send `sig` to the calling process when its
  parent dies (PR_SET_PDEATHSIG). It is meant for a fresh child: as a `preexec_fn` (it survives
  the `exec`) or a pool `initializer`. Given `parent_pid`, a child whose parent already died
  before the call (the race every PDEATHSIG user has) signals itself at once.
- The libc handle is loaded when this module is imported, never between fork and exec.
- On other platforms it does nothing: there, children rely on their parent's clean shutdown.
- `parse_cpu_list` reads the kernel's cpu-list syntax ("0", "1-3", "0,2-3"): a non-empty set of
  cores, or ValueError naming what is wrong. `child_setup(cpus)` is a `preexec_fn` that does
  `die_with_parent` and, given cores, pins the child to them (`os.sched_setaffinity`, Linux):
  every thread the child starts later inherits them, so the whole process stays there.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1

if sys.platform.startswith("linux"):
    import ctypes

    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
else:  # pragma: no cover - the project's machines are Linux
    _LIBC = None


def die_with_parent(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> None:
    """Deliver `sig` to this process when its parent dies (see the module invariants)."""
    if _LIBC is None:
        return
    _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig))
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def die_with_parent_kill() -> None:
    """`preexec_fn` form of `die_with_parent(SIGKILL)` (no arguments)."""
    die_with_parent(signal.SIGKILL)


_CPU_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cpu_list(text: str) -> frozenset[int]:
    """The cores of a cpu list ("0", "1-3", "0,2-3"), as `taskset -c` and /proc take them."""
    cpus: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        m = _CPU_RANGE.match(part)
        if not m:
            raise ValueError(f"{text!r} is not a cpu list (e.g. '0', '1-3', '0,2-3')")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi < lo:
            raise ValueError(f"{text!r}: the range {part!r} runs backwards")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: set[int] | frozenset[int]) -> str:
    """`parse_cpu_list`'s inverse, with ranges folded: {0, 1, 2, 5} -> "0-2,5"."""
    out: list[str] = []
    for c in sorted(cpus):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def child_setup(cpus: frozenset[int] | None = None) -> Callable[[], None]:
    """A `preexec_fn`: die with the parent (SIGTERM) and, given `cpus`, run on those cores."""

    def setup() -> None:
        die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup
