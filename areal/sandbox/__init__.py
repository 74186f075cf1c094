"""The code sandbox: untrusted Python in its own process, isolated and limited.

`run_sandboxed(solution, tests, preamble)` runs the three in one interpreter and returns the
harness's verdict (`run.py` holds the supervisor and the invariants, `harness.py` the code that
runs inside). The `code` reward scores with it; the `python` tool (`areal.tools`) runs a model's
code in it, keeping the program's stdout.
"""

from areal.sandbox.run import (
    DEFAULT_MEMORY_BYTES,
    DEFAULT_TIMEOUT_S,
    MAX_FILE_BYTES,
    Isolation,
    SandboxResult,
    Verdict,
    own_uid_per_run,
    resolve_isolation,
    run_sandboxed,
)

__all__ = [
    "DEFAULT_MEMORY_BYTES",
    "DEFAULT_TIMEOUT_S",
    "MAX_FILE_BYTES",
    "Isolation",
    "SandboxResult",
    "Verdict",
    "own_uid_per_run",
    "resolve_isolation",
    "run_sandboxed",
]
