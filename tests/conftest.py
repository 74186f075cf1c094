"""Shared fixtures: a real nats-server per test session (free port, temp store dir, stopped by
its own PID), and a fresh run id per test so streams never collide.

A test that runs a CLI entry point in this process configures structlog for the whole process
(`areal.logging.setup_logging`: its level, loggers cached on first use); that configuration is
undone after the test, so a later test that captures log events sees every level.

Hypothesis runs without its per-example deadline: on a loaded machine (a busy laptop, CI beside
other jobs) one example can take seconds, and no wall-clock limit may decide a test."""

from __future__ import annotations

import uuid

import pytest
import structlog
from hypothesis import settings

from areal.bus.embedded import EmbeddedNats

settings.register_profile("areal", deadline=None)
settings.load_profile("areal")


@pytest.fixture(autouse=True)
def _logging_configured_by_a_test_is_undone():
    import areal.logging

    yield
    if areal.logging._configured:
        structlog.reset_defaults()
        areal.logging._configured = False


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    server = EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats")).start()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture
def run_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"
