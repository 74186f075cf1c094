"""structlog, configured once per process: console for humans, JSON in containers/CI logs."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def setup_logging(
    json_logs: bool | None = None, level: str | None = None, **context: object
) -> None:
    global _configured
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if json_logs is None:
        json_logs = os.environ.get("AREAL_LOG_FORMAT", "console") == "json"
    lvl = getattr(logging, (level or os.environ.get("AREAL_LOG_LEVEL", "INFO")).upper())
    if not _configured:
        renderer = (
            structlog.processors.JSONRenderer()
            if json_logs
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
            wrapper_class=structlog.make_filtering_bound_logger(lvl),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=True,
        )
        _configured = True
    if context:
        structlog.contextvars.bind_contextvars(**context)
