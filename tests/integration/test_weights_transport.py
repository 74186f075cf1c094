"""`weights.transport: auto`, the default: `areal run` sends weights as files when no other host
can reach its NATS server (embedded on loopback, or a loopback `nats.url`): the bytes then never
cross the server, twice per version, on the cores that generate and train. A server other hosts
reach keeps the object store (a joiner there may not share this disk), and a transport set in the
config is kept as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal.config import WeightsSettings, load_settings
from areal.launch.local import Launcher


def _settings(tmp_path: Path, run_id: str, *sets: str):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return load_settings(
        None, [f"out_dir={tmp_path / 'run'}", f"model.path={model}", f"run_id={run_id}", *sets]
    )


def _prepared(launcher: Launcher) -> dict:
    try:
        return json.loads(launcher.prepare().read_text())
    finally:
        if launcher.server is not None:
            launcher.server.stop()


def test_a_server_only_this_host_reaches_gets_file_weights(tmp_path, nats_url, run_id):
    cfg = _prepared(Launcher(_settings(tmp_path, run_id, f"nats.url={nats_url}")))
    weights = (tmp_path / "run" / "weights").resolve()
    assert cfg["weights"]["transport"] == "file"
    assert cfg["weights"]["dir"] == str(weights) and weights.is_dir()  # absolute, made at once


def test_an_embedded_server_on_loopback_gets_file_weights(tmp_path, run_id):
    cfg = _prepared(Launcher(_settings(tmp_path, run_id)))
    assert cfg["weights"]["transport"] == "file"


def test_a_server_other_hosts_reach_keeps_the_object_store(tmp_path, run_id):
    cfg = _prepared(Launcher(_settings(tmp_path, run_id, "nats.listen_host=0.0.0.0")))
    assert cfg["weights"]["transport"] == "object_store" and cfg["weights"]["dir"] is None
    assert not (tmp_path / "run" / "weights").exists()


def test_a_transport_set_in_the_config_is_kept(tmp_path, nats_url, run_id):
    s = _settings(tmp_path, run_id, f"nats.url={nats_url}", "weights.transport=object_store")
    assert _prepared(Launcher(s))["weights"]["transport"] == "object_store"


@pytest.mark.parametrize(
    ("given", "joinable", "resolved"),
    [
        ("auto", False, "file"),
        ("auto", True, "object_store"),
        ("file", True, "file"),
        ("object_store", False, "object_store"),
    ],
)
def test_resolve_transport(given, joinable, resolved):
    w = WeightsSettings(transport=given)
    w.resolve_transport(other_hosts_can_join=joinable)
    assert w.transport == resolved


def test_an_unresolved_auto_is_the_object_store():
    """A worker started on its own (`areal worker`, compose) with `auto` reads and writes no
    files: the object store, which every host can reach."""
    assert WeightsSettings().file_dir("/out") is None
