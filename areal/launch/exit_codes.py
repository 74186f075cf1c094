"""Exit codes of `areal run` and of its workers, in one place: the worker entry point
(`areal.launch.worker`), the trainer's rank group (`areal.launch.ranks`) and the launcher
(`areal.launch.local`) all import them from here, so none imports another for a constant.

A worker's code tells the launcher what to do (`local.on_worker_exit`); the launcher's code
tells the user how the run ended (`areal run --help`). Signals give negative return codes, so
none of these collides with a killed process.
"""

from __future__ import annotations

import signal

# a worker's
EXIT_CONFIG = 2  # a deterministic failure (bad config, refused account): never restarted
EXIT_BUS_UNAVAILABLE = 3  # the NATS server stayed away past nats.outage_tolerance_s
EXIT_RANK_FAILED = 1  # a trainer rank's group failed (a rank died, a collective timed out)
# the launcher's, besides 0 (the run finished), EXIT_CONFIG and a failed worker's code
EXIT_NOT_FINISHED = 1  # the trainer exited 0 before train.total_steps: stopped from outside
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: Ctrl-C stopped the run
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: SIGTERM stopped the run
