"""`areal worker`: `--help` lists the roles, a role's `--help` is light, a deterministic
failure exits `EXIT_CONFIG` with one line (before connecting to any server)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal.cli import WORKER_ROLES, main
from areal.launch.exit_codes import EXIT_CONFIG

ROOT = Path(__file__).resolve().parents[3]


def _run(*code_or_args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_")}
    return subprocess.run(
        [sys.executable, *code_or_args], cwd=ROOT, capture_output=True, text=True, env=env
    )


def test_worker_roles_are_the_worker_modules():
    assert sorted(WORKER_ROLES) == sorted(
        p.stem for p in (ROOT / "workers").glob("*.py") if p.stem != "__init__"
    )


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_worker_help_lists_the_roles(flag, capsys):
    assert main(["worker", flag]) == 0
    out = capsys.readouterr().out
    for role, what in WORKER_ROLES.items():
        assert f"  {role}" in out and what in out


def test_worker_without_a_role_prints_the_roles_and_fails(capsys):
    assert main(["worker"]) == 2
    assert "roles:" in capsys.readouterr().err


def test_unknown_role_suggests_the_closest(capsys):
    assert main(["worker", "rollot"]) == 2
    err = capsys.readouterr().err
    assert "unknown role 'rollot'; did you mean rollout?" in err


def test_role_help_works_without_heavy_imports():
    code = (
        "import sys\n"
        "from areal.cli import main\n"
        "try:\n    main(['worker', 'rollout', '--help'])\n"
        "except SystemExit as e:\n    print('exit', e.code)\n"
        "print('heavy', sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    res = _run("-c", code)
    assert res.returncode == 0, res.stderr
    assert "usage: areal worker rollout" in res.stdout and "--nats-url" in res.stdout
    assert "exit 0" in res.stdout and "heavy []" in res.stdout


def test_a_missing_extra_exits_config_with_one_line_before_connecting():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    # port 9 (discard): nothing listens; the check must come before any connection attempt
    res = _run(
        "-m",
        "areal.cli",
        "worker",
        "rollout",
        "--nats-url",
        "nats://127.0.0.1:9",
        "--set",
        "rollout.engine=vllm",
    )
    assert res.returncode == EXIT_CONFIG, res.stdout + res.stderr
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("config error: rollout.engine=vllm") and "areal-bus[vllm]" in last
    assert "Traceback" not in res.stdout + res.stderr
