"""Where `areal tap | top | metrics-exporter` take the server, the run and the log level from.

Flags win; else `MonitorSettings` (AREAL_NATS__URL, then NATS_URL; AREAL_RUN_ID; AREAL_LOG_*);
else the defaults. With a run id given, resolving it needs no server, so no NATS is involved.
"""

from __future__ import annotations

import argparse
import os

import pytest

import areal.logging
from areal.monitor.cli import _conn


@pytest.fixture
def logging_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """Records `setup_logging` calls instead of configuring structlog for the whole test run."""
    for key in list(os.environ):
        if key.startswith(("AREAL_", "NATS_URL")):
            monkeypatch.delenv(key)
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(areal.logging, "setup_logging", lambda **kw: calls.append(kw))
    return calls


def _args(nats_url: str | None = None, run_id: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(cmd="top", nats_url=nats_url, run_id=run_id)


def test_environment_supplies_url_run_and_log_level(monkeypatch, logging_calls):
    monkeypatch.setenv("NATS_URL", "nats://plain:4222")
    monkeypatch.setenv("AREAL_RUN_ID", "exp7")
    monkeypatch.setenv("AREAL_LOG_LEVEL", "info")
    assert _conn(_args()) == ("nats://plain:4222", "exp7")
    assert logging_calls == [{"level": "INFO", "log_format": "console", "role": "top"}]
    monkeypatch.setenv("AREAL_NATS__URL", "nats://areal:4222")
    assert _conn(_args()) == ("nats://areal:4222", "exp7")


def test_flags_win_over_the_environment(monkeypatch, logging_calls):
    monkeypatch.setenv("AREAL_NATS__URL", "nats://areal:4222")
    monkeypatch.setenv("AREAL_RUN_ID", "exp7")
    assert _conn(_args("nats://flag:4222", "exp8")) == ("nats://flag:4222", "exp8")
    # without AREAL_LOG_LEVEL the monitor logs from ERROR up only (stdout stays data)
    assert logging_calls == [{"level": "ERROR", "log_format": "console", "role": "top"}]


def test_defaults_without_flags_or_environment(logging_calls):
    assert _conn(_args(run_id="exp7")) == ("nats://127.0.0.1:4222", "exp7")


def test_the_exporter_listens_on_loopback_unless_told_otherwise():
    # issue 44: it listened on 0.0.0.0 by default, showing the run's metrics to the network
    from areal.cli import build_parser

    p = build_parser()
    assert p.parse_args(["metrics-exporter"]).addr == "127.0.0.1"
    assert p.parse_args(["metrics-exporter", "--addr", "0.0.0.0"]).addr == "0.0.0.0"
