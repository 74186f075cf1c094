"""structlog, configured once per process: console for humans, JSON in containers/CI logs.

Invariants:
- The first `setup_logging` call of a process fixes the renderer and the level; later calls only
  bind more context (`role`, `worker_id`, ...).
- Logging never raises for want of disk: a line the log file refuses is dropped and counted.
- The level and format come from the caller (the settings' `log_level` / `log_format`, i.e.
  `AREAL_LOG_LEVEL` / `AREAL_LOG_FORMAT`); this module reads no environment variable. It only
  sets defaults for third-party libraries' variables (HF progress bars, tokenizers threads).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Literal

import structlog

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LogFormat = Literal["console", "json"]

_configured = False


class _CurrentStderr:
    """Whatever `sys.stderr` is at the time of each write: a logger cached on first use keeps
    working after `sys.stderr` is replaced (a redirect, a test's capture that has closed).

    A write the file refuses (`OSError`: the log's disk is full) drops the line instead of
    raising into the code that logged, so a full disk costs log lines, never the worker; the
    next line that gets through says how many were lost."""

    def __init__(self) -> None:
        self.dropped = 0

    def write(self, text: str) -> int:
        try:
            if self.dropped:
                sys.stderr.write(f"({self.dropped} log lines lost: the log could not be written)\n")
                self.dropped = 0
            return sys.stderr.write(text)
        except OSError:
            self.dropped += 1
            return 0

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            sys.stderr.flush()


_CURRENT_STDERR = _CurrentStderr()


def setup_logging(*, level: LogLevel, log_format: LogFormat, **context: object) -> None:
    """Configure structlog (first call only) and bind `context` to every later event.

    `level`: events below it are dropped; `log_format`: "console" (colours on a TTY) or "json"
    (one object per line)."""
    global _configured
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not _configured:
        renderer = (
            structlog.processors.JSONRenderer()
            if log_format == "json"
            else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        )
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso"),
                structlog.processors.format_exc_info,
                renderer,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level)),
            logger_factory=structlog.PrintLoggerFactory(file=_CURRENT_STDERR),
            cache_logger_on_first_use=True,
        )
        _configured = True
    if context:
        structlog.contextvars.bind_contextvars(**context)
