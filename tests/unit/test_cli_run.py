"""`areal run` without a config file says in one line what it runs (issue 44: it started a
default run silently); with one it says nothing of the kind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import areal.launch.local
import areal.logging
from areal.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arithmetic.yaml"


class _Launcher:
    """Stands in for the launcher: the test is about what `areal run` says before it."""

    def __init__(self, settings, **_kw) -> None:
        self.settings = settings

    def run(self) -> int:
        return 0


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("AREAL_")]:
        monkeypatch.delenv(key)
    monkeypatch.setattr(areal.launch.local, "Launcher", _Launcher)
    monkeypatch.setattr(areal.logging, "setup_logging", lambda **_kw: None)


def test_no_config_is_one_line_naming_the_defaults_and_the_quickstart(capsys, tmp_path):
    assert main(["run", "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("areal run: no config file given: running the built-in defaults")
    assert f"--out {tmp_path / 'r'}" in err[0] and "synthetic:arithmetic" in err[0]
    assert "areal run examples/arithmetic.yaml" in err[0]


def test_a_config_file_runs_without_that_line(capsys, tmp_path):
    assert main(["run", str(EXAMPLE), "--out", str(tmp_path / "r")]) == 0
    assert "no config file" not in capsys.readouterr().err
