"""`areal prepare` (areal.launch.prepare): keys and NATS accounts for workers started by compose,
kept when run again, and a finished run refused with the fix."""

from __future__ import annotations

import json

import pytest

from areal.cli import main
from areal.config import ConfigError, load_settings
from areal.launch.prepare import prepare_run


def _settings(tmp_path, steps: int = 10):
    return load_settings(None, [f"out_dir={tmp_path / 'run'}", f"train.total_steps={steps}"])


def test_writes_keys_and_accounts_and_keeps_them(tmp_path):
    s = _settings(tmp_path)
    nats = tmp_path / "run" / "keys" / "nats"
    prepare_run(
        s, nats_config_dir=str(nats), listen="0.0.0.0:4222", store_dir="/data", build_model=False
    )
    keys = tmp_path / "run" / "keys"
    signing = (keys / "weights_signing.key").read_bytes()
    conf = (nats / "nats-server.conf").read_text()
    assert '"0.0.0.0:4222"' in conf and '"/data"' in conf
    assert {p.name for p in nats.glob("*.json")} >= {"trainer.json", "rollout.json"}
    password = json.loads((nats / "trainer.json").read_text())
    prepare_run(
        s, nats_config_dir=str(nats), listen="0.0.0.0:4222", store_dir="/data", build_model=False
    )  # a restarted stack: the same keys and passwords
    assert (keys / "weights_signing.key").read_bytes() == signing
    assert json.loads((nats / "trainer.json").read_text()) == password


def _finish(tmp_path, step: int) -> None:
    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "trainer_state.json").write_text(json.dumps({"trainer": {"step": step}}))
    (out / "summary.json").write_text("{}")


def test_a_finished_run_is_refused_naming_the_fix(tmp_path):
    _finish(tmp_path, step=10)
    with pytest.raises(ConfigError, match="already finished.*AREAL_RUN_ID.*down -v"):
        prepare_run(
            _settings(tmp_path),
            nats_config_dir=None,
            listen="0.0.0.0:4222",
            store_dir=None,
            build_model=False,
        )
    assert not (tmp_path / "run" / "keys").exists()  # refused before writing anything
    # a larger total_steps extends it: not refused
    prepare_run(
        _settings(tmp_path, steps=20),
        nats_config_dir=None,
        listen="0.0.0.0:4222",
        store_dir=None,
        build_model=False,
    )


def test_cli_exits_2_with_one_line(tmp_path, capsys):
    _finish(tmp_path, step=10)
    rc = main(
        [
            "prepare",
            "--no-model",
            "--set",
            f"out_dir={tmp_path / 'run'}",
            "--set",
            "train.total_steps=10",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("config error: run 'areal' already finished")
