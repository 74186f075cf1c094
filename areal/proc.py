"""Process hygiene: child processes that die with their parent, SIGKILL included.

Invariants:
- `die_with_parent(sig)` (Linux) asks the kernel to send `sig` to the calling process when its
  parent dies (PR_SET_PDEATHSIG). It is meant for a fresh child: as a `preexec_fn` (it survives
  the `exec`) or a pool `initializer`. Given `parent_pid`, a child whose parent already died
  before the call (the race every PDEATHSIG user has) signals itself at once.
- The libc handle is loaded when this module is imported, never between fork and exec.
- On other platforms it does nothing: there, children rely on their parent's clean shutdown.
"""

from __future__ import annotations

import os
import signal
import sys

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
