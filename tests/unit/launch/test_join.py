"""What `areal run` shares for workers on other hosts, and the config a joining worker runs
with (`areal.launch.join`): no host paths travel, shared copies replace them, overrides win, and
anything not shared without an override is one error naming the `--set` to add."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from areal.config import load_settings
from areal.launch.join import (
    JoinError,
    joined_config,
    portable_config,
    public_url_of,
    shared_files,
)
from schemas.run_files import RunFilesManifest, SharedFile


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("AREAL_")]:
        monkeypatch.delenv(key)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "launcher-cache" / "warm-x"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text("{}")  # 2 bytes
    (d / "model.safetensors").write_bytes(b"w" * 100)
    (d / "sub" / "extra.txt").write_text("abc")  # 3 bytes
    return d


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    p = tmp_path / "data" / "tasks.jsonl"
    p.parent.mkdir()
    p.write_text('{"prompt": "1+1=", "answer": "2"}\n')  # 35 bytes
    return p


def settings_for(model_dir: Path, data: Path | str, *sets: str):
    return load_settings(
        None,
        [
            f"model.path={model_dir}",
            f"data.source={data}",
            "cache_dir=/launcher/cache",
            "nats.url=nats://127.0.0.1:4222",
            "run_id=exp-1",
            *sets,
        ],
    )


def manifest_of(files: dict[str, bytes | Path]) -> RunFilesManifest:
    entries = []
    for name, src in files.items():
        data = src if isinstance(src, bytes) else src.read_bytes()
        entries.append(
            SharedFile(name=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        )
    return RunFilesManifest(run_id="exp-1", files=tuple(entries))


def materialise(files: dict[str, bytes | Path], dest: Path) -> Path:
    """What `fetch_run_files` leaves on disk for these files."""
    for name, src in files.items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(src if isinstance(src, bytes) else src.read_bytes())
    return dest


def test_the_portable_config_carries_no_host_paths_and_a_resolved_reward(model_dir, data_file):
    cfg = portable_config(settings_for(model_dir, data_file))
    assert cfg["model"]["path"] is None
    assert cfg["nats"]["url"] is None
    assert "cache_dir" not in cfg
    assert cfg["reward"]["fn"] == "math"  # the default for a dataset file, made explicit
    assert cfg["run_id"] == "exp-1"
    assert str(model_dir) not in json.dumps(cfg)


def test_the_portable_config_carries_no_credentials(model_dir, data_file, tmp_path):
    s = settings_for(model_dir, data_file)
    s.nats.credentials_dir = str(tmp_path / "launcher-keys" / "nats")
    s.nats.tls_ca_file = str(tmp_path / "launcher-ca.pem")
    cfg = portable_config(s)
    assert cfg["nats"]["credentials_dir"] is None and cfg["nats"]["tls_ca_file"] is None
    assert "launcher-" not in json.dumps(cfg)  # a joining worker passes its own --credentials


def test_model_then_data_are_shared_within_the_byte_budget(model_dir, data_file):
    everything = shared_files(settings_for(model_dir, data_file))
    assert sorted(everything) == [
        "config.json",
        "data/source/tasks.jsonl",
        "model/config.json",
        "model/model.safetensors",
        "model/sub/extra.txt",
    ]
    # 105 bytes of model fit, the 35-byte data file does not fit in the remaining 15
    model_only = shared_files(settings_for(model_dir, data_file, "nats.share_max_bytes=120"))
    assert sorted(model_only) == [
        "config.json",
        "model/config.json",
        "model/model.safetensors",
        "model/sub/extra.txt",
    ]
    config_only = shared_files(settings_for(model_dir, data_file, "nats.share_max_bytes=0"))
    assert list(config_only) == ["config.json"]


def test_a_synthetic_task_shares_no_data_file(model_dir):
    files = shared_files(settings_for(model_dir, "synthetic:arithmetic"))
    assert not [n for n in files if n.startswith("data/")]


def test_the_joined_config_points_into_the_shared_copy(model_dir, data_file, tmp_path):
    files = shared_files(settings_for(model_dir, data_file))
    copy = materialise(files, tmp_path / "remote-cache" / "exp-1-abc")
    path = joined_config(manifest_of(files), copy, ["nats.url=nats://launcher:4222"])
    s = load_settings(path, ["nats.url=nats://launcher:4222"])
    assert Path(s.model.path) == (copy / "model").resolve()
    assert (Path(s.model.path) / "model.safetensors").read_bytes() == b"w" * 100
    assert Path(s.data.source) == (copy / "data" / "source" / "tasks.jsonl").resolve()
    assert s.cache_dir is None  # this host's own cache, not the launcher's
    assert s.nats.url == "nats://launcher:4222"
    assert s.reward_fn_name() == "math"


def test_what_was_not_shared_needs_an_override_naming_the_fix(model_dir, data_file, tmp_path):
    files = shared_files(settings_for(model_dir, data_file, "nats.share_max_bytes=0"))
    copy = materialise(files, tmp_path / "copy")
    manifest = manifest_of(files)
    with pytest.raises(JoinError, match=r"did not share its model.*--set model\.path="):
        joined_config(manifest, copy, [])
    with pytest.raises(
        JoinError, match=r"did not share its data\.source .*--set data\.source="
    ):
        joined_config(manifest, copy, [f"model.path={model_dir}"])
    path = joined_config(manifest, copy, [f"model.path={model_dir}", f"data.source={data_file}"])
    s = load_settings(path, [f"model.path={model_dir}", f"data.source={data_file}"])
    assert s.model.path == str(model_dir) and s.data.source == str(data_file)


def test_an_eval_source_file_and_a_packaged_set_are_shared_as_configured(
    model_dir, data_file, tmp_path
):
    held = tmp_path / "held.json"
    held.write_text("{}")
    s = settings_for(model_dir, "champ", f"data.eval_source=champ:{held}", "data.eval_size=1")
    files = shared_files(s)
    # the packaged CHAMP set needs no file; the eval source's file travels under its setting
    assert [n for n in files if n.startswith("data/")] == ["data/eval_source/held.json"]
    copy = materialise(files, tmp_path / "copy")
    got = load_settings(joined_config(manifest_of(files), copy, []), [])
    assert got.data.source == "champ"
    assert (
        got.data.eval_source == f"champ:{(copy / 'data' / 'eval_source' / 'held.json').resolve()}"
    )


def test_only_a_non_loopback_url_is_offered_to_other_hosts():
    assert public_url_of("nats://127.0.0.1:4222") is None
    assert public_url_of("nats://localhost:4222") is None
    assert public_url_of("nats://[::1]:4222") is None
    assert public_url_of("nats://gpu-7.lab:4222") == "nats://gpu-7.lab:4222"


def test_of_a_cluster_the_servers_other_hosts_can_reach_are_offered():
    cluster = "nats://a.lab:4222, nats://127.0.0.1:4223,nats://b.lab:4222"
    assert public_url_of(cluster) == "nats://a.lab:4222,nats://b.lab:4222"
    assert public_url_of("nats://127.0.0.1:4222,nats://localhost:4223") is None


def test_nats_url_takes_a_list_of_servers_and_replicas_are_bounded():
    from areal.bus.connection import server_urls
    from areal.config import NatsSettings

    nats = NatsSettings(url=["nats://a:4222", "nats://b:4222"], replicas=3)
    assert nats.url == "nats://a:4222,nats://b:4222"
    assert server_urls(nats.url) == ["nats://a:4222", "nats://b:4222"]
    assert server_urls("nats://x:1") == ["nats://x:1"]  # one URL: exactly as before
    assert NatsSettings().replicas == 1
    for bad in (0, 6):
        with pytest.raises(ValueError):
            NatsSettings(replicas=bad)


def test_a_file_weights_run_is_joined_only_where_its_weights_dir_is(model_dir, tmp_path):
    """`areal run` sends weights as files when no other host reaches its server
    (`weights.transport: auto`): a joiner that does not see the dir is refused at start,
    naming the fix, instead of generating forever on weights it cannot load."""
    weights = tmp_path / "launcher-out" / "weights"
    s = settings_for(model_dir, "synthetic:arithmetic", "weights.transport=file")
    s.weights.dir = str(weights)
    files = shared_files(s)
    copy = materialise(files, tmp_path / "copy")
    with pytest.raises(
        JoinError,
        match=rf"files under {weights} .*mount it.*--set weights\.dir=.*"
        r"--set weights\.transport=object_store",
    ):
        joined_config(manifest_of(files), copy, [])
    here = tmp_path / "mounted-here"
    here.mkdir()
    path = joined_config(manifest_of(files), copy, [f"weights.dir={here}"])  # mounted elsewhere
    assert load_settings(path, [f"weights.dir={here}"]).weights.file_dir("x") == str(here)
    weights.mkdir(parents=True)  # this host sees the launcher's dir
    path = joined_config(manifest_of(files), copy, [])
    assert load_settings(path, []).weights.file_dir("x") == str(weights)


def test_the_readme_real_model_is_shared_by_default(tmp_path, data_file):
    # issue 44: SmolLM2-135M imported as bf16 is 272,585,653 bytes, over the old 256 MiB
    # default, so `--join` could not share the README's own real-model run (model_not_shared)
    model = tmp_path / "smollm2"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(272_585_653)  # sparse: the size is all `shared_files` looks at
    files = shared_files(settings_for(model, data_file))
    assert "model/model.safetensors" in files and "data/source/tasks.jsonl" in files
