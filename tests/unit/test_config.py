"""The settings model: source precedence, nested env, the logging / cache fields, error messages.

Precedence (highest first): `--set` > environment (`AREAL_...`) > YAML > default. Each test picks
a different value per source so the winner is unambiguous.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from areal.config import ConfigError, MonitorSettings, load_monitor_settings, load_settings

ENV_VARS = ("AREAL_", "NATS_URL")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No AREAL_* / NATS_URL from the caller's shell (e.g. AREAL_CACHE_DIR) leaks into a test."""
    for key in list(os.environ):
        if key.startswith(ENV_VARS):
            monkeypatch.delenv(key)


def _yaml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_precedence_set_over_env_over_yaml_over_default(tmp_path, monkeypatch):
    cfg = _yaml(tmp_path, "algo:\n  max_staleness: 1\n")
    assert load_settings(None).algo.max_staleness == 4  # the default
    assert load_settings(cfg).algo.max_staleness == 1  # YAML over default
    monkeypatch.setenv("AREAL_ALGO__MAX_STALENESS", "2")
    assert load_settings(cfg).algo.max_staleness == 2  # env over YAML
    assert load_settings(cfg, ["algo.max_staleness=3"]).algo.max_staleness == 3  # --set over env


def test_sources_merge_per_field_not_per_section(tmp_path, monkeypatch):
    # each source sets a different field of `algo`; none wipes the others' fields
    cfg = _yaml(tmp_path, "algo:\n  batch_size: 4\n")
    monkeypatch.setenv("AREAL_ALGO__MAX_STALENESS", "2")
    s = load_settings(cfg, ["algo.group_size=3"])
    assert (s.algo.batch_size, s.algo.max_staleness, s.algo.group_size) == (4, 2, 3)
    assert s.algo.eps_clip_low == 0.2  # untouched: the default


def test_nested_env_and_top_level_env(monkeypatch):
    monkeypatch.setenv("AREAL_ALGO__MAX_STALENESS", "2")
    monkeypatch.setenv("AREAL_NATS__URL", "nats://10.0.0.7:4222")
    monkeypatch.setenv("AREAL_RUN_ID", "exp7")
    s = load_settings(None)
    assert s.algo.max_staleness == 2
    assert s.nats.url == "nats://10.0.0.7:4222"
    assert s.run_id == "exp7"


def test_log_and_cache_fields_default_and_from_env(tmp_path, monkeypatch):
    s = load_settings(None)
    assert (s.log_level, s.log_format, s.cache_dir) == ("INFO", "console", None)
    monkeypatch.setenv("AREAL_LOG_LEVEL", "debug")  # any case; stored upper-case
    monkeypatch.setenv("AREAL_LOG_FORMAT", "json")
    monkeypatch.setenv("AREAL_CACHE_DIR", str(tmp_path / "models"))
    s = load_settings(None)
    assert (s.log_level, s.log_format, s.cache_dir) == ("DEBUG", "json", str(tmp_path / "models"))


def test_new_fields_survive_the_config_json_round_trip(tmp_path, monkeypatch):
    # `areal run` writes the resolved settings to config.json; every worker loads that file
    monkeypatch.setenv("AREAL_LOG_FORMAT", "json")
    s = load_settings(None, ["log_level=WARNING", f"cache_dir={tmp_path}"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(s.model_dump(mode="json")))
    monkeypatch.delenv("AREAL_LOG_FORMAT")
    back = load_settings(path)
    assert (back.log_level, back.log_format, back.cache_dir) == ("WARNING", "json", str(tmp_path))
    assert back == s


def test_bad_value_names_the_field_the_value_and_the_fix():
    with pytest.raises(ConfigError) as e:
        load_settings(None, ["algo.max_staleness=-1"])
    msg = str(e.value)
    assert "algo.max_staleness" in msg and "greater than or equal to 0" in msg
    assert "(got -1)" in msg and "--set algo.max_staleness=" in msg


def test_bad_env_value_names_the_field(monkeypatch):
    monkeypatch.setenv("AREAL_LOG_FORMAT", "xml")
    with pytest.raises(ConfigError, match=r"log_format: .*'console' or 'json' \(got 'xml'\)"):
        load_settings(None)


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "where", "source", "meant"),
    [
        ("", ["algo.max_stalenes=2"], "algo.max_stalenes", "--set", "algo.max_staleness"),
        ("algo:\n  max_stalenes: 2\n", [], "algo.max_stalenes", "run.yaml", "algo.max_staleness"),
        ("log_levels: DEBUG\n", [], "log_levels", "run.yaml", "log_level"),  # top level
        ("", ["max_staleness=2"], "max_staleness", "--set", "algo.max_staleness"),  # no section
        ("", ["trian.lr=1e-3"], "trian", "--set", "train"),  # a typo'd section
    ],
)
def test_unknown_key_says_did_you_mean(tmp_path, yaml_text, overrides, where, source, meant):
    cfg = _yaml(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as e:
        load_settings(cfg, overrides)
    msg = str(e.value)
    assert msg.startswith(f"config error: {where}: unknown setting (from ")
    assert source in msg and msg.endswith(f"did you mean {meant}?")
    assert f"--set {where}=" not in msg  # never the advice to set the typo


def test_unknown_key_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("AREAL_ALGO__MAX_STALENES", "2")
    with pytest.raises(ConfigError) as e:
        load_settings(None)
    assert str(e.value) == (
        "config error: algo.max_stalenes: unknown setting (from the environment: "
        "AREAL_ALGO__MAX_STALENES); did you mean algo.max_staleness?"
    )


def test_unknown_key_with_nothing_close_lists_the_section():
    with pytest.raises(ConfigError, match=r"algo.zzz: unknown setting .*here are: batch_size, "):
        load_settings(None, ["algo.zzz=1"])


def test_a_close_choice_is_suggested_for_a_literal():
    with pytest.raises(ConfigError) as e:
        load_settings(None, ["rollout.engine=vlm"])
    assert str(e.value) == (
        "config error: rollout.engine: Input should be 'torch' or 'vllm' (got 'vlm'); "
        "did you mean 'vllm'?"
    )


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (["algo.batch_size"], "expected key=value"),
        (["algo..batch_size=2"], "empty part"),
        (["algo=1", "algo.batch_size=2"], "algo was already set to a value"),
        (["algo.batch_size=2", "algo=1"], "algo is a section whose fields are set too"),
    ],
)
def test_malformed_overrides_are_config_errors(items, match):
    with pytest.raises(ConfigError, match=match):
        load_settings(None, items)


