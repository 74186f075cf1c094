"""The tracker adapters (`areal.tracking.backends`) and their settings: how W&B's mode is chosen,
the config as MLflow params, a missing library or a dead server failing fast with the fix, and
(slow) all three real libraries written through a `Tracker` and read back."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from areal.config import ConfigError, TrackingSettings, load_settings
from areal.tracking import Tracker, make_backends, tracker_for
from areal.tracking.backends import (
    MlflowBackend,
    TensorBoardBackend,
    WandbBackend,
    params,
    wandb_mode,
)

DEAD = "http://127.0.0.1:1"  # nothing listens on port 1
HAVE_ALL = all(importlib.util.find_spec(m) for m in ("tensorboard", "wandb", "mlflow"))


def test_tracking_takes_a_list_a_string_or_a_section():
    assert load_settings(None, []).tracking.backends == []
    assert load_settings(None, ["tracking=[tensorboard,wandb]"]).tracking.backends == [
        "tensorboard",
        "wandb",
    ]
    assert load_settings(None, ["tracking=mlflow,tensorboard"]).tracking.backends == [
        "mlflow",
        "tensorboard",
    ]
    s = load_settings(None, ["tracking.backends=[wandb]", "tracking.tags=[a,b]"]).tracking
    assert s.backends == ["wandb"] and s.tags == ["a", "b"]
    with pytest.raises(ConfigError, match="did you mean 'tensorboard'"):
        load_settings(None, ["tracking=[tensorbord]"])
    with pytest.raises(ConfigError, match="names a tracker twice"):
        load_settings(None, ["tracking=[wandb,wandb]"])


def test_the_trackers_and_where_they_write(tmp_path: Path):
    out = tmp_path / "exp7"
    assert tracker_for(TrackingSettings(), out_dir=out, config={}) is None
    tb, wb, ml = make_backends(TrackingSettings(backends=["tensorboard", "wandb", "mlflow"]), out)
    assert isinstance(tb, TensorBoardBackend) and tb.logdir == out / "tb"
    assert isinstance(wb, WandbBackend) and wb.out_dir == out and wb.run_name == "exp7"
    assert isinstance(ml, MlflowBackend) and ml.uri == (out / "mlruns").resolve().as_uri()
    (ml,) = make_backends(
        TrackingSettings(backends=["mlflow"], mlflow_uri=DEAD, run_name="r", project="p"), out
    )
    assert (ml.uri, ml.run_name, ml.project) == (DEAD, "r", "p")


def test_wandb_mode_auto_is_online_only_with_an_api_key(tmp_path: Path):
    url = "https://api.wandb.ai"
    no_netrc = {"NETRC": str(tmp_path / "none")}
    assert wandb_mode("auto", no_netrc, url) == "offline"
    assert wandb_mode("auto", {**no_netrc, "WANDB_API_KEY": "k"}, url) == "online"
    assert wandb_mode("auto", {**no_netrc, "WANDB_MODE": "disabled"}, url) == "disabled"
    rc = tmp_path / "netrc"
    rc.write_text("machine api.wandb.ai\n  login user\n  password k\n")
    rc.chmod(0o600)
    assert wandb_mode("auto", {"NETRC": str(rc)}, url) == "online"  # `wandb login`
    assert wandb_mode("auto", {"NETRC": str(rc)}, "https://other.example") == "offline"
    assert wandb_mode("offline", {"WANDB_API_KEY": "k"}, url) == "offline"
    assert wandb_mode("online", no_netrc, url) == "online"


def test_the_config_becomes_flat_mlflow_params():
    cfg = {"run_id": "r", "algo": {"batch_size": 8, "eps": 0.2}, "tags": ["a"], "x": None}
    cfg["data"] = {"task_kwargs": {"odd key!": "v" * 600}, "empty": {}}
    assert params(cfg) == {
        "run_id": "r",
        "algo.batch_size": "8",
        "algo.eps": "0.2",
        "tags": '["a"]',
        "x": "null",
        "data.task_kwargs.odd key_": "v" * 500,
        "data.empty": "{}",
    }


def test_a_missing_library_warns_once_naming_the_extra(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    t = Tracker([TensorBoardBackend(tmp_path / "tb")], config={})
    with capture_logs() as logs:
        t.start()
        t.log_step({"step": 1, "loss": 1.0})
        stats = t.close(timeout_s=10)
    (ev,) = [e for e in logs if e["event"] == "tracker_failed"]
    assert ev["tracker"] == "tensorboard" and "pip install 'areal-bus[tracking]'" in ev["fix"]
    assert stats["tensorboard"].dropped == 1


def test_an_mlflow_server_that_is_not_there_fails_at_once_naming_the_uri():
    ml = MlflowBackend(uri=DEAD, project="p", run_name="r", tags=[])
    t0 = time.monotonic()
    with pytest.raises(ConnectionError) as e:
        ml.open({})  # the reachability check comes first: MLflow would retry for minutes
    assert time.monotonic() - t0 < 30  # a hang guard, not a timing claim
    assert "tracking.mlflow_uri" in ml.fix(e.value) and DEAD in ml.fix(e.value)


def test_wandb_online_against_a_dead_server_fails_at_once_suggesting_offline(
    tmp_path: Path, monkeypatch
):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_BASE_URL", DEAD)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    wb = WandbBackend(out_dir=tmp_path, project="p", run_name="r", tags=[], mode="auto")
    with pytest.raises(ConnectionError) as e:
        wb.open({})
    assert "wandb_mode=offline" in wb.fix(e.value) and "wandb sync" in wb.fix(e.value)
    assert not (tmp_path / "wandb").exists()


@pytest.mark.slow  # imports the three libraries (~5 s on 2 cores)
@pytest.mark.skipif(not HAVE_ALL, reason="needs the tracking extra: pip install '.[tracking]'")
def test_the_three_trackers_write_what_their_readers_read_back(tmp_path: Path, monkeypatch):
    from tests.trackers import mlflow_metric, mlflow_runs, tb_scalars, tb_tags, wandb_history

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # auto -> offline
    out = tmp_path / "run"
    settings = TrackingSettings(backends=["tensorboard", "wandb", "mlflow"], tags=["unit"])
    config = {"run_id": "unit", "algo": {"batch_size": 4}}
    tracker = tracker_for(settings, out_dir=out, config=config)
    assert tracker is not None
    tracker.start()
    for n in (1, 2, 3):
        tracker.log_step({"step": n, "reward_mean": n / 4, "staleness_hist": {"0": 8}})
    tracker.log_eval({"round": 0, "version": 2, "eval_reward": 0.5, "n": 4})
    stats = tracker.close(timeout_s=60)
    assert {k: (s.logged, s.dropped, s.error) for k, s in stats.items()} == {
        k: (4, 0, None) for k in ("tensorboard", "wandb", "mlflow")
    }

    assert tb_scalars(out / "tb", "train/reward_mean") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert tb_scalars(out / "tb", "eval/reward") == [(2, 0.5)]  # at the policy version
    tags = tb_tags(out / "tb")
    assert "train/staleness_hist/0" in tags["scalars"] and "config/text_summary" in tags["tensors"]

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    rows = wandb_history(run_file)
    assert [(r.get("train/step"), r.get("train/reward_mean")) for r in rows[:3]] == [
        (1, 0.25),
        (2, 0.5),
        (3, 0.75),
    ]
    assert rows[3]["eval/version"] == 2 and rows[3]["eval/reward"] == 0.5

    (run,) = mlflow_runs(out / "mlruns")
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["algo.batch_size"] == "4" and run.data.tags["unit"] == "true"
    assert mlflow_metric(out / "mlruns", run.info.run_id, "train/reward_mean") == [
        (1, 0.25),
        (2, 0.5),
        (3, 0.75),
    ]


def test_overwrite_deletes_what_the_trackers_wrote_in_out(tmp_path: Path):
    from areal.launch.run_dir import prepare_new

    (tmp_path / "config.json").write_text("{}")
    for d in ("tb", "wandb", "mlruns"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "f").write_text("x")  # else a new run's TensorBoard curves mix in
    (tmp_path / "notes.txt").write_text("mine")
    gone = prepare_new(tmp_path, overwrite=True, weights_in_out=True)
    assert {p.name for p in gone} == {"config.json", "tb", "wandb", "mlruns"}
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
