"""Launcher pre-flight checks: each failure is one line naming the setting and the fix, raised
before anything starts (`areal run` exits 2 on it)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from areal.config import ConfigError, load_settings
from areal.launch.preflight import (
    check_data,
    check_extras,
    check_model_dir,
    check_reward,
    check_role,
    check_run,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("AREAL_"):
            monkeypatch.delenv(key)


def _one_line(e: pytest.ExceptionInfo[ConfigError]) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config error: "), msg
    return msg


@pytest.mark.parametrize(
    ("setting", "kind", "extra"),
    [("rollout.engine", "vllm", "vllm"), ("train.engine", "deepspeed", "deepspeed")],
)
def test_missing_extra_names_the_pip_command(setting, kind, extra):
    if importlib.util.find_spec(extra) is not None:
        pytest.skip(f"{extra} is installed here")
    s = load_settings(None, [f"{setting}={kind}"])
    with pytest.raises(ConfigError) as e:
        check_run(s)
    msg = _one_line(e)
    assert f"pip install 'areal-bus[{extra}]'" in msg and f"{setting}={kind}" in msg
    role = "rollout" if setting.startswith("rollout") else "trainer"
    with pytest.raises(ConfigError, match=rf"areal-bus\[{extra}\]"):
        check_role(role, s)  # the worker checks it too, before its prepare
    check_role("reward", s)  # a role that does not use that engine is not refused


def test_default_engines_need_no_extra():
    check_extras(load_settings(None))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("mathh", r"reward.fn: unknown reward function 'mathh'"),
        ("no_such_mod_q7:f", r"cannot import module 'no_such_mod_q7'.*working directory"),
        ("json:no_such_fn", r"has no attribute 'no_such_fn'"),
        ("json:__doc__", r"not a callable"),
    ],
)
def test_bad_reward_specs_are_one_line(spec, match):
    with pytest.raises(ConfigError, match=match) as e:
        check_reward(load_settings(None, [f"reward.fn={spec}"]))
    _one_line(e)


def test_a_reward_module_that_fails_to_import_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    name = f"broken_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("def score(c, a):\n    return 1.0\n1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        check_reward(load_settings(None, [f"reward.fn={name}:score"]))
    assert "raised ZeroDivisionError: division by zero; fix that module" in _one_line(e)
    (tmp_path / f"{name}2.py").write_text("def score(c, a) return 1.0\n")
    with pytest.raises(ConfigError, match="raised SyntaxError") as e:
        check_reward(load_settings(None, [f"reward.fn={name}2:score"]))
    _one_line(e)


def test_a_reward_module_in_the_working_directory_needs_no_pythonpath(tmp_path):
    # a fresh interpreter whose sys.path lacks the working directory, as the `areal` console
    # script's does, started in a directory that holds the module; a stray `colorsys.py` there
    # must not shadow the installed module of that name (the working directory comes last)
    (tmp_path / "my_reward.py").write_text("def score(completion, answer):\n    return 0.25\n")
    (tmp_path / "colorsys.py").write_text("def rgb_to_hsv(*a):\n    return 'shadow'\n")
    code = (
        "import sys, os; sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd())]; "
        "from areal.rewards.registry import get_reward_fn; "
        "print(get_reward_fn('my_reward:score')('x', 'y')); "
        "print(get_reward_fn('colorsys:rgb_to_hsv')(1.0, 0.0, 0.0))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["0.25", "(0.0, 1.0, 1.0)"]


def test_model_path_without_config_json(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    s = load_settings(None, [f"model.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"model.path .*\(no config.json\).*tiny preset") as e:
        check_model_dir(s)
    _one_line(e)
    (tmp_path / "config.json").write_text("{}")
    check_model_dir(s)


def test_a_model_dir_linking_to_the_runs_key_is_refused_naming_the_link(tmp_path):
    from areal.security.keys import ensure_run_keys

    out = tmp_path / "runs" / "exp"
    ensure_run_keys(out / "keys")  # an earlier launch of the run left its keys
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").symlink_to(out / "keys" / "weights_signing.key")
    s = load_settings(None, [f"model.path={model}", f"out_dir={out}"])
    with pytest.raises(
        ConfigError, match=r"model.path: .*tokenizer\.json leads to the run's secret"
    ) as e:
        check_run(s)
    _one_line(e)
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(out / "keys" / "new.key")  # not there yet: dangling
    with pytest.raises(ConfigError, match="dangling"):
        check_run(s)


def test_a_data_source_linking_out_is_refused(tmp_path):
    secret = tmp_path / "runs" / "exp" / "keys" / "nats" / "trainer.json"
    secret.parent.mkdir(parents=True)
    secret.write_text("{}")
    link = tmp_path / "tasks.jsonl"
    link.symlink_to(secret)
    s = load_settings(None, [f"data.source={link}", f"out_dir={tmp_path / 'runs' / 'exp'}"])
    with pytest.raises(ConfigError, match=r"data.source: .*tasks\.jsonl leads to the run's secret"):
        check_run(s)


def test_a_live_run_with_a_linked_key_refuses_to_start(tmp_path):
    """`areal run` itself: exit 2 with one line naming the link, before anything starts (no
    server, no worker, nothing shared; --out keeps only what the earlier launch left)."""
    from areal.security.keys import ensure_run_keys

    out = tmp_path / "runs" / "exp"
    ensure_run_keys(out / "keys")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "vocab.txt").symlink_to(out / "keys" / "weights_signing.key")
    res = subprocess.run(
        [sys.executable, "-m", "areal.cli", "run", str(ROOT / "examples" / "arithmetic.yaml"),
         "--out", str(out), "--resume", "--set", f"model.path={model}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "vocab.txt" in ln]
    assert len(lines) == 1 and "leads to the run's secret" in lines[0] and "model.path" in lines[0]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def _jsonl(tmp_path: Path, records: list[dict], name: str = "data.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return p


def test_dataset_records_are_checked_before_start(tmp_path):
    good = _jsonl(tmp_path, [{"prompt": "1+1=", "answer": "2"}])
    check_data(load_settings(None, [f"data.source={good}"]))
    bad = _jsonl(tmp_path, [{"prompt": "1+1=", "answer": "2"}, {"question": "x"}], "bad.jsonl")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: record has no 'prompt'") as e:
        check_data(load_settings(None, [f"data.source={bad}"]))
    assert "data.prompt_field" in _one_line(e)
    with pytest.raises(ConfigError, match=r"no 'q' field"):
        check_data(load_settings(None, [f"data.source={good}", "data.prompt_field=q"]))


def test_dataset_kind_and_task_options(tmp_path):
    csv = tmp_path / "data.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(ConfigError, match=r"expected a .jsonl or .parquet file"):
        check_data(load_settings(None, [f"data.source={csv}"]))
    with pytest.raises(ConfigError, match=r"data.task_kwargs .*remove the unknown option") as e:
        check_data(load_settings(None, ["data.task_kwargs={max_digitz: 3}"]))
    _one_line(e)
    with pytest.raises(ConfigError, match=r"unknown synthetic task 'synthetic:nope'") as e:
        check_run(load_settings(None, ["data.source=synthetic:nope"]))
    _one_line(e)


def test_the_example_config_passes_every_check():
    check_run(load_settings(ROOT / "examples" / "arithmetic.yaml"))