def test_monitor_settings_defaults():
    m = load_monitor_settings()
    assert m == MonitorSettings(
        run_id=None, nats_url="nats://127.0.0.1:4222", log_level="ERROR", log_format="console"
    )


def test_monitor_settings_from_env(monkeypatch):
    monkeypatch.setenv("NATS_URL", "nats://plain:4222")
    assert load_monitor_settings().nats_url == "nats://plain:4222"  # the nats ecosystem's name
    monkeypatch.setenv("AREAL_NATS__URL", "nats://areal:4222")
    assert load_monitor_settings().nats_url == "nats://areal:4222"  # ours wins over NATS_URL
    monkeypatch.setenv("AREAL_RUN_ID", "exp7")
    monkeypatch.setenv("AREAL_LOG_LEVEL", "warning")
    monkeypatch.setenv("AREAL_ALGO__MAX_STALENESS", "2")  # a run setting: ignored here
    m = load_monitor_settings()
    assert (m.run_id, m.log_level) == ("exp7", "WARNING")


def test_monitor_settings_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("AREAL_LOG_LEVEL", "loud")
    with pytest.raises(ConfigError, match=r"AREAL_LOG_LEVEL: .*\(got 'LOUD'\); fix or unset"):
        load_monitor_settings()


def test_episode_settings_default_to_single_turn_and_resolve_the_episode_budget(tmp_path):
    r = load_settings(None).rollout
    assert (r.workflow, r.workflow_kwargs, r.max_turns, r.max_episode_tokens) == (
        "single_turn",
        {},
        1,
        None,
    )
    assert r.sample_limits() == {"max_new_tokens": 16, "max_turns": 1, "max_episode_tokens": 32}
    yaml_text = (
        "rollout:\n  workflow: tool_call\n  workflow_kwargs: {tools: [calc], max_tool_s: 2}\n"
        "  max_turns: 4\n  max_new_tokens: 32\n"
    )
    r = load_settings(_yaml(tmp_path, yaml_text)).rollout
    assert r.workflow_kwargs == {"tools": ["calc"], "max_tool_s": 2}
    assert r.episode_tokens == 2 * 32 * 4  # None: as many environment tokens as model tokens
    r = load_settings(None, ["rollout.max_turns=3", "rollout.max_episode_tokens=40"]).rollout
    assert r.sample_limits() == {"max_new_tokens": 16, "max_turns": 3, "max_episode_tokens": 40}


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("rollout.max_turns=0", "rollout.max_turns.*greater than or equal to 1"),
        ("rollout.max_episode_tokens=0", "greater than or equal to 1"),
        ("rollout.max_episode_tokens=15", "max_episode_tokens=15 is below .*max_new_tokens=16"),
        ("rollout.workflow=", "rollout.workflow"),
    ],
)
def test_bad_episode_settings_name_the_field(override, match):
    with pytest.raises(ConfigError, match=match):
        load_settings(None, [override])


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "train.nproc=2",
            "config error: train.nproc=2 needs a distributed engine: set train.engine=fsdp or "
            "deepspeed, or train.nproc=1",
        ),
        (
            "train.n_minibatches=100000",
            "config error: train.n_minibatches=100000 exceeds the 128 samples of a step "
            "(algo.batch_size * algo.group_size)",
        ),
        (
            "reward.range=[1,0]",
            "config error: reward.range [1.0, 0.0] must be finite [lo, hi], lo <= hi",
        ),
    ],
)
def test_a_cross_field_error_is_the_validators_own_line(override, line):
    # issue 44: they read "config error: train: Value error, train.nproc=2 ...; set it in the
    # YAML or with --set train=..." (pydantic's prefix, and a --set that cannot work)
    with pytest.raises(ConfigError) as e:
        load_settings(None, ["algo.batch_size=16", "algo.group_size=8", override])
    assert str(e.value) == line
